"""The proxy-side pool of connected workers.

Choosing a worker is a pure function (``choose_worker``); the pool performs the I/O it
decides on. A request is a ``RelayCall``: the caller iterates its events (token deltas, a
restart or resume notice when its worker was lost and the request was re-dispatched on
another worker, and a final ``Finished``). Cancelling a call (the agent went away) sends
``Cancel`` to the worker.

Backpressure: a worker takes at most its announced concurrency (optionally capped lower),
the pool at most ``max_in_flight`` overall. Requests beyond that wait in a bounded
``FairQueue`` keyed by trial and are served round-robin across trials, so one trial that
floods the proxy delays only itself. A full queue refuses at once (``PoolOverloadedError``);
a request that waits longer than ``wait_seconds`` fails (``NoWorkerAvailableError``).

Weights (see ``relay.weights``): the pool knows the policy version its workers serve and
each worker's own. While a weight update runs the pool is *held*: requests wait in the
queue (never refused, however long the update takes) and a worker that joins serves
nothing until it loads the current weights. Every call keeps the version of each stretch
of tokens it received (``RelayCall.version_spans``): a request preempted by an update
continues from its tokens on the new weights, and its reply says which tokens came from
which version.

Routing rows (protocol 5): a call started with ``routed_experts_from=k`` runs only on a
worker that reports routing for its model, and gathers the rows its attempts' ``Done``
frames bring into ``RelayCall.routed`` (rows ``k`` onwards, each kept once: rows an engine
gives from before what was asked are dropped). An attempt continued after a lost worker or a
preemption asks from where the rows gathered so far end.

Teachers (protocol 6): a call started with ``score_from=k`` is a ``Score`` request (teacher
forcing of its ids from ``k`` on, ``relay.scoring``) and runs only on a worker that speaks
version 6. A worker that serves only teachers (``serves_policy`` is False) keeps its own
weights: it never joins behind the pool's version nor takes part in a weight update.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NewType, Protocol, TypeVar

import msgspec

from relay import protocol
from relay.exceptions import (
    NoWorkerAvailableError,
    PoolOverloadedError,
    ProtocolError,
    RelayError,
    RequestCancelledError,
    WorkerFailedError,
)
from relay.images import ImageLedger, PromptImage

log = logging.getLogger(__name__)

WorkerId = NewType("WorkerId", str)
RequestId = NewType("RequestId", str)

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")


class WorkerLink(Protocol):
    """The transport to one worker (a WebSocket in production)."""

    async def send(self, data: bytes) -> None: ...

    async def close(self, reason: str) -> None: ...


class WorkerState(enum.Enum):
    JOINING = "joining"  # connected, loading the current weights before serving anything
    SERVING = "serving"
    UPDATING = "updating"  # in a weight update: paused, loading or committing
    OUT_OF_SERVICE = "out_of_service"  # could not load the current weights; being closed


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
    state: WorkerState = WorkerState.SERVING
    version: int = 0  # the policy version the worker serves
    # The checkpoint its version came from (None: its startup model, or stamped).
    weights_path: str | None = None
    # Answers awaited from the worker, per (update id, phase).
    acks: dict[tuple[str, protocol.UpdatePhase], asyncio.Future[protocol.UpdateAck]] = field(
        default_factory=dict
    )
    images: ImageLedger = field(default_factory=ImageLedger)  # the images it holds
    # A request's drops, images and Generate go out together: another request's frames in
    # between could drop an image it is about to use.
    image_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __repr__(self) -> str:
        return (
            f"<WorkerHandle {self.worker_id} {self.endpoint.state.value} {self.state.value} "
            f"v{self.version} in_flight={len(self.in_flight)}/{self.max_concurrency}>"
        )


def serves_policy(handle: WorkerHandle) -> bool:
    """Whether the worker's weights follow the pool's version: False only for a worker of
    teachers alone, which keeps the weights it started with."""
    models = handle.models.values()
    return not models or any(not info.teacher for info in models)


def reports_routing(handle: WorkerHandle, model: str) -> bool:
    """Whether the worker may be asked for ``model``'s routing rows: it speaks protocol 5
    and announced the model's routing shape."""
    info = handle.models.get(model)
    return handle.endpoint.reports_routing and info is not None and info.routing is not None


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


