"""The session registry's listing for the viewer."""

from __future__ import annotations

from proxy.sessions.registry import SessionRegistry


def test_newest_lists_the_latest_registrations_first() -> None:
    registry = SessionRegistry()
    for i in range(5):
        registry.create(f"t{i}", metadata={}, sampling={}, model=None)
    assert [s.trial_id for s in registry.newest(3)] == ["t4", "t3", "t2"]
    assert [s.trial_id for s in registry.newest(10)] == ["t4", "t3", "t2", "t1", "t0"]
    registry.discard(registry.get("t3").trial_id)
    assert [s.trial_id for s in registry.newest(2)] == ["t4", "t2"]
