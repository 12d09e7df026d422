"""Session lifetime: when an open session is completed by the proxy, and when a completed
one is reaped (removed from memory and from the store).

* An **active** session with no request for ``idle_seconds``, or older than
  ``max_age_seconds``, is completed (``completed_by`` says why); its turns stay available.
* A **completed** session is reaped ``fetched_retention_seconds`` after its trajectories
  were first fetched, or ``retention_seconds`` after it was completed, whichever is first.
  A reaped trial answers 409 ``session_deleted``, like a deleted one.

``plan_expiry`` decides (pure); ``Reaper`` performs what it decided, periodically.
A limit of 0 disables that rule.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from proxy.exceptions import ConflictError, NotFoundError, ProxyError
from proxy.sessions.model import CompletedBy, Session, SessionState, TrialId
from proxy.sessions.registry import SessionRegistry

__all__ = ["ExpiryAction", "ExpiryPolicy", "Reaper", "plan_expiry"]

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ExpiryPolicy:
    idle_seconds: float = 0.0
    max_age_seconds: float = 0.0
    retention_seconds: float = 0.0
    fetched_retention_seconds: float = 0.0

    @property
    def enabled(self) -> bool:
        return any(s > 0 for s in self._limits())

    def _limits(self) -> tuple[float, ...]:
        return (
            self.idle_seconds,
            self.max_age_seconds,
            self.retention_seconds,
            self.fetched_retention_seconds,
        )

    @property
    def interval_seconds(self) -> float:
        """How often to sweep: a quarter of the shortest limit, between 50 ms and 30 s."""
        shortest = min((s for s in self._limits() if s > 0), default=120.0)
        return min(30.0, max(0.05, shortest / 4))


class ExpiryAction(enum.Enum):
    COMPLETE_IDLE = "complete_idle"
    COMPLETE_MAX_AGE = "complete_max_age"
    REAP = "reap"


def plan_expiry(
    sessions: Iterable[Session], now: float, policy: ExpiryPolicy
) -> list[tuple[Session, ExpiryAction]]:
    """What to do with each session that is due, in the order given."""
    due: list[tuple[Session, ExpiryAction]] = []
    for session in sessions:
        if session.state is SessionState.ACTIVE:
            if policy.max_age_seconds > 0 and now - session.created_at >= policy.max_age_seconds:
                due.append((session, ExpiryAction.COMPLETE_MAX_AGE))
            elif policy.idle_seconds > 0 and now - session.updated_at >= policy.idle_seconds:
                due.append((session, ExpiryAction.COMPLETE_IDLE))
        elif session.state is SessionState.COMPLETED:
            completed = session.completed_at if session.completed_at is not None else now
            fetched = session.fetched_at
            if (
                policy.fetched_retention_seconds > 0
                and fetched is not None
                and now - fetched >= policy.fetched_retention_seconds
            ) or (policy.retention_seconds > 0 and now - completed >= policy.retention_seconds):
                due.append((session, ExpiryAction.REAP))
    return due


class Reaper:
    """Applies ``plan_expiry`` every ``policy.interval_seconds``."""

    def __init__(
        self,
        registry: SessionRegistry,
        policy: ExpiryPolicy,
        *,
        on_done: Callable[[TrialId], None] | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.on_done = on_done  # called for every session completed or reaped
        self.completed = 0
        self.reaped = 0

    def __repr__(self) -> str:
        return f"<Reaper completed={self.completed} reaped={self.reaped}>"

    async def run(self) -> None:
        if not self.policy.enabled:
            return
        while True:
            await asyncio.sleep(self.policy.interval_seconds)
            try:
                await self.sweep()
            except ProxyError as exc:  # the store failed: try again next round
                log.error("session expiry sweep failed: %s", exc)

    async def sweep(self, now: float | None = None) -> None:
        when = time.time() if now is None else now
        for session, action in plan_expiry(self.registry.sessions(), when, self.policy):
            if action is ExpiryAction.REAP:
                try:
                    await self.registry.remove(session.trial_id)
                except (ConflictError, NotFoundError):  # deleted meanwhile
                    continue
                self.reaped += 1
                log.info("session %s reaped", session.trial_id)
            else:
                if session.state is not SessionState.ACTIVE:  # completed meanwhile
                    continue
                by = (
                    CompletedBy.IDLE_TIMEOUT
                    if action is ExpiryAction.COMPLETE_IDLE
                    else CompletedBy.MAX_AGE
                )
                session.transition(SessionState.COMPLETED, by=by)
                await self.registry.save(session)
                self.completed += 1
                log.info("session %s completed: %s", session.trial_id, by.value)
            if self.on_done is not None:
                self.on_done(session.trial_id)
