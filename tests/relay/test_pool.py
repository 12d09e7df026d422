"""The worker pool: choosing workers, routing frames, re-dispatch and cancellation.

The transport is an in-memory link that records frames; the pool and protocol are real.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from relay import protocol
from relay.exceptions import (
    NoWorkerAvailableError,
    PoolOverloadedError,
    RelayError,
    RequestCancelledError,
    WorkerFailedError,
)
from relay.pool import (
    Delivery,
    FairQueue,
    FinishedEvent,
    PoolLimits,
    RelayCall,
    RestartedEvent,
    ResumedEvent,
    TokensEvent,
    WorkerHandle,
    WorkerId,
    WorkerLoad,
    WorkerPool,
    choose_worker,
    version_spans,
)


class RecordingLink:
    def __init__(self) -> None:
        self.sent: list[protocol.ProxyMessage] = []
        self.closed = False

    async def send(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError("closed")
        self.sent.append(protocol.decode_proxy_message(data))

    async def close(self, reason: str) -> None:
        self.closed = True


def _load(wid: str, in_flight: int, capacity: int = 4) -> WorkerLoad:
    return WorkerLoad(WorkerId(wid), in_flight, capacity)


def test_choose_least_loaded_and_deterministic_ties() -> None:
    """Least in-flight wins; ties go to the smallest id."""
    assert choose_worker([_load("b", 2), _load("a", 1), _load("c", 1)], None) == "a"


def test_choose_keeps_session_affinity_within_slack() -> None:
    """The session's previous worker is kept unless much busier than the least loaded."""
    loads = [_load("a", 0), _load("b", 2)]
    assert choose_worker(loads, WorkerId("b"), slack=2) == "b"
    assert choose_worker(loads, WorkerId("b"), slack=1) == "a"


def test_choose_none_when_all_full() -> None:
    """Full workers are never chosen."""
    assert choose_worker([_load("a", 4), _load("b", 4)], None) is None
    assert choose_worker([], None) is None


async def _add(pool: WorkerPool, wid: str, capacity: int = 4) -> tuple[WorkerHandle, RecordingLink]:
    link = RecordingLink()
    endpoint = protocol.ProxyEndpoint()
    endpoint.state = protocol.ConnectionState.OPEN
    info = protocol.ModelInfo("tiny", 1024, "raw", "hf", {})
    handle = WorkerHandle(WorkerId(wid), link, endpoint, {"tiny": info}, capacity)
    await pool.add_worker(handle)
    return handle, link


def _frame(message: protocol.WorkerMessage, handle: WorkerHandle) -> protocol.WorkerMessage:
    return handle.endpoint.receive(protocol.encode(message))