class FairQueue(Generic[K, T]):
    """Waiting items in one FIFO per key (a trial), served round-robin across keys.

    ``pop_next`` offers each key's oldest item in turn; the key that is served moves to the
    back, a key whose head cannot be placed keeps its place. No I/O, no asyncio."""

    def __init__(self) -> None:
        self._lanes: OrderedDict[K, deque[T]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"<FairQueue keys={len(self._lanes)} items={self._size}>"

    def count(self, key: K) -> int:
        lane = self._lanes.get(key)
        return len(lane) if lane is not None else 0

    def push(self, key: K, item: T, *, front: bool = False) -> None:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = deque()
        if front:
            lane.appendleft(item)
        else:
            lane.append(item)
        self._size += 1

    def remove(self, key: K, item: T) -> bool:
        lane = self._lanes.get(key)
        if lane is None or item not in lane:
            return False
        lane.remove(item)
        self._size -= 1
        if not lane:
            del self._lanes[key]
        return True

    def pop_next(self, place: Callable[[T], R | None]) -> tuple[T, R] | None:
        """The first key's head that ``place`` accepts (returns non-None for), removed."""
        for key, lane in self._lanes.items():
            placed = place(lane[0])
            if placed is None:
                continue
            item = lane.popleft()
            self._size -= 1
            if lane:
                self._lanes.move_to_end(key)
            else:
                del self._lanes[key]
            return item, placed
        return None


@dataclass(slots=True, frozen=True)
class PoolLimits:
    """Backpressure bounds. 0 means no bound of that kind."""

    max_in_flight: int = 0  # requests running on workers, over all workers
    max_in_flight_per_worker: int = 0  # caps each worker's announced concurrency
    max_queued: int = 4096  # requests waiting for a slot, over all trials
    max_queued_per_trial: int = 256  # requests one trial may have waiting


@dataclass(slots=True)
class PoolStats:
    """Monotonic counters, read by the metrics exporter."""

    dispatched: int = 0
    restarted: int = 0  # re-dispatched from the start after a worker was lost
    resumed: int = 0  # continued from the tokens already sampled after a worker was lost
    worker_joins: int = 0
    worker_disconnects: int = 0
    worker_evictions: int = 0  # of the disconnects: heartbeats went unanswered
    rejected_queue_full: int = 0
    rejected_wait_timeout: int = 0
    preempted: int = 0  # aborted by a weight update and continued on the new weights
    updates_committed: int = 0  # weight updates every worker took
    updates_rolled_back: int = 0  # weight updates a worker could not load: none took them
    updates_commit_failed: int = 0  # weight updates a worker could not commit (out of service)
    out_of_service: int = 0  # workers removed for not serving the current weights


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
class ResumedEvent:
    """The worker was lost after ``tokens`` tokens had arrived; another worker continues
    from them (its prompt is the original prompt plus those tokens). Nothing is discarded."""

    reason: str
    tokens: int


@dataclass(slots=True, frozen=True)
class FinishedEvent:
    finish_reason: str
    worker_id: WorkerId
    extra: dict[str, str | int | float]


# (version, start, end): the tokens [start, end) of a reply were sampled by ``version``.
VersionSpan = tuple[int, int, int]


def version_spans(segments: Sequence[tuple[int, int]], total: int) -> list[VersionSpan]:
    """Spans of ``total`` tokens from ``(start, version)`` segments in order: each segment
    runs to the next one's start (the last to ``total``); empty segments vanish and
    neighbours of one version merge."""
    spans: list[VersionSpan] = []
    for i, (start, version) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else total
        end = min(end, total)
        if end <= start:
            continue
        if spans and spans[-1][0] == version and spans[-1][2] == start:
            spans[-1] = (version, spans[-1][1], end)
        else:
            spans.append((version, start, end))
    return spans


RelayEvent = TokensEvent | RestartedEvent | ResumedEvent | FinishedEvent


@dataclass(slots=True)
class RoutedRows:
    """The routing rows a call gathered: positions ``[start, start + count)`` of its prompt
    plus sampled ids as one C-order array (``shape.row_bytes`` a row), zeros in the
    ``missing`` ranges (rows an engine skipped), and which version's forward made which
    rows (``versions``: (version, start, end) over positions)."""

    start: int
    shape: protocol.RoutingShape | None = None  # learned from the first rows that came
    data: bytearray = field(default_factory=bytearray)
    missing: list[tuple[int, int]] = field(default_factory=list)
    versions: list[VersionSpan] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.data) // self.shape.row_bytes if self.shape is not None else 0

    @property
    def end(self) -> int:
        """The first position with no row yet: the next attempt asks from here."""
        return self.start + self.count

    def add(self, rows: protocol.RoutedExperts, shape: protocol.RoutingShape, version: int) -> int:
        """Keep the rows past ``end`` of an attempt's ``Done``; returns how many were new.
        Rows that do not fit the shape are refused (ValueError)."""
        if self.shape is not None and shape != self.shape:
            raise ValueError(f"routing shape {shape} differs from {self.shape}")
        size = shape.row_bytes
        if rows.rows < 0 or len(rows.data) != rows.rows * size:
            raise ValueError(f"{len(rows.data)} bytes are not {rows.rows} rows of {size}")
        self.shape = shape
        end = self.end
        if rows.start > end:  # an engine must never start later than asked: a gap
            self.missing.append((end, rows.start))
            self.data.extend(bytes((rows.start - end) * size))
            end = rows.start
        skip = end - rows.start
        if skip >= rows.rows:
            return 0
        self.data.extend(memoryview(rows.data)[skip * size :])
        new_end = rows.start + rows.rows
        last = self.versions[-1] if self.versions else None
        if last is not None and last[0] == version and last[2] == end:
            self.versions[-1] = (version, last[1], new_end)
        else:
            self.versions.append((version, end, new_end))
        return new_end - end


class Delivery(enum.Enum):
    """What a call's sink (``RelayCall.deliver_to``) did with the tokens offered to it."""

    WRITTEN = "written"  # it did what the consumer would have done with them
    DECLINED = "declined"  # the consumer is woken with them
    HELD = "held"  # they wait, the consumer asleep, for more tokens or ``RelayCall.flush``


