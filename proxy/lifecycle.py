"""Serving, draining, stopped: what the proxy accepts during a graceful shutdown.

On SIGTERM the proxy drains: ``/readyz`` turns 503 (a load balancer stops sending agents),
new turns and new sessions get 503 with Retry-After in the caller's API format, turns
already running finish (up to the drain bound); the session API stays open so trainers can
still fetch trajectories. Then the server stops, which closes the worker sockets and cancels
whatever is still running (those turns are recorded as truncated).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.exceptions import ServiceUnavailableError
from proxy.observability import api_of, route_of
from relay.pool import WorkerPool

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Routes that start new work: refused while draining, counted while running.
TURN_APIS = frozenset(
    {"openai.chat", "openai.completions", "openai.responses", "anthropic.messages"}
)


class ProxyState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_NEXT = {
    ProxyState.SERVING: {ProxyState.DRAINING, ProxyState.STOPPED},
    ProxyState.DRAINING: {ProxyState.STOPPED},
    ProxyState.STOPPED: set(),
}


class Lifecycle:
    def __init__(self, *, retry_after_seconds: int = 5) -> None:
        self.state = ProxyState.SERVING
        self.retry_after_seconds = retry_after_seconds
        self.active = 0  # turn requests being answered
        self._idle = asyncio.Event()
        self._idle.set()

    def __repr__(self) -> str:
        return f"<Lifecycle {self.state.value} active={self.active}>"

    def _transition(self, state: ProxyState) -> None:
        if state is self.state:
            return
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"the proxy cannot go from {self.state.value} to {state.value}")
        self.state = state

    @property
    def accepting(self) -> bool:
        return self.state is ProxyState.SERVING

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def drain(self, pool: WorkerPool, within_seconds: float) -> bool:
        """Stop accepting turns and wait up to ``within_seconds`` for running ones to finish.
        True when everything finished in time."""
        self._transition(ProxyState.DRAINING)
        log.info(
            "draining: %d turn requests and %d relay requests in flight",
            self.active,
            pool.in_flight,
        )
        try:
            async with asyncio.timeout(within_seconds):
                await self._idle.wait()
        except TimeoutError:
            log.warning(
                "drain bound of %gs reached with %d turn requests still running; "
                "they are cancelled and recorded as truncated",
                within_seconds,
                self.active,
            )
            return False
        log.info("drained")
        return True

    def stopped(self) -> None:
        self._transition(ProxyState.STOPPED)


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)


def _starts_work(request: web.Request) -> bool:
    route = route_of(request)
    if api_of(route) in TURN_APIS:
        return True
    return request.method == "POST" and route in {"/sessions", "/sessions/{trial_id}"}


@web.middleware
async def drain_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses new work while draining; counts the turn requests being answered. Sits
    inside the error middleware so the refusal is in the caller's API format."""
    if not _starts_work(request):
        return await handler(request)
    lifecycle = request.app[LIFECYCLE]
    if not lifecycle.accepting:
        raise ServiceUnavailableError(
            "the proxy is shutting down; retry against another replica or later",
            retry_after=lifecycle.retry_after_seconds,
            code="shutting_down",
        )
    lifecycle.enter()
    try:
        return await handler(request)
    finally:
        lifecycle.leave()