async def test_tokens_and_finish_are_routed_to_the_call() -> None:
    """Deltas and Done reach the call's event stream in order."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _add(pool, "w1")
    call = await pool.start("tiny", [1, 2, 3], protocol.Sampling(max_tokens=4), affinity="t1")
    sent = link.sent[0]
    assert isinstance(sent, protocol.Generate)
    assert protocol.unpack_ids(sent.prompt_ids) == [1, 2, 3]
    rid = call.request_id
    await pool.handle_message(
        handle,
        _frame(protocol.Delta(rid, protocol.pack_ids([7]), protocol.pack_logprobs([-1.0])), handle),
    )
    await pool.handle_message(
        handle,
        _frame(
            protocol.Done(rid, "stop", protocol.pack_ids([8]), protocol.pack_logprobs([-2.0])),
            handle,
        ),
    )
    events = [e async for e in call.events()]
    # Both frames were waiting when the consumer came: their tokens are one event.
    assert [type(e) for e in events] == [TokensEvent, FinishedEvent]
    assert isinstance(events[0], TokensEvent)
    assert events[0].token_ids == [7, 8]
    assert events[0].logprobs == [-1.0, -2.0]
    assert pool.in_flight == 0
    assert handle.in_flight == set()


async def test_no_worker_times_out() -> None:
    """Without a worker for the model, start() fails after the wait bound."""
    pool = WorkerPool(wait_seconds=0.05)
    with pytest.raises(NoWorkerAvailableError):
        await pool.start("tiny", [1], protocol.Sampling(max_tokens=1))
    assert pool.in_flight == 0


async def test_waiting_request_starts_when_a_worker_joins() -> None:
    """A request waits for a worker that connects within the bound."""
    pool = WorkerPool(wait_seconds=2)
    pending = asyncio.create_task(pool.start("tiny", [1], protocol.Sampling(max_tokens=1)))
    await asyncio.sleep(0.05)
    assert not pending.done()
    _, link = await _add(pool, "late")
    call = await asyncio.wait_for(pending, 1)
    assert call.worker_id == "late"
    assert isinstance(link.sent[0], protocol.Generate)


async def _wait_sent(link: RecordingLink, count: int = 1) -> None:
    for _ in range(200):
        if len(link.sent) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} frames, got {link.sent}")


async def test_lost_worker_before_any_token_restarts_from_the_start() -> None:
    """A request whose worker drops before any token arrived restarts unchanged elsewhere."""
    pool = WorkerPool(wait_seconds=1)
    h1, link1 = await _add(pool, "a")
    call = await pool.start("tiny", [1, 2], protocol.Sampling(max_tokens=4))
    _h2, link2 = await _add(pool, "b")
    await pool.remove_worker(h1, "test")
    await _wait_sent(link2)
    first, again = link1.sent[0], link2.sent[0]
    assert isinstance(first, protocol.Generate)
    assert isinstance(again, protocol.Generate)
    assert again.prompt_ids == first.prompt_ids
    assert again.sampling == first.sampling
    assert pool.stats.restarted == 1
    assert pool.stats.resumed == 0
    await call.cancel()
    assert [type(e) for e in _drain_nowait(call)] == [RestartedEvent]


async def test_a_batch_reaches_every_call_it_names() -> None:
    """One frame of a step: each call gets its own tokens, a finished one frees its slot,
    and a frame of a request no longer wanted is dropped without disturbing the rest."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    sampling = protocol.Sampling(max_tokens=4)
    first = await pool.start("tiny", [1], sampling, affinity="t1")
    second = await pool.start("tiny", [2], sampling, affinity="t2")
    gone = await pool.start("tiny", [3], sampling, affinity="t3")
    await gone.cancel()
    batch = protocol.Batch(
        [
            protocol.Delta(gone.request_id, protocol.pack_ids([6]), protocol.pack_logprobs([-1])),
            protocol.Delta(first.request_id, protocol.pack_ids([7]), protocol.pack_logprobs([-1])),
            protocol.Done(
                second.request_id, "stop", protocol.pack_ids([8]), protocol.pack_logprobs([-2])
            ),
        ]
    )
    await pool.handle_message(handle, _frame(batch, handle))
    assert [list(e.token_ids) for e in _drain_nowait(first) if isinstance(e, TokensEvent)] == [[7]]
    assert not [e for e in _drain_nowait(gone) if isinstance(e, TokensEvent)]
    events = [e async for e in second.events()]
    assert [type(e) for e in events] == [TokensEvent, FinishedEvent]
    assert handle.in_flight == {first.request_id}
    assert pool.in_flight == 1