# A call's sink: the waiting tokens, and whether it may hold them (not during a flush).
Sink = Callable[[TokensEvent, bool], Delivery]


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
        images: Sequence[PromptImage] = (),
        routed_experts_from: int | None = None,
        score_from: int | None = None,
    ) -> None:
        self.pool = pool
        self.request_id = request_id
        self.model = model
        self.prompt = protocol.pack_ids(prompt_ids)
        self.sampling = sampling
        self.affinity = affinity
        self.images = [protocol.ImageRef(i.sha256, i.start, i.end) for i in images]
        self.image_bytes = {i.sha256: i.data for i in images}
        self.state = RequestState.QUEUED
        # A teacher-forcing request of its ids from this position on (None: it samples).
        self.score_from = score_from
        self.worker_id: WorkerId | None = None
        self.attempts = 0
        self.queued_at = time.perf_counter()
        self.started_at: float | None = None
        # Tokens that arrived so far (over every attempt): a re-dispatch continues from them.
        self.received = array("i")
        self.first_token_at: float | None = None  # perf_counter() when tokens first came
        # (first token, version) of each attempt's tokens: a worker's own report of its
        # version (in its Done) replaces what the pool assumed when it dispatched.
        self.segments: list[tuple[int, int]] = []
        # The routing rows gathered from its attempts (None: none were asked).
        self.routed = RoutedRows(routed_experts_from) if routed_experts_from is not None else None
        # Set once the Done of a cancelled request that gathers routing came (or never will).
        self._closed_rows: asyncio.Event | None = None
        self._slot: asyncio.Future[WorkerHandle] | None = None
        # Events not yet taken by ``events()`` and the consumer's wake-up; how many token
        # ids and how many other events are waiting, how many token ids wake the
        # consumer (None: none do, only the other events), and whether it had any yet.
        self._pending: deque[RelayEvent | RelayError] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_tokens = 0
        self._decisive = 0
        self._wake_after: int | None = 1
        self._had_tokens = False
        # Takes a step's tokens where they arrive instead of waking the consumer (see
        # ``deliver_to``).
        self._sink: Sink | None = None
        # Held tokens (the sink said so) are offered again once this many wait, or at a
        # flush; 0: with every step's.
        self._held = False
        self._group = 0

    def __repr__(self) -> str:
        return f"<RelayCall {self.request_id} {self.state.value} worker={self.worker_id}>"

    def _transition(self, state: RequestState) -> None:
        if self.state in _TERMINAL:
            raise RelayError(f"request {self.request_id} is {self.state.value}; cannot be {state}")
        self.state = state

    @property
    def cancelled(self) -> bool:
        return self.state is RequestState.CANCELLED

    @property
    def lane(self) -> str:
        """The fair-queue key: the trial (affinity), else the request itself."""
        return self.affinity if self.affinity is not None else self.request_id

    def version_spans(self, total: int | None = None) -> list[VersionSpan]:
        """Which version sampled which of the call's tokens (the first ``total``)."""
        return version_spans(self.segments, len(self.received) if total is None else total)

    def _last_tokens(self, done: protocol.Done, handle: WorkerHandle) -> None:
        """An attempt's Done: its last tokens and routing rows arrive, and the worker says
        which version sampled the attempt's tokens (replacing what the pool assumed at
        dispatch)."""
        if done.token_ids:
            ids = protocol.unpack_ids(done.token_ids)
            self.received.extend(ids)
            self._push(TokensEvent(ids, protocol.unpack_logprobs(done.logprobs)))
        version = done.extra.get(protocol.POLICY_VERSION)
        if self.segments and isinstance(version, int) and not isinstance(version, bool):
            self.segments[-1] = (self.segments[-1][0], version)
        self._rows(done, handle)

    def _rows(self, done: protocol.Done, handle: WorkerHandle) -> None:
        """Keep the routing rows of an attempt's Done (rows that do not fit the model's
        shape are dropped: the positions stay without rows)."""
        routed, rows = self.routed, done.routed_experts
        if routed is None or rows is None:
            return
        info = handle.models.get(self.model)
        shape = info.routing if info is not None else None
        if shape is None:
            log.warning("worker %s sent routing rows it did not announce", handle.worker_id)
            return
        version = self.segments[-1][1] if self.segments else handle.version
        try:
            routed.add(rows, shape, version)
        except ValueError as exc:
            log.warning(
                "request %s: routing rows from %s dropped: %s",
                self.request_id,
                handle.worker_id,
                exc,
            )

    def generate_message(self) -> protocol.Generate:
        """The frame for the next attempt: the original prompt, or after a lost worker the
        prompt plus the tokens already sampled, with the token budget reduced to match."""
        routed_from = self.routed.end if self.routed is not None else None
        if not self.received:
            return protocol.Generate(
                self.request_id,
                self.model,
                self.prompt,
                self.sampling,
                images=self.images,
                routed_experts_from=routed_from,
            )
        sampling = msgspec.structs.replace(
            self.sampling, max_tokens=self.sampling.max_tokens - len(self.received)
        )
        prompt = self.prompt + protocol.pack_ids(self.received)
        return protocol.Generate(
            self.request_id,
            self.model,
            prompt,
            sampling,
            images=self.images,
            routed_experts_from=routed_from,
        )

    def request_frame(self, endpoint: protocol.ProxyEndpoint) -> bytes:
        """The next attempt's request encoded for ``endpoint``: a ``Score`` for a call
        that scores, else its ``Generate``."""
        if self.score_from is None:
            return endpoint.generate(self.generate_message())
        return endpoint.score(
            protocol.Score(self.request_id, self.model, self.prompt, self.score_from, self.images)
        )

    def image_frames(self, handle: WorkerHandle) -> list[bytes]:
        """The frames that give ``handle``'s worker the images this call needs: drops past
        its budget, then the images it lacks."""
        if not self.images:
            return []
        needed = [ref.sha256 for ref in self.images]
        sizes = {sha: len(self.image_bytes[sha]) for sha in needed}
        plan = handle.images.plan(needed, sizes)
        frames = []
        if plan.drop:
            frames.append(handle.endpoint.drop_images(protocol.ImageDrop(plan.drop)))
        for sha in plan.send:
            frames.append(handle.endpoint.image(protocol.Image(sha, self.image_bytes[sha])))
        return frames

    def _push(self, event: RelayEvent | RelayError) -> None:
        if isinstance(event, TokensEvent):
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self._waiting_tokens += len(event.token_ids)
            last = self._pending[-1] if self._pending else None
            if isinstance(last, TokensEvent):
                # Not taken yet: the waiting event grows (no object per engine step).
                last.token_ids.extend(event.token_ids)
                last.logprobs.extend(event.logprobs)
            else:
                self._pending.append(event)
        else:
            self._pending.append(event)
            self._decisive += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._ready():
            self._wake(waiter, may_hold=True)

    def _wake(self, waiter: asyncio.Future[None], *, may_hold: bool) -> None:
        """The parked consumer has tokens to take: the sink gets them first when they are
        all that waits; the consumer is woken unless the sink wrote or held them."""
        if self._sink is not None and not self._decisive and len(self._pending) == 1:
            tokens = self._pending[0]
            assert isinstance(tokens, TokensEvent)
            if self._take(self._sink, tokens, may_hold) is not Delivery.DECLINED:
                return
        waiter.set_result(None)

    def _take(self, sink: Sink, tokens: TokensEvent, may_hold: bool) -> Delivery:
        """Hand the waiting tokens to the sink. Declined ones wait for the consumer, held
        ones for the next tokens or a flush. A sink that fails fails the call, not the
        worker's connection."""
        try:
            delivery = sink(tokens, may_hold)
        except Exception as exc:
            log.exception("request %s: delivering tokens failed", self.request_id)
            # The sink may have used part of them: the consumer gets the error alone.
            self._sink = None
            self._pending.clear()
            self._waiting_tokens = 0
            self._pending.append(RelayError(f"delivering tokens failed: {exc!r}"))
            self._decisive += 1
            self._held = False
            return Delivery.DECLINED
        if delivery is Delivery.HELD:
            if may_hold:
                self._held = True
                return delivery
            delivery = Delivery.DECLINED  # a flush leaves nothing waiting: the consumer takes them
        self._held = False
        if delivery is Delivery.WRITTEN:
            self._pending.clear()
            self._waiting_tokens = 0
            self._had_tokens = True
        return delivery

    def deliver_to(self, sink: Sink | None, *, group: int = 0) -> None:
        """Tokens that would wake a consumer parked in ``events()`` (nothing else
        waiting before them) go to ``sink`` at once instead, in the relay's reader: a
        stream writes its client's event without a task switch per engine step. The
        sink must do what the consumer would have done with them, synchronously
        (``WRITTEN``), or decline (``DECLINED``: the consumer is woken with them as
        usual), or, when offered with ``may_hold``, hold them (``HELD``: they wait, and
        the next tokens join them, until ``group`` tokens wait (then they are offered
        again), ``flush``, or an event that is not tokens). None removes it."""
        self._sink = sink
        self._group = group

    def flush(self) -> bool:
        """Held tokens go out now: to the sink, which may not hold them again (or, if it
        declines, to the consumer). Nothing happens when nothing is held (the consumer
        was woken, or took them): False."""
        if not self._held:
            return False
        self._held = False
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._ready():
            self._wake(waiter, may_hold=False)
        return True

    def _ready(self) -> bool:
        """Whether the consumer has something to take now."""
        if self._decisive:
            return True
        after = self._wake_after
        if after is None or not self._waiting_tokens:
            return False
        if self._held and self._waiting_tokens < self._group:
            return False
        return self._waiting_tokens >= after or not self._had_tokens

    async def events(self, *, wake_after: int | None = 1) -> AsyncIterator[RelayEvent]:
        """Yield events until ``FinishedEvent``; raise the call's error if it failed.

        Tokens that arrive while earlier ones wait are taken with them as one event (a
        consumer that fell behind catches up in one step, with one write to its client).
        ``wake_after`` is how many token ids must be waiting to wake the consumer: 1 for
        every engine step; more to stream in groups (the first tokens still wake it at
        once); None for a consumer that only wants the whole reply, woken only when
        something else happens (the end, a restart, an error). Nothing is dropped or
        reordered."""
        self._wake_after = wake_after
        while True:
            if not self._ready():
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            event = self._pending.popleft()
            if isinstance(event, TokensEvent):
                self._waiting_tokens -= len(event.token_ids)
                self._had_tokens = True
                self._held = False
            else:
                self._decisive -= 1
            if isinstance(event, RelayError):
                raise event
            yield event
            if isinstance(event, FinishedEvent):
                return

    async def cancel(self, *, keep_rows: bool = False) -> None:
        """Abort the request (idempotent; no-op once finished). ``keep_rows``: the caller
        will wait for the routing rows its worker's last frame brings
        (``rows_after_cancel``)."""
        await self.pool.cancel(self, keep_rows=keep_rows)

    async def rows_after_cancel(self) -> None:
        """After ``cancel``: wait for the rows the worker's last frame brings (the caller
        bounds the wait). A reply ended by the proxy (a stop string) was sampled by the
        engine up to there; its routing comes only with the worker's Done."""
        event = self._closed_rows
        if event is None:
            return
        try:
            await event.wait()
        finally:  # waited enough, or the rows came: the pool forgets the call either way
            self.pool._closing.pop(self.request_id, None)

    def take_waiting(self) -> TokensEvent | None:
        """The tokens that arrived but were not taken by the consumer (held for a sink,
        or waiting for a consumer that stopped before taking them), as one event, taken
        now; None when there are none. For a consumer that ends early and keeps what was
        sampled: after ``cancel``, nothing more arrives."""
        ids: list[int] = []
        logprobs: list[float] = []
        kept: deque[RelayEvent | RelayError] = deque()
        for event in self._pending:
            if isinstance(event, TokensEvent):
                ids.extend(event.token_ids)
                logprobs.extend(event.logprobs)
                continue
            if isinstance(event, RestartedEvent):  # what came before it is discarded
                ids.clear()
                logprobs.clear()
            kept.append(event)
        self._pending = kept
        self._waiting_tokens = 0
        self._held = False
        return TokensEvent(ids, logprobs) if ids else None


