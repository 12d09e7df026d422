"""Session lifetime decisions (pure) and the reaper that carries them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.exceptions import ConflictError
from proxy.sessions.expiry import ExpiryAction, ExpiryPolicy, Reaper, plan_expiry
from proxy.sessions.model import CompletedBy, Session, SessionState, TrialId
from proxy.sessions.registry import SessionRegistry
from proxy.sessions.store import SessionStore

POLICY = ExpiryPolicy(
    idle_seconds=10, max_age_seconds=100, retention_seconds=50, fetched_retention_seconds=5
)


def _session(name: str, *, created: float, updated: float) -> Session:
    return Session(TrialId(name), "k", created_at=created, updated_at=updated)


def _completed(name: str, *, at: float, fetched: float | None = None) -> Session:
    s = _session(name, created=0, updated=at)
    s.state = SessionState.COMPLETED
    s.completed_at = at
    s.fetched_at = fetched
    return s


def test_idle_and_old_sessions_are_completed_with_the_reason() -> None:
    """Idle past the timeout → complete (idle); past the maximum age → complete (max age),
    which wins when both apply; a recent session is left alone."""
    now = 1000.0
    fresh = _session("fresh", created=990, updated=995)
    idle = _session("idle", created=950, updated=989)
    old = _session("old", created=899, updated=999)
    both = _session("both", created=800, updated=800)
    plan = plan_expiry([fresh, idle, old, both], now, POLICY)
    assert [(s.trial_id, a) for s, a in plan] == [
        ("idle", ExpiryAction.COMPLETE_IDLE),
        ("old", ExpiryAction.COMPLETE_MAX_AGE),
        ("both", ExpiryAction.COMPLETE_MAX_AGE),
    ]


def test_completed_sessions_are_reaped_after_fetch_or_retention() -> None:
    """A completed session is kept until its trajectories were fetched (plus the fetched
    retention) or the retention passed; never reaped straight from active."""
    now = 1000.0
    kept = _completed("kept", at=990)
    fetched_recently = _completed("recent", at=990, fetched=998)
    fetched = _completed("fetched", at=990, fetched=995)
    unfetched_old = _completed("unfetched", at=950)
    plan = plan_expiry([kept, fetched_recently, fetched, unfetched_old], now, POLICY)
    assert [(s.trial_id, a) for s, a in plan] == [
        ("fetched", ExpiryAction.REAP),
        ("unfetched", ExpiryAction.REAP),
    ]


def test_zero_disables_a_rule() -> None:
    """With every limit 0 nothing ever expires and the reaper does not run."""
    off = ExpiryPolicy()
    assert not off.enabled
    ancient = [_session("a", created=0, updated=0), _completed("b", at=0, fetched=0)]
    assert plan_expiry(ancient, 1e12, off) == []


def test_sweep_interval_follows_the_shortest_limit() -> None:
    """The reaper looks often enough for the shortest limit, within sane bounds."""
    assert POLICY.interval_seconds == pytest.approx(1.25)
    assert ExpiryPolicy(idle_seconds=0.01).interval_seconds == pytest.approx(0.05)
    assert ExpiryPolicy(retention_seconds=86400).interval_seconds == 30.0


async def test_reaper_completes_then_removes_from_memory_and_store(tmp_path: Path) -> None:
    """A sweep completes an idle session durably; a later sweep past retention removes it
    from the registry and the store, and its id answers 'deleted' afterwards."""
    store = await SessionStore.open(tmp_path)
    registry = SessionRegistry()
    registry.store = store
    session = registry.create("idle-one", metadata={}, sampling={}, model=None)
    await registry.save(session)
    done: list[str] = []
    reaper = Reaper(registry, POLICY, on_done=done.append)

    await reaper.sweep(now=session.updated_at + 11)
    assert session.state is SessionState.COMPLETED
    assert session.completed_by is CompletedBy.IDLE_TIMEOUT
    (stored,) = (await store.load()).sessions
    assert stored.state is SessionState.COMPLETED
    assert stored.completed_by is CompletedBy.IDLE_TIMEOUT

    assert session.completed_at is not None
    await reaper.sweep(now=session.completed_at + 51)
    with pytest.raises(ConflictError):
        registry.get("idle-one")
    loaded = await store.load()
    await store.close()
    assert loaded.sessions == []
    assert loaded.tombstones == ["idle-one"]
    assert done == ["idle-one", "idle-one"]
    assert (reaper.completed, reaper.reaped) == (1, 1)