async def test_a_consumer_of_the_whole_reply_is_woken_once_not_per_step() -> None:
    """``events(wake_after=None)`` sleeps through the token frames and then gets every
    token in one event, in order; when the tokens first came is still known."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=4), affinity="t1")
    rid = call.request_id
    seen: list[object] = []

    async def consume() -> None:
        async for event in call.events(wake_after=None):
            seen.append(event)

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0)
    for token in (5, 6):
        delta = protocol.Delta(rid, protocol.pack_ids([token]), protocol.pack_logprobs([-1]))
        await pool.handle_message(handle, _frame(delta, handle))
        for _ in range(3):
            await asyncio.sleep(0)
        assert seen == []  # not woken by a step's tokens
    assert call.first_token_at is not None
    await pool.handle_message(handle, _frame(protocol.Done(rid, "stop"), handle))
    await asyncio.wait_for(consumer, 5)
    assert [list(e.token_ids) if isinstance(e, TokensEvent) else None for e in seen] == [
        [5, 6],
        None,
    ]
    assert isinstance(seen[-1], FinishedEvent)


async def test_a_stream_in_groups_gets_its_first_token_at_once_then_every_n() -> None:
    """``events(wake_after=3)``: the first token wakes the consumer, later ones once three
    are waiting (taken as one event), and the end flushes the rest."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=8), affinity="t1")
    rid = call.request_id
    taken: list[object] = []

    def seen() -> list[list[int] | None]:
        return [list(e.token_ids) if isinstance(e, TokensEvent) else None for e in taken]

    async def consume() -> None:
        async for event in call.events(wake_after=3):
            taken.append(event)

    consumer = asyncio.create_task(consume())

    async def step(token: int) -> None:
        delta = protocol.Delta(rid, protocol.pack_ids([token]), protocol.pack_logprobs([-1]))
        await pool.handle_message(handle, _frame(delta, handle))
        for _ in range(3):
            await asyncio.sleep(0)

    await asyncio.sleep(0)
    await step(1)
    assert seen() == [[1]]
    await step(2)
    await step(3)
    assert seen() == [[1]]
    await step(4)
    assert seen() == [[1], [2, 3, 4]]
    await step(5)
    await pool.handle_message(handle, _frame(protocol.Done(rid, "stop"), handle))
    await asyncio.wait_for(consumer, 5)
    # Events already taken never change: later tokens came as new events.
    assert seen() == [[1], [2, 3, 4], [5], None]


async def test_a_sink_takes_a_steps_tokens_where_they_arrive() -> None:
    """With a sink, the tokens that would wake a parked consumer go to the sink in the
    relay's reader (the consumer sleeps on); declined ones wake the consumer as usual, and
    the end still reaches the consumer, after every token the sink took."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=8), affinity="t1")
    rid = call.request_id
    order: list[tuple[str, list[int] | None]] = []
    accept = True

    def sink(tokens: TokensEvent, may_hold: bool) -> Delivery:
        if accept:
            order.append(("sink", list(tokens.token_ids)))
        return Delivery.WRITTEN if accept else Delivery.DECLINED

    async def consume() -> None:
        async for event in call.events():
            ids = list(event.token_ids) if isinstance(event, TokensEvent) else None
            order.append(("consumer", ids))

    async def step(token: int) -> None:
        delta = protocol.Delta(rid, protocol.pack_ids([token]), protocol.pack_logprobs([-1]))
        await pool.handle_message(handle, _frame(delta, handle))

    call.deliver_to(sink)
    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0)
    await step(1)
    assert order == [("sink", [1])]  # at once, no task switch needed
    await step(2)
    accept = False
    await step(3)
    for _ in range(3):
        await asyncio.sleep(0)
    accept = True
    await step(4)
    await pool.handle_message(handle, _frame(protocol.Done(rid, "stop"), handle))
    await asyncio.wait_for(consumer, 5)
    assert order == [
        ("sink", [1]),
        ("sink", [2]),
        ("consumer", [3]),  # declined: the consumer took them
        ("sink", [4]),
        ("consumer", None),
    ]


async def test_a_sink_is_not_used_while_the_consumer_is_busy_or_tokens_wait() -> None:
    """Tokens reach the sink only when nothing is queued before them and the consumer is
    parked: a consumer still busy with earlier events gets the later ones itself, in
    order."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=8), affinity="t1")
    rid = call.request_id
    sunk: list[list[int]] = []

    def sink(tokens: TokensEvent, may_hold: bool) -> Delivery:
        sunk.append(list(tokens.token_ids))
        return Delivery.WRITTEN

    call.deliver_to(sink)
    for token in (1, 2):  # nobody parked in events() yet
        delta = protocol.Delta(rid, protocol.pack_ids([token]), protocol.pack_logprobs([-1]))
        await pool.handle_message(handle, _frame(delta, handle))
    await pool.handle_message(handle, _frame(protocol.Done(rid, "stop"), handle))
    events = [e async for e in call.events()]
    assert sunk == []
    assert [list(e.token_ids) if isinstance(e, TokensEvent) else None for e in events] == [
        [1, 2],
        None,
    ]


