"""The proxy-side pool of connected workers.

Choosing a worker is a pure function (``choose_worker``); the pool performs the I/O it
decides on. A request is a ``RelayCall``: the caller iterates its events (token deltas, a
restart notice when its worker was lost and the request was re-dispatched from the start
on another worker, and a final ``Finished``). Cancelling a call (the agent went away) sends
``Cancel`` to the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import NewType, Protocol

from relay import protocol
from relay.exceptions import (
    NoWorkerAvailableError,
    ProtocolError,
    RelayError,
    RequestCancelledError,
    WorkerFailedError,
)

log = logging.getLogger(__name__)

WorkerId = NewType("WorkerId", str)
RequestId = NewType("RequestId", str)


class WorkerLink(Protocol):
    """The transport to one worker (a WebSocket in production)."""

    async def send(self, data: bytes) -> None: ...

    async def close(self, reason: str) -> None: ...


@dataclass(slots=True, eq=False)
class WorkerHandle:
    worker_id: WorkerId
    link: WorkerLink
    endpoint: protocol.ProxyEndpoint
    models: dict[str, protocol.ModelInfo]
    max_concurrency: int
    in_flight: set[RequestId] = field(default_factory=set)
    connected_at: float = field(default_factory=time.time)
    served: int = 0

    def __repr__(self) -> str:
        return (
            f"<WorkerHandle {self.worker_id} {self.endpoint.state.value} "
            f"in_flight={len(self.in_flight)}/{self.max_concurrency}>"
        )


# --------------------------------------------------------------------------- decisions


@dataclass(slots=True, frozen=True)
class WorkerLoad:
    worker_id: WorkerId
    in_flight: int
    capacity: int


def choose_worker(
    candidates: Sequence[WorkerLoad], preferred: WorkerId | None, slack: int = 2
) -> WorkerId | None:
    """Pick the worker for a request, or None when every candidate is at capacity.

    The worker that served the same session last is kept (its engine still holds the
    session's prefix in cache) unless it is more than ``slack`` requests busier than the
    least loaded worker; otherwise least in-flight wins, ties broken by id for determinism.
    """
    free = [c for c in candidates if c.in_flight < c.capacity]
    if not free:
        return None
    least = min(c.in_flight for c in free)
    if preferred is not None:
        for c in free:
            if c.worker_id == preferred and c.in_flight <= least + slack:
                return preferred
    return min(free, key=lambda c: (c.in_flight, c.worker_id)).worker_id


# --------------------------------------------------------------------------- events


@dataclass(slots=True, frozen=True)
class TokensEvent:
    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True, frozen=True)
class RestartedEvent:
    """The worker was lost; the request restarts from its beginning on another worker.
    Every token received so far for this call must be discarded."""

    reason: str


@dataclass(slots=True, frozen=True)
class FinishedEvent:
    finish_reason: str
    worker_id: WorkerId
    extra: dict[str, str | int | float]


RelayEvent = TokensEvent | RestartedEvent | FinishedEvent


class RequestState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


_TERMINAL = {RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED}


class RelayCall:
    """One generation request travelling through the pool."""

    def __init__(
        self,
        pool: WorkerPool,
        request_id: RequestId,
        model: str,
        prompt_ids: Sequence[int],
        sampling: protocol.Sampling,
        affinity: str | None,
    ) -> None:
        self.pool = pool
        self.request_id = request_id
        self.model = model
        self.prompt = protocol.pack_ids(prompt_ids)
        self.sampling = sampling
        self.affinity = affinity
        self.state = RequestState.QUEUED
        self.worker_id: WorkerId | None = None
        self.attempts = 0
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None
        self._events: asyncio.Queue[RelayEvent | RelayError] = asyncio.Queue()

    def __repr__(self) -> str:
        return f"<RelayCall {self.request_id} {self.state.value} worker={self.worker_id}>"

    def _transition(self, state: RequestState) -> None:
        if self.state in _TERMINAL:
            raise RelayError(f"request {self.request_id} is {self.state.value}; cannot be {state}")
        self.state = state

    def _push(self, event: RelayEvent | RelayError) -> None:
        self._events.put_nowait(event)

    async def events(self) -> AsyncIterator[RelayEvent]:
        """Yield events until ``FinishedEvent``; raise the call's error if it failed."""
        while True:
            event = await self._events.get()
            if isinstance(event, RelayError):
                raise event
            yield event
            if isinstance(event, FinishedEvent):
                return

    async def cancel(self) -> None:
        """Abort the request (idempotent; no-op once finished)."""
        await self.pool.cancel(self)


class WorkerPool:
    """Connected workers and the requests in flight on them."""

    def __init__(self, *, wait_seconds: float = 30.0, max_attempts: int = 3) -> None:
        self.wait_seconds = wait_seconds
        self.max_attempts = max_attempts
        self.workers: dict[WorkerId, WorkerHandle] = {}
        self._calls: dict[RequestId, RelayCall] = {}
        self._affinity: OrderedDict[str, WorkerId] = OrderedDict()
        self._affinity_cap = 65536
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<WorkerPool workers={len(self.workers)} in_flight={len(self._calls)}>"

    # ------------------------------------------------------------------ membership

    def served_models(self) -> dict[str, protocol.ModelInfo]:
        models: dict[str, protocol.ModelInfo] = {}
        for handle in self.workers.values():
            for name, info in handle.models.items():
                models.setdefault(name, info)
        return models

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def add_worker(self, handle: WorkerHandle) -> None:
        old = self.workers.get(handle.worker_id)
        if old is not None:
            # Same worker reconnecting before its old socket was noticed dead.
            await self.remove_worker(old, reason="replaced by a new connection")
        self.workers[handle.worker_id] = handle
        log.info("worker %s joined with models %s", handle.worker_id, sorted(handle.models))
        await self._notify()

    async def disconnect_all(self, reason: str) -> None:
        """Close every worker's connection (the proxy is shutting down); the endpoint's
        handlers then remove the workers as their sockets end."""
        for handle in list(self.workers.values()):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await handle.link.close(reason)

    async def remove_worker(self, handle: WorkerHandle, reason: str) -> None:
        """Forget a worker; re-dispatch every request it had in flight."""
        if self.workers.get(handle.worker_id) is not handle:
            return
        del self.workers[handle.worker_id]
        handle.endpoint.close()
        lost = [self._calls[r] for r in handle.in_flight if r in self._calls]
        handle.in_flight.clear()
        log.warning(
            "worker %s left (%s); %d requests in flight", handle.worker_id, reason, len(lost)
        )
        for call in lost:
            if call.attempts >= self.max_attempts:
                self._fail(call, WorkerFailedError("worker_lost", f"worker lost: {reason}"))
                continue
            call.state = RequestState.QUEUED
            call.worker_id = None
            call._push(RestartedEvent(reason))
            task = asyncio.get_running_loop().create_task(self._redispatch(call))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for_models(self) -> dict[str, protocol.ModelInfo]:
        """The served models, waiting up to ``wait_seconds`` for a first worker."""
        deadline = time.monotonic() + self.wait_seconds
        while not self.workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)
        return self.served_models()

    # ------------------------------------------------------------------ requests

    async def start(
        self,
        model: str,
        prompt_ids: Sequence[int],
        sampling: protocol.Sampling,
        *,
        affinity: str | None = None,
        request_id: str | None = None,
    ) -> RelayCall:
        """Dispatch a request, waiting up to ``wait_seconds`` for a free worker."""
        rid = RequestId(request_id or f"req-{next(self._ids)}")
        call = RelayCall(self, rid, model, prompt_ids, sampling, affinity)
        self._calls[rid] = call
        try:
            await self._dispatch(call)
        except BaseException:
            self._calls.pop(rid, None)
            raise
        return call

    async def _redispatch(self, call: RelayCall) -> None:
        try:
            await self._dispatch(call)
        except RelayError as exc:
            self._fail(call, exc)

    async def _dispatch(self, call: RelayCall) -> None:
        deadline = time.monotonic() + self.wait_seconds
        while True:
            if call.state is RequestState.CANCELLED:
                raise RequestCancelledError(call.request_id)
            handle = self._pick(call)
            if handle is not None:
                call.attempts += 1
                call.worker_id = handle.worker_id
                call.state = RequestState.RUNNING
                call.started_at = time.perf_counter()
                handle.in_flight.add(call.request_id)
                message = protocol.Generate(call.request_id, call.model, call.prompt, call.sampling)
                try:
                    await handle.link.send(handle.endpoint.generate(message))
                except (ConnectionError, ProtocolError, RuntimeError) as exc:
                    handle.in_flight.discard(call.request_id)
                    call.state = RequestState.QUEUED
                    await self.remove_worker(handle, reason=f"send failed: {exc}")
                    continue
                if call.affinity is not None:
                    self._remember(call.affinity, handle.worker_id)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoWorkerAvailableError(call.model, self.wait_seconds)
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)

    def _pick(self, call: RelayCall) -> WorkerHandle | None:
        loads = [
            WorkerLoad(h.worker_id, len(h.in_flight), h.max_concurrency)
            for h in self.workers.values()
            if call.model in h.models
        ]
        preferred = self._affinity.get(call.affinity) if call.affinity else None
        chosen = choose_worker(loads, preferred)
        return self.workers[chosen] if chosen is not None else None

    def _remember(self, key: str, worker_id: WorkerId) -> None:
        self._affinity[key] = worker_id
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._affinity_cap:
            self._affinity.popitem(last=False)

    def forget_affinity(self, key: str) -> None:
        self._affinity.pop(key, None)

    async def cancel(self, call: RelayCall) -> None:
        if call.state in _TERMINAL:
            return
        handle = self.workers.get(call.worker_id) if call.worker_id else None
        call.state = RequestState.CANCELLED
        self._calls.pop(call.request_id, None)
        if handle is not None and call.request_id in handle.in_flight:
            handle.in_flight.discard(call.request_id)
            frame = handle.endpoint.cancel(call.request_id)
            if frame is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await handle.link.send(frame)
            await self._notify()

    def _fail(self, call: RelayCall, error: RelayError) -> None:
        if call.state in _TERMINAL:
            return
        call.state = RequestState.FAILED
        self._calls.pop(call.request_id, None)
        call._push(error)

    # ------------------------------------------------------------------ inbound frames

    async def handle_message(self, handle: WorkerHandle, message: protocol.WorkerMessage) -> None:
        """Route one decoded (and state-checked) message from a worker."""
        if isinstance(message, protocol.Ping):
            await handle.link.send(protocol.encode(protocol.Pong(message.nonce)))
            return
        if isinstance(message, protocol.Pong | protocol.Hello):
            return
        if message.request_id is None:
            assert isinstance(message, protocol.Error)
            log.warning("worker %s reported: %s", handle.worker_id, message.message)
            return
        rid = RequestId(message.request_id)
        call = self._calls.get(rid)
        if call is None or call.worker_id != handle.worker_id:
            return  # late frames of a cancelled or re-dispatched request
        if isinstance(message, protocol.Delta):
            call._push(
                TokensEvent(
                    protocol.unpack_ids(message.token_ids),
                    protocol.unpack_logprobs(message.logprobs),
                )
            )
            return
        handle.in_flight.discard(rid)
        self._calls.pop(rid, None)
        if isinstance(message, protocol.Done):
            handle.served += 1
            if message.token_ids:
                call._push(
                    TokensEvent(
                        protocol.unpack_ids(message.token_ids),
                        protocol.unpack_logprobs(message.logprobs),
                    )
                )
            call._transition(RequestState.FINISHED)
            call._push(FinishedEvent(message.finish_reason, handle.worker_id, dict(message.extra)))
        else:
            self._fail(call, WorkerFailedError(message.code, message.message))
        await self._notify()