class WorkerPool:
    """Connected workers and the requests in flight on them."""

    def __init__(
        self,
        *,
        wait_seconds: float = 30.0,
        max_attempts: int = 3,
        limits: PoolLimits | None = None,
    ) -> None:
        self.wait_seconds = wait_seconds
        self.max_attempts = max_attempts
        self.limits = limits or PoolLimits()
        self.stats = PoolStats()
        self.workers: dict[WorkerId, WorkerHandle] = {}
        self._calls: dict[RequestId, RelayCall] = {}
        # Cancelled calls that gather routing, until their worker's last frame brings it.
        self._closing: dict[RequestId, RelayCall] = {}
        self._queue: FairQueue[str, RelayCall] = FairQueue()
        self._affinity: OrderedDict[str, WorkerId] = OrderedDict()
        self._affinity_cap = 65536
        self._changed = asyncio.Condition()
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()
        # The policy version the workers serve and the checkpoint it came from (None: the
        # weights they started with, or a version stamped without a checkpoint).
        self.version = 0
        self.weights_path: str | None = None
        self.held = 0  # weight updates holding the queue (> 0: nothing is dispatched)
        # Runs when a worker joins behind the pool's version, or the pool learns a newer
        # version than a worker serves (set by ``relay.weights.WeightSync``).
        self.on_behind: Callable[[WorkerHandle], None] | None = None
        # Runs after each worker frame that carried requests' frames was handled (the
        # proxy's stream coalescing gauges the event loop's lag from there).
        self.after_frame: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"<WorkerPool workers={len(self.workers)} in_flight={len(self._calls)}>"

    # ------------------------------------------------------------------ membership

    def served_models(self) -> dict[str, protocol.ModelInfo]:
        models: dict[str, protocol.ModelInfo] = {}
        for handle in self.workers.values():
            for name, info in handle.models.items():
                models.setdefault(name, info)
        return models

    def routing(self, model: str) -> protocol.RoutingShape | None:
        """The routing shape of ``model`` as a connected worker reports it (None: no
        worker serving it now can report routing)."""
        for handle in self.workers.values():
            if reports_routing(handle, model):
                return handle.models[model].routing
        return None

    @property
    def in_flight(self) -> int:
        """Requests not finished yet: running on a worker or waiting for one."""
        return len(self._calls)

    @property
    def running(self) -> int:
        """Requests holding a slot on a worker."""
        return sum(len(h.in_flight) for h in self.workers.values())

    @property
    def queued(self) -> int:
        """Requests waiting in the fair queue for a slot."""
        return len(self._queue)

    def capacity(self, handle: WorkerHandle) -> int:
        cap = self.limits.max_in_flight_per_worker
        return min(handle.max_concurrency, cap) if cap > 0 else handle.max_concurrency

    async def add_worker(self, handle: WorkerHandle) -> None:
        old = self.workers.get(handle.worker_id)
        if old is not None:
            # Same worker reconnecting before its old socket was noticed dead.
            await self.remove_worker(old, reason="replaced by a new connection")
        self.workers[handle.worker_id] = handle
        self.stats.worker_joins += 1
        log.info(
            "worker %s joined with models %s, weights version %d",
            handle.worker_id,
            sorted(handle.models),
            handle.version,
        )
        policy = serves_policy(handle)  # a teacher's weights are its own: it serves at once
        if policy and handle.version > self.version:
            # Updated through another replica (or before this proxy restarted).
            self.adopt(handle.version, handle.weights_path)
        elif policy and (handle.version < self.version or self.held):
            # Behind, or an update is running: it serves once it has the current weights.
            handle.state = WorkerState.JOINING
            if self.on_behind is not None:
                self.on_behind(handle)
        await self._notify()

    def adopt(self, version: int, path: str | None) -> None:
        """A newer version than this pool's is served (a worker says so): it becomes the
        pool's, and workers behind it are brought up to it."""
        if version <= self.version:
            return
        log.info("weights version %d adopted (%s)", version, path or "no checkpoint")
        self.version, self.weights_path = version, path
        for handle in self.workers.values():
            if (
                handle.version < version
                and handle.state is WorkerState.SERVING
                and serves_policy(handle)
            ):
                handle.state = WorkerState.JOINING
                if self.on_behind is not None:
                    self.on_behind(handle)

    def serve(self, handle: WorkerHandle) -> None:
        """A worker that joined or was updated serves again (its slots are handed out)."""
        if self.workers.get(handle.worker_id) is handle:
            handle.state = WorkerState.SERVING
            self._pump()

    def hold(self) -> None:
        """Dispatch nothing until ``release`` (a weight update is running)."""
        self.held += 1

    def release(self) -> None:
        self.held -= 1
        self._pump()

    async def disconnect_all(self, reason: str) -> None:
        """Close every worker's connection (the proxy is shutting down); the endpoint's
        handlers then remove the workers as their sockets end."""
        for handle in list(self.workers.values()):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await handle.link.close(reason)

    async def remove_worker(
        self, handle: WorkerHandle, reason: str, *, evicted: bool = False
    ) -> None:
        """Forget a worker; re-dispatch every request it had in flight. ``evicted``: the
        worker stopped answering heartbeats (rather than closing or dropping)."""
        if self.workers.get(handle.worker_id) is not handle:
            return
        del self.workers[handle.worker_id]
        self.stats.worker_disconnects += 1
        if evicted:
            self.stats.worker_evictions += 1
        handle.endpoint.close()
        for ack in handle.acks.values():
            if not ack.done():
                ack.set_exception(WorkerFailedError("worker_lost", f"worker left: {reason}"))
        for rid, closing in list(self._closing.items()):
            if closing.worker_id == handle.worker_id:  # its rows will never come
                del self._closing[rid]
                assert closing._closed_rows is not None
                closing._closed_rows.set()
        lost = [self._calls[r] for r in handle.in_flight if r in self._calls]
        handle.in_flight.clear()
        log.warning(
            "worker %s left (%s); %d requests in flight", handle.worker_id, reason, len(lost)
        )
        for call in lost:
            if call.attempts >= self.max_attempts:
                self._fail(call, WorkerFailedError("worker_lost", f"worker lost: {reason}"))
                continue
            lost_on = handle.worker_id
            call.state = RequestState.QUEUED
            call.worker_id = None
            if not call.received:
                self.stats.restarted += 1
                call._push(RestartedEvent(reason))
            elif len(call.received) >= call.sampling.max_tokens:
                # Every token of the budget had arrived; only the Done frame was lost.
                self._calls.pop(call.request_id, None)
                call._transition(RequestState.FINISHED)
                call._push(FinishedEvent("length", lost_on, {}))
                continue
            else:
                self.stats.resumed += 1
                call._push(ResumedEvent(reason, len(call.received)))
            log.info(
                "request %s re-dispatched after losing worker %s (%d tokens kept)",
                call.request_id,
                lost_on,
                len(call.received),
            )
            self._spawn(self._redispatch(call))
        await self._notify()

    async def _notify(self) -> None:
        self._pump()
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
        images: Sequence[PromptImage] = (),
        routed_experts_from: int | None = None,
        score_from: int | None = None,
    ) -> RelayCall:
        """Dispatch a request, waiting up to ``wait_seconds`` for a free worker. Its
        ``images`` go to the worker it runs on (only a worker that takes images).
        ``routed_experts_from``: the routing rows of positions from there on are asked (only
        of a worker that reports routing for the model) and gathered in ``call.routed``.
        ``score_from``: no sampling, the ids from there on are scored (``relay.scoring``;
        only by a worker that speaks protocol 6)."""
        rid = RequestId(request_id or f"req-{next(self._ids)}")
        call = RelayCall(
            self,
            rid,
            model,
            prompt_ids,
            sampling,
            affinity,
            images,
            routed_experts_from,
            score_from,
        )
        self._calls[rid] = call
        try:
            await self._dispatch(call)
        except BaseException:
            self._calls.pop(rid, None)
            raise
        return call

    async def _redispatch(self, call: RelayCall) -> None:
        try:
            await self._dispatch(call, front=True)
        except RelayError as exc:
            self._fail(call, exc)

    async def _dispatch(self, call: RelayCall, *, front: bool = False) -> None:
        deadline = time.monotonic() + self.wait_seconds
        while True:
            if call.state is RequestState.CANCELLED:
                raise RequestCancelledError(call.request_id)
            handle = await self._acquire(call, deadline, front=front)
            front = True  # a retry after a failed send keeps its place in line
            try:
                await self._send_request(handle, call)
            except (ConnectionError, ProtocolError, RuntimeError) as exc:
                handle.in_flight.discard(call.request_id)
                call.state = RequestState.QUEUED
                await self.remove_worker(handle, reason=f"send failed: {exc}")
                continue
            self.stats.dispatched += 1
            if call.affinity is not None:
                self._remember(call.affinity, handle.worker_id)
            return

    async def _send_request(self, handle: WorkerHandle, call: RelayCall) -> None:
        """Send ``call`` to the worker whose slot it holds: its drops and images, then its
        Generate, under the worker's image lock when it has images.

        A caller that leaves while waiting for the lock gives the slot back and sends
        nothing. Once the frames start, they go out whole whoever leaves: a frame cut short
        would leave the worker without an image its ledger says it holds (the next request
        with it would name an image the worker never got), or running a request no slot
        counts. A caller that left meanwhile has the request cancelled on the worker once
        it is sent."""
        lock = handle.image_lock if call.images else None
        if lock is not None:
            try:
                await lock.acquire()
            except asyncio.CancelledError:
                self._give_back(handle, call)
                raise
        if call.cancelled:  # cancelled between reserving the slot and sending
            if lock is not None:
                lock.release()
            self._give_back(handle, call)
            raise RequestCancelledError(call.request_id)
        sending = asyncio.get_running_loop().create_task(self._write_request(handle, call, lock))
        try:
            await asyncio.shield(sending)
        except asyncio.CancelledError:
            self._spawn(self._cancel_once_sent(handle, call, sending))
            raise

    async def _write_request(
        self, handle: WorkerHandle, call: RelayCall, lock: asyncio.Lock | None
    ) -> None:
        try:
            if call.images:
                for frame in call.image_frames(handle):
                    await handle.link.send(frame)
            await handle.link.send(call.request_frame(handle.endpoint))
        finally:
            if lock is not None:
                lock.release()
        if call.cancelled:  # cancelled while its frames went out: the worker hears of it
            cancel = handle.endpoint.cancel(call.request_id)
            if cancel is not None:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await handle.link.send(cancel)

    async def _cancel_once_sent(
        self, handle: WorkerHandle, call: RelayCall, sending: asyncio.Task[None]
    ) -> None:
        """The caller left while ``call`` was being sent: once it is, cancel it on the
        worker (freeing its slot); a send that failed ends the worker, as in dispatch."""
        try:
            await sending
        except (ConnectionError, ProtocolError, RuntimeError) as exc:
            handle.in_flight.discard(call.request_id)
            await self.remove_worker(handle, reason=f"send failed: {exc}")
            return
        await self.cancel(call)

    def _give_back(self, handle: WorkerHandle, call: RelayCall) -> None:
        """Free the slot reserved for ``call``, which was never sent."""
        handle.in_flight.discard(call.request_id)
        self._pump()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as the pool's own task (kept until it ends)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _acquire(self, call: RelayCall, deadline: float, *, front: bool) -> WorkerHandle:
        """Queue the call and wait until ``_pump`` reserves a worker slot for it."""
        if not front:
            limits = self.limits
            if limits.max_queued and len(self._queue) >= limits.max_queued:
                self.stats.rejected_queue_full += 1
                raise PoolOverloadedError("pool", limits.max_queued)
            if limits.max_queued_per_trial and (
                self._queue.count(call.lane) >= limits.max_queued_per_trial
            ):
                self.stats.rejected_queue_full += 1
                raise PoolOverloadedError("trial", limits.max_queued_per_trial)
        slot: asyncio.Future[WorkerHandle] = asyncio.get_running_loop().create_future()
        call._slot = slot
        self._queue.push(call.lane, call, front=front)
        self._pump()
        while not slot.done():  # no free slot now: wait in line
            try:
                await asyncio.wait({slot}, timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.CancelledError:
                self._abandon(call, slot)
                raise
            if slot.done() or not self._holding(call):
                break
            # Held by a weight update: requests wait for it, however long it takes, and
            # then have the usual time to find a worker.
            deadline = time.monotonic() + self.wait_seconds
        if slot.done():
            return slot.result()  # raises RequestCancelledError when cancelled meanwhile
        self._abandon(call, slot)
        self.stats.rejected_wait_timeout += 1
        raise NoWorkerAvailableError(call.model, self.wait_seconds)

    def _abandon(self, call: RelayCall, slot: asyncio.Future[WorkerHandle]) -> None:
        """The waiter leaves: take the call out of the queue, or give back its slot."""
        if not slot.done():
            self._queue.remove(call.lane, call)
            slot.cancel()
        elif not slot.cancelled() and slot.exception() is None:
            handle = slot.result()
            handle.in_flight.discard(call.request_id)
            if call.state is RequestState.RUNNING:
                call.state = RequestState.QUEUED
            self._pump()

    def _holding(self, call: RelayCall) -> bool:
        """Whether ``call`` waits for a weight update rather than for a free worker: the
        pool is held, or a worker for its model is joining or updating."""
        return bool(self.held) or any(
            h.state in (WorkerState.JOINING, WorkerState.UPDATING)
            for h in self.workers.values()
            if call.model in h.models
        )

    def _pump(self) -> None:
        """Hand free worker slots to waiting calls, round-robin across trials."""
        if self.held:
            return
        cap = self.limits.max_in_flight
        while len(self._queue):
            if cap and self.running >= cap:
                return
            picked = self._queue.pop_next(self._pick)
            if picked is None:
                return
            call, handle = picked
            call.attempts += 1
            call.worker_id = handle.worker_id
            call.state = RequestState.RUNNING
            call.started_at = time.perf_counter()
            call.segments.append((len(call.received), handle.version))
            handle.in_flight.add(call.request_id)
            assert call._slot is not None
            call._slot.set_result(handle)

    def _pick(self, call: RelayCall) -> WorkerHandle | None:
        loads = [
            WorkerLoad(h.worker_id, len(h.in_flight), self.capacity(h))
            for h in self.workers.values()
            if call.model in h.models
            and h.state is WorkerState.SERVING
            and (not call.images or h.endpoint.takes_images)
            and (call.routed is None or reports_routing(h, call.model))
            and (call.score_from is None or h.endpoint.scores)
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

    async def cancel(self, call: RelayCall, *, keep_rows: bool = False) -> None:
        if call.state in _TERMINAL:
            return
        handle = self.workers.get(call.worker_id) if call.worker_id else None
        call.state = RequestState.CANCELLED
        self._calls.pop(call.request_id, None)
        slot = call._slot
        if slot is not None and not slot.done():
            self._queue.remove(call.lane, call)
            slot.set_exception(RequestCancelledError(call.request_id))
        if handle is not None and call.request_id in handle.in_flight:
            handle.in_flight.discard(call.request_id)
            frame = handle.endpoint.cancel(call.request_id)
            if frame is not None:
                if keep_rows and call.routed is not None:  # its Done brings the rows
                    call._closed_rows = asyncio.Event()
                    self._closing[call.request_id] = call
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
        if isinstance(message, protocol.UpdateAck):
            ack = handle.acks.pop((message.update_id, message.phase), None)
            if ack is not None and not ack.done():
                ack.set_result(message)
            return
        if isinstance(message, protocol.Weights):
            handle.version, handle.weights_path = message.version, message.path
            self.adopt(message.version, message.path)
            return
        if isinstance(message, protocol.Batch):
            finished = False
            for frame in message.frames:
                finished = self._route(handle, frame) or finished
        elif message.request_id is None:
            log.warning("worker %s reported: %s", handle.worker_id, message.message)
            return
        else:
            finished = self._route(handle, message)
        if self.after_frame is not None:
            self.after_frame()
        if finished:
            await self._notify()

    def _route(self, handle: WorkerHandle, message: protocol.RequestFrame) -> bool:
        """Hand one request's frame to its call; True when it ended the request (a slot
        came free)."""
        rid = RequestId(message.request_id or "")
        call = self._calls.get(rid)
        if call is None or call.worker_id != handle.worker_id:
            closing = self._closing.get(rid)
            last = not isinstance(message, protocol.Delta)
            if closing is not None and closing.worker_id == handle.worker_id and last:
                del self._closing[rid]  # its last frame: the rows come with a Done
                if isinstance(message, protocol.Done):
                    closing._rows(message, handle)
                assert closing._closed_rows is not None
                closing._closed_rows.set()
            return False  # late frames of a cancelled or re-dispatched request
        if isinstance(message, protocol.Delta):
            ids = protocol.unpack_ids(message.token_ids)
            call.received.extend(ids)
            call._push(TokensEvent(ids, protocol.unpack_logprobs(message.logprobs)))
            return False
        handle.in_flight.discard(rid)
        if isinstance(message, protocol.Done) and message.extra.get(protocol.PREEMPTED):
            self._preempted(handle, call, message)
            return True
        if (
            isinstance(message, protocol.Error)
            and message.code == protocol.IMAGE_MISSING
            and call.images
            and call.attempts < self.max_attempts
        ):
            log.warning("worker %s lacks an image of %s: sending them again", handle.worker_id, rid)
            call.state = RequestState.QUEUED
            call.worker_id = None
            self._spawn(self._resend_images(handle, call))
            return True
        self._calls.pop(rid, None)
        if isinstance(message, protocol.Done):
            handle.served += 1
            call._last_tokens(message, handle)
            call._transition(RequestState.FINISHED)
            call._push(FinishedEvent(message.finish_reason, handle.worker_id, dict(message.extra)))
        else:
            self._fail(call, WorkerFailedError(message.code, message.message))
        return True

    async def _resend_images(self, handle: WorkerHandle, call: RelayCall) -> None:
        """The worker refused ``call`` for an image it does not hold: forget the call's
        images on both sides (a drop of an image the worker lacks is harmless), then
        dispatch the call again, which sends them."""
        async with handle.image_lock:
            shas = [ref.sha256 for ref in call.images]
            held = [sha for sha in dict.fromkeys(shas) if sha in handle.endpoint.images]
            handle.images.forget(shas)
            if held and handle.endpoint.state is protocol.ConnectionState.OPEN:
                frame = handle.endpoint.drop_images(protocol.ImageDrop(held))
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await handle.link.send(frame)
        await self._redispatch(call)

    def _preempted(self, handle: WorkerHandle, call: RelayCall, done: protocol.Done) -> None:
        """A weight update aborted the request: it continues from its tokens, on the new
        weights (it waits in the queue, at the front, while the update holds the pool)."""
        call._last_tokens(done, handle)
        call.state = RequestState.QUEUED
        call.worker_id = None
        call.attempts -= 1  # a preemption is no failed attempt
        if len(call.received) >= call.sampling.max_tokens:
            self._calls.pop(call.request_id, None)
            call._transition(RequestState.FINISHED)
            call._push(FinishedEvent("length", handle.worker_id, dict(done.extra)))
            return
        self.stats.preempted += 1
        call._push(ResumedEvent("weights update", len(call.received)))
        self._spawn(self._redispatch(call))