async def test_a_failing_sink_fails_its_call_not_the_connection() -> None:
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _add(pool, "w1")
    sampling = protocol.Sampling(max_tokens=8)
    broken = await pool.start("tiny", [1], sampling, affinity="t1")
    other = await pool.start("tiny", [2], sampling, affinity="t2")

    def sink(tokens: TokensEvent, may_hold: bool) -> Delivery:
        raise ValueError("encoder bug")

    broken.deliver_to(sink)

    async def consume(call: RelayCall) -> list[object]:
        return [event async for event in call.events()]

    failing = asyncio.create_task(consume(broken))
    fine = asyncio.create_task(consume(other))
    await asyncio.sleep(0)
    batch = protocol.Batch(
        [
            protocol.Delta(broken.request_id, protocol.pack_ids([5]), protocol.pack_logprobs([-1])),
            protocol.Done(
                other.request_id, "stop", protocol.pack_ids([6]), protocol.pack_logprobs([-1])
            ),
        ]
    )
    await pool.handle_message(handle, _frame(batch, handle))
    with pytest.raises(RelayError, match="delivering tokens failed"):
        await asyncio.wait_for(failing, 5)
    assert [type(e) for e in await asyncio.wait_for(fine, 5)] == [TokensEvent, FinishedEvent]
    assert not link.closed


async def test_held_tokens_wait_with_the_next_ones_until_a_flush() -> None:
    """A sink that holds leaves the tokens waiting and the consumer asleep; the next
    step's tokens join them, ``flush`` offers them all at once (no hold allowed then), and
    the end still reaches the consumer after them."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=8), affinity="t1")
    rid = call.request_id
    offers: list[tuple[list[int], bool]] = []
    consumed: list[list[int] | None] = []
    hold = True

    def sink(tokens: TokensEvent, may_hold: bool) -> Delivery:
        offers.append((list(tokens.token_ids), may_hold))
        return Delivery.HELD if hold and may_hold else Delivery.WRITTEN

    async def consume() -> None:
        async for event in call.events():
            consumed.append(list(event.token_ids) if isinstance(event, TokensEvent) else None)

    async def step(token: int) -> None:
        delta = protocol.Delta(rid, protocol.pack_ids([token]), protocol.pack_logprobs([-1]))
        await pool.handle_message(handle, _frame(delta, handle))
        for _ in range(3):
            await asyncio.sleep(0)

    call.deliver_to(sink)
    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0)
    await step(1)
    await step(2)
    assert offers == [([1], True), ([1, 2], True)]
    assert consumed == []  # held: the consumer sleeps on
    call.flush()
    assert offers[-1] == ([1, 2], False)
    call.flush()  # nothing held any more: nothing offered
    assert len(offers) == 3
    await step(3)
    hold = False
    await step(4)
    await pool.handle_message(handle, _frame(protocol.Done(rid, "stop"), handle))
    await asyncio.wait_for(consumer, 5)
    assert offers[3:] == [([3], True), ([3, 4], True)]
    assert consumed == [None]
    assert list(call.received) == [1, 2, 3, 4]


async def test_held_tokens_reach_the_consumer_with_the_end_and_in_order() -> None:
    """Tokens held when the reply ends are taken by the consumer before the end; a sink
    that declines at a flush wakes the consumer with them."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=8), affinity="t1")
    rid = call.request_id
    consumed: list[list[int] | None] = []

    def sink(tokens: TokensEvent, may_hold: bool) -> Delivery:
        return Delivery.HELD if may_hold else Delivery.DECLINED

    async def consume() -> None:
        async for event in call.events():
            consumed.append(list(event.token_ids) if isinstance(event, TokensEvent) else None)

    call.deliver_to(sink)
    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0)
    for token in (1, 2):
        delta = protocol.Delta(rid, protocol.pack_ids([token]), protocol.pack_logprobs([-1]))
        await pool.handle_message(handle, _frame(delta, handle))
    for _ in range(3):
        await asyncio.sleep(0)
    assert consumed == []
    call.flush()  # declined: the consumer takes them
    for _ in range(3):
        await asyncio.sleep(0)
    assert consumed == [[1, 2]]
    delta = protocol.Delta(rid, protocol.pack_ids([3]), protocol.pack_logprobs([-1]))
    await pool.handle_message(handle, _frame(delta, handle))
    await pool.handle_message(
        handle, _frame(protocol.Done(rid, "stop", protocol.pack_ids([4]), b"\0\0\0\0"), handle)
    )
    await asyncio.wait_for(consumer, 5)
    assert consumed == [[1, 2], [3, 4], None]


