"""The worker pool: choosing workers, routing frames, re-dispatch and cancellation.

The transport is an in-memory link that records frames; the pool and protocol are real.
"""

from __future__ import annotations

import asyncio

import pytest

from relay import protocol
from relay.exceptions import NoWorkerAvailableError, WorkerFailedError
from relay.pool import (
    FinishedEvent,
    RestartedEvent,
    TokensEvent,
    WorkerHandle,
    WorkerId,
    WorkerLoad,
    WorkerPool,
    choose_worker,
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
    assert [type(e) for e in events] == [TokensEvent, TokensEvent, FinishedEvent]
    assert events[0].token_ids == [7]
    assert events[1].token_ids == [8]
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


async def test_lost_worker_requests_restart_on_another_worker() -> None:
    """When a worker drops, its request restarts from the beginning elsewhere."""
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
    for _ in range(50):
        if link2.sent:
            break
        await asyncio.sleep(0.01)
    assert isinstance(link2.sent[0], protocol.Generate)
    assert call.worker_id == "b"
    # A late frame from the lost worker is ignored.
    await pool.handle_message(h1, protocol.Delta(rid, protocol.pack_ids([99]), b"\0\0\0\0"))
    await pool.handle_message(
        h2,
        _frame(
            protocol.Done(rid, "stop", protocol.pack_ids([6]), protocol.pack_logprobs([-0.5])), h2
        ),
    )
    events = [e async for e in call.events()]
    assert [type(e) for e in events] == [TokensEvent, RestartedEvent, TokensEvent, FinishedEvent]
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