async def test_a_consumer_that_stops_takes_the_held_and_waiting_tokens() -> None:
    """Tokens a sink held, and those that came after them, are not lost when the consumer
    is cancelled while it sleeps: ``take_waiting`` returns them in order with their
    logprobs (once), and nothing more arrives after ``cancel``."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=8), affinity="t1")
    rid = call.request_id

    def sink(tokens: TokensEvent, may_hold: bool) -> Delivery:
        return Delivery.WRITTEN if tokens.token_ids == [1] else Delivery.HELD

    async def consume() -> None:
        async for _ in call.events():
            pass

    call.deliver_to(sink)
    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0)
    for token in (1, 2, 3):
        delta = protocol.Delta(
            rid, protocol.pack_ids([token]), protocol.pack_logprobs([-float(token)])
        )
        await pool.handle_message(handle, _frame(delta, handle))
        await asyncio.sleep(0)
    consumer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await consumer
    await call.cancel()
    late = protocol.Delta(rid, protocol.pack_ids([4]), protocol.pack_logprobs([-4]))
    await pool.handle_message(handle, _frame(late, handle))
    waiting = call.take_waiting()
    assert waiting is not None
    assert (list(waiting.token_ids), list(waiting.logprobs)) == ([2, 3], [-2.0, -3.0])
    assert call.take_waiting() is None
    assert list(call.received) == [1, 2, 3]


async def test_after_frame_runs_once_per_worker_frame() -> None:
    """The pool's ``after_frame`` hook runs after each request-carrying frame is handled
    (a batch of several requests' frames counts once), with its tokens already routed."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    sampling = protocol.Sampling(max_tokens=8)
    first = await pool.start("tiny", [1], sampling, affinity="t1")
    second = await pool.start("tiny", [2], sampling, affinity="t2")
    seen: list[tuple[int, int]] = []
    pool.after_frame = lambda: seen.append((len(first.received), len(second.received)))
    batch = protocol.Batch(
        [
            protocol.Delta(first.request_id, protocol.pack_ids([5]), protocol.pack_logprobs([-1])),
            protocol.Delta(second.request_id, protocol.pack_ids([6]), protocol.pack_logprobs([-1])),
        ]
    )
    await pool.handle_message(handle, _frame(batch, handle))
    delta = protocol.Delta(first.request_id, protocol.pack_ids([7]), protocol.pack_logprobs([-1]))
    await pool.handle_message(handle, _frame(delta, handle))
    assert seen == [(1, 1), (2, 1)]


def _drain_nowait(call: RelayCall) -> list[object]:
    events: list[object] = []
    while call._pending:
        events.append(call._pending.popleft())
    return events


async def test_lost_worker_requests_resume_on_another_worker() -> None:
    """When a worker drops mid-generation, another worker continues from the tokens
    already sampled: its prompt is prompt + those tokens and the budget shrinks."""
    pool = WorkerPool(wait_seconds=1)
    h1, _ = await _add(pool, "a")
    call = await pool.start("tiny", [1, 2], protocol.Sampling(max_tokens=4))
    assert call.worker_id == "a"
    rid = call.request_id
    await pool.handle_message(
        h1, _frame(protocol.Delta(rid, protocol.pack_ids([5]), protocol.pack_logprobs([-1.0])), h1)
    )
    h2, link2 = await _add(pool, "b")
    await pool.remove_worker(h1, "test")
    await _wait_sent(link2)
    resumed = link2.sent[0]
    assert isinstance(resumed, protocol.Generate)
    assert protocol.unpack_ids(resumed.prompt_ids) == [1, 2, 5]
    assert resumed.sampling.max_tokens == 3
    assert call.worker_id == "b"
    assert pool.stats.resumed == 1
    # A late frame from the lost worker is ignored.
    await pool.handle_message(h1, protocol.Delta(rid, protocol.pack_ids([99]), b"\0\0\0\0"))
    await pool.handle_message(
        h2,
        _frame(
            protocol.Done(rid, "stop", protocol.pack_ids([6]), protocol.pack_logprobs([-0.5])), h2
        ),
    )
    events = [e async for e in call.events()]
    assert [type(e) for e in events] == [TokensEvent, ResumedEvent, TokensEvent, FinishedEvent]
    assert call.attempts == 2


async def test_worker_error_fails_the_call() -> None:
    """An Error frame for a request raises WorkerFailedError from its events."""
    pool = WorkerPool(wait_seconds=1)
    handle, _ = await _add(pool, "a")
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=1))
    await pool.handle_message(
        handle, _frame(protocol.Error("engine_error", "boom", call.request_id), handle)
    )
    with pytest.raises(WorkerFailedError):
        async for _ in call.events():
            pass


async def test_cancel_sends_cancel_and_frees_capacity() -> None:
    """Cancelling a call tells the worker and releases its slot."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _add(pool, "a", capacity=1)
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=1))
    await call.cancel()
    assert isinstance(link.sent[-1], protocol.Cancel)
    assert handle.in_flight == set()
    assert pool.in_flight == 0
    # Capacity is free again: the next request is dispatched at once.
    again = await asyncio.wait_for(pool.start("tiny", [1], protocol.Sampling(max_tokens=1)), 0.5)
    assert again.worker_id == "a"


def test_fair_queue_round_robins_across_keys() -> None:
    """A key with many waiting items is served in turn with the others, not before them."""
    queue: FairQueue[str, str] = FairQueue()
    for i in range(4):
        queue.push("flood", f"f{i}")
    queue.push("a", "a0")
    queue.push("b", "b0")
    order = []
    while (picked := queue.pop_next(lambda item: item)) is not None:
        order.append(picked[0])
    assert order == ["f0", "a0", "b0", "f1", "f2", "f3"]
    assert len(queue) == 0


def test_fair_queue_skips_unplaceable_heads_and_keeps_their_place() -> None:
    """A key whose head cannot be placed is passed over but stays first in line."""
    queue: FairQueue[str, str] = FairQueue()
    queue.push("a", "a0")
    queue.push("b", "b0")
    assert queue.pop_next(lambda item: item if item != "a0" else None) == ("b0", "b0")
    assert queue.pop_next(lambda item: item) == ("a0", "a0")
    queue.push("c", "c1")
    queue.push("c", "c0", front=True)
    assert queue.count("c") == 2
    assert queue.remove("c", "c1")
    assert not queue.remove("c", "c1")
    assert queue.pop_next(lambda item: item) == ("c0", "c0")


async def _finish(pool: WorkerPool, handle: WorkerHandle, rid: str) -> None:
    await pool.handle_message(
        handle, _frame(protocol.Done(rid, "stop", protocol.pack_ids([]), b""), handle)
    )


async def test_waiting_requests_are_served_fairly_across_trials() -> None:
    """With one slot, a trial that queued many requests does not starve a later trial."""
    pool = WorkerPool(wait_seconds=2)
    handle, link = await _add(pool, "a", capacity=1)
    sampling = protocol.Sampling(max_tokens=1)
    first = await pool.start("tiny", [1], sampling, affinity="flood")
    flood = [
        asyncio.create_task(pool.start("tiny", [1], sampling, affinity="flood")) for _ in range(3)
    ]
    await asyncio.sleep(0.01)
    other = asyncio.create_task(pool.start("tiny", [2], sampling, affinity="other"))
    await asyncio.sleep(0.01)
    assert pool.queued == 4
    assert pool.running == 1
    await _finish(pool, handle, first.request_id)
    served = await asyncio.wait_for(flood[0], 1)
    await _finish(pool, handle, served.request_id)
    # The other trial goes next, ahead of the flooding trial's remaining two.
    served = await asyncio.wait_for(other, 1)
    assert served.affinity == "other"
    assert pool.queued == 2
    await served.cancel()
    for task in flood[1:]:
        call = await asyncio.wait_for(task, 1)
        await _finish(pool, handle, call.request_id)
    assert pool.in_flight == 0
    assert pool.queued == 0
    assert len([m for m in link.sent if isinstance(m, protocol.Generate)]) == 5


async def test_full_queue_refuses_at_once() -> None:
    """Over the queue bound (overall or per trial) a request is refused, not buffered."""
    limits = PoolLimits(max_in_flight=1, max_queued=2, max_queued_per_trial=1)
    pool = WorkerPool(wait_seconds=2, limits=limits)
    await _add(pool, "a", capacity=4)
    sampling = protocol.Sampling(max_tokens=1)
    await pool.start("tiny", [1], sampling, affinity="t1")  # takes the one overall slot
    waiting = asyncio.create_task(pool.start("tiny", [1], sampling, affinity="t1"))
    await asyncio.sleep(0.01)
    with pytest.raises(PoolOverloadedError) as per_trial:
        await pool.start("tiny", [1], sampling, affinity="t1")
    assert per_trial.value.scope == "trial"
    other = asyncio.create_task(pool.start("tiny", [1], sampling, affinity="t2"))
    await asyncio.sleep(0.01)
    with pytest.raises(PoolOverloadedError) as overall:
        await pool.start("tiny", [1], sampling, affinity="t3")
    assert overall.value.scope == "pool"
    assert pool.stats.rejected_queue_full == 2
    assert pool.queued == 2
    waiting.cancel()
    other.cancel()
    await asyncio.gather(waiting, other, return_exceptions=True)
    assert pool.queued == 0


async def test_cancelled_waiter_leaves_the_queue() -> None:
    """Cancelling a queued call (or its waiting task) removes it without taking a slot."""
    pool = WorkerPool(wait_seconds=2)
    handle, _ = await _add(pool, "a", capacity=1)
    sampling = protocol.Sampling(max_tokens=1)
    busy = await pool.start("tiny", [1], sampling)
    waiter = asyncio.create_task(pool.start("tiny", [1], sampling))
    await asyncio.sleep(0.01)
    queued = next(c for c in pool._calls.values() if c is not busy)
    await queued.cancel()
    with pytest.raises(RequestCancelledError):
        await waiter
    assert pool.queued == 0
    await _finish(pool, handle, busy.request_id)
    assert handle.in_flight == set()
    assert pool.in_flight == 0


async def test_queue_wait_times_out_with_no_worker_error() -> None:
    """A request that cannot get a slot within the wait bound fails and leaves the queue."""
    pool = WorkerPool(wait_seconds=0.05)
    await _add(pool, "a", capacity=1)
    sampling = protocol.Sampling(max_tokens=1)
    await pool.start("tiny", [1], sampling)
    with pytest.raises(NoWorkerAvailableError):
        await pool.start("tiny", [1], sampling)
    assert pool.queued == 0
    assert pool.stats.rejected_wait_timeout == 1


async def test_per_worker_cap_lowers_announced_concurrency() -> None:
    """max_in_flight_per_worker caps what a worker announced."""
    pool = WorkerPool(wait_seconds=0.05, limits=PoolLimits(max_in_flight_per_worker=1))
    await _add(pool, "a", capacity=8)
    sampling = protocol.Sampling(max_tokens=1)
    await pool.start("tiny", [1], sampling)
    with pytest.raises(NoWorkerAvailableError):
        await pool.start("tiny", [1], sampling)


def test_version_spans_cover_the_tokens_each_version_sampled() -> None:
    """Segments become (version, start, end) spans: each runs to the next one's start,
    empty ones vanish, neighbours of one version merge, and ``total`` cuts the last."""
    assert version_spans([], 5) == []
    assert version_spans([(0, 1)], 0) == []
    assert version_spans([(0, 1)], 4) == [(1, 0, 4)]
    assert version_spans([(0, 1), (3, 1), (5, 2)], 8) == [(1, 0, 5), (2, 5, 8)]
    assert version_spans([(0, 1), (0, 2)], 3) == [(2, 0, 3)]  # the first sampled nothing
    assert version_spans([(0, 1), (2, 2), (4, 1)], 6) == [(1, 0, 2), (2, 2, 4), (1, 4, 6)]
    assert version_spans([(0, 1), (4, 2)], 3) == [(1, 0, 3)]  # cut before the second
    assert version_spans([(0, 1), (4, 2)], 6) == [(1, 0, 4), (2, 4, 6)]


async def test_a_preempted_request_continues_from_its_tokens_on_the_new_version() -> None:
    """A Done marked preempted (a weight update aborted it) re-queues the call: it waits
    while the pool is held, then continues from prompt + received tokens with the budget
    reduced, and its reply's spans say which version sampled which tokens."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _add(pool, "a")
    call = await pool.start("tiny", [1, 2], protocol.Sampling(max_tokens=6))
    rid = call.request_id
    delta = protocol.Delta(rid, protocol.pack_ids([5]), protocol.pack_logprobs([-1.0]))
    await pool.handle_message(handle, _frame(delta, handle))
    pool.hold()  # the update that aborted it is running
    preempted = protocol.Done(
        rid,
        "abort",
        protocol.pack_ids([6]),
        protocol.pack_logprobs([-2.0]),
        {protocol.PREEMPTED: 1, protocol.POLICY_VERSION: 0},
    )
    await pool.handle_message(handle, _frame(preempted, handle))
    await asyncio.sleep(0.05)
    assert len([m for m in link.sent if isinstance(m, protocol.Generate)]) == 1
    assert handle.in_flight == set()
    handle.version = 1  # the update committed
    pool.release()
    await _wait_sent(link, 2)
    again = link.sent[1]
    assert isinstance(again, protocol.Generate)
    assert again.request_id == rid
    assert protocol.unpack_ids(again.prompt_ids) == [1, 2, 5, 6]
    assert again.sampling.max_tokens == 4
    done = protocol.Done(
        rid,
        "stop",
        protocol.pack_ids([7, 8]),
        protocol.pack_logprobs([-3.0, -4.0]),
        {protocol.POLICY_VERSION: 1},
    )
    await pool.handle_message(handle, _frame(done, handle))
    events = [e async for e in call.events()]
    assert [type(e) for e in events] == [TokensEvent, ResumedEvent, TokensEvent, FinishedEvent]
    resumed = events[1]
    assert isinstance(resumed, ResumedEvent)
    assert resumed.tokens == 2
    assert [list(e.token_ids) for e in events if isinstance(e, TokensEvent)] == [[5, 6], [7, 8]]
    assert call.version_spans() == [(0, 0, 2), (1, 2, 4)]
    assert pool.stats.preempted == 1
    assert call.attempts == 1  # a preemption is not a failed attempt


async def test_the_workers_reported_version_replaces_the_pools_assumption() -> None:
    """The version in a Done's extra (the engine's own, e.g. updated through another
    replica before this proxy heard) is what the call's spans say; without one, the
    handle's version at dispatch stands."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "a")
    handle.version = 2
    told = await pool.start("tiny", [1], protocol.Sampling(max_tokens=4), affinity="t1")
    silent = await pool.start("tiny", [1], protocol.Sampling(max_tokens=4), affinity="t2")
    ids, lps = protocol.pack_ids([5, 6]), protocol.pack_logprobs([-1.0, -1.0])
    reports: list[tuple[RelayCall, dict[str, str | int | float]]] = [
        (told, {protocol.POLICY_VERSION: 4}),
        (silent, {}),
    ]
    for call, extra in reports:
        done = protocol.Done(call.request_id, "stop", ids, lps, extra)
        await pool.handle_message(handle, _frame(done, handle))
    assert told.version_spans() == [(4, 0, 2)]
    assert silent.version_spans() == [(2, 0, 2)]
