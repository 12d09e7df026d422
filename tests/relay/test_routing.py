"""Routing rows through the pool: asked only of workers that report them, gathered from
Done once each (rows an engine gives from earlier than asked are dropped), and a call
continued after a preemption or a lost worker asks from where its rows end.

The transport is the in-memory link of tests/relay/test_pool.py; the pool and protocol are
real."""

from __future__ import annotations

import pytest

from relay import protocol
from relay.exceptions import NoWorkerAvailableError
from relay.pool import FinishedEvent, RoutedRows, WorkerHandle, WorkerId, WorkerPool
from tests.relay.test_pool import RecordingLink, _frame, _wait_sent

SHAPE = protocol.RoutingShape(layers=2, top_k=2, experts=300)  # uint16: 8 bytes a row


def row(position: int) -> bytes:
    values = [(position * 5 + slot) % 300 for slot in range(4)]
    return b"".join(v.to_bytes(2, "little") for v in values)


def rows(start: int, end: int) -> bytes:
    return b"".join(row(p) for p in range(start, end))


async def _add(
    pool: WorkerPool, wid: str, *, routing: bool = True, version: int = protocol.PROTOCOL_VERSION
) -> tuple[WorkerHandle, RecordingLink]:
    link = RecordingLink()
    endpoint = protocol.ProxyEndpoint()
    endpoint.state = protocol.ConnectionState.OPEN
    endpoint.version = version
    info = protocol.ModelInfo("moe", 1024, "raw", "hf", {}, routing=SHAPE if routing else None)
    handle = WorkerHandle(WorkerId(wid), link, endpoint, {"moe": info}, 4)
    await pool.add_worker(handle)
    return handle, link


def _done(rid: str, ids: list[int], start: int, end: int, **extra: int) -> protocol.Done:
    return protocol.Done(
        rid,
        "stop",
        protocol.pack_ids(ids),
        protocol.pack_logprobs([-1.0] * len(ids)),
        dict(extra),
        routed_experts=protocol.RoutedExperts(start, end - start, rows(start, end)),
    )


async def test_rows_are_asked_only_of_workers_that_report_them() -> None:
    """A call asking for rows skips a dense worker and a protocol-4 one; a call that asks
    none runs anywhere and asks nothing."""
    pool = WorkerPool(wait_seconds=0.2)
    await _add(pool, "a-dense", routing=False)
    await _add(pool, "b-old", version=protocol.IMAGES_VERSION)
    assert pool.routing("moe") is None
    with pytest.raises(NoWorkerAvailableError):
        await pool.start("moe", [1, 2, 3], protocol.Sampling(max_tokens=2), routed_experts_from=0)
    _, link = await _add(pool, "c-moe")
    assert pool.routing("moe") == SHAPE
    call = await pool.start(
        "moe", [1, 2, 3], protocol.Sampling(max_tokens=2), routed_experts_from=2
    )
    assert call.worker_id == "c-moe"
    sent = link.sent[-1]
    assert isinstance(sent, protocol.Generate)
    assert sent.routed_experts_from == 2
    plain = await pool.start("moe", [1], protocol.Sampling(max_tokens=2))
    assert plain.routed is None
    assert plain.worker_id == "a-dense"


async def test_rows_from_earlier_than_asked_are_kept_once() -> None:
    """An engine may give rows from before the position asked: only those from it on are
    kept, and the version that made them with them."""
    pool = WorkerPool(wait_seconds=1)
    handle, _ = await _add(pool, "w")
    call = await pool.start(
        "moe", [1, 2, 3, 4], protocol.Sampling(max_tokens=3), routed_experts_from=3
    )
    done = _done(call.request_id, [7, 8, 9], 0, 6, **{protocol.POLICY_VERSION: 4})
    await pool.handle_message(handle, _frame(done, handle))
    events = [e async for e in call.events()]
    assert isinstance(events[-1], FinishedEvent)
    routed = call.routed
    assert routed is not None
    assert (routed.start, routed.end, bytes(routed.data)) == (3, 6, rows(3, 6))
    assert routed.versions == [(4, 3, 6)]
    assert routed.missing == []


async def test_a_preempted_call_asks_from_where_its_rows_end() -> None:
    """A request preempted by a weight update continues on the new weights asking only for
    the rows past those its first attempt brought; the rows say which version made them."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _add(pool, "w")
    call = await pool.start(
        "moe", [1, 2, 3], protocol.Sampling(max_tokens=6), routed_experts_from=1
    )
    rid = call.request_id
    pool.hold()
    first = protocol.Done(
        rid,
        "abort",
        protocol.pack_ids([5, 6]),
        protocol.pack_logprobs([-1.0, -1.0]),
        {protocol.PREEMPTED: 1, protocol.POLICY_VERSION: 0},
        routed_experts=protocol.RoutedExperts(1, 3, rows(1, 4)),  # positions 1..3 ran
    )
    await pool.handle_message(handle, _frame(first, handle))
    handle.version = 1
    pool.release()
    await _wait_sent(link, 2)
    again = link.sent[1]
    assert isinstance(again, protocol.Generate)
    assert protocol.unpack_ids(again.prompt_ids) == [1, 2, 3, 5, 6]
    assert again.routed_experts_from == 4
    done = _done(rid, [7], 4, 6, **{protocol.POLICY_VERSION: 1})
    await pool.handle_message(handle, _frame(done, handle))
    [e async for e in call.events()]
    routed = call.routed
    assert routed is not None
    assert bytes(routed.data) == rows(1, 6)
    assert routed.versions == [(0, 1, 4), (1, 4, 6)]


async def test_a_call_resumed_after_a_lost_worker_asks_for_every_row_again() -> None:
    """The lost worker's rows never came (they travel in Done): the worker that continues
    is asked from the call's start, and its prefill gives them all."""
    pool = WorkerPool(wait_seconds=1)
    lost, _ = await _add(pool, "a")
    call = await pool.start("moe", [1, 2], protocol.Sampling(max_tokens=4), routed_experts_from=0)
    rid = call.request_id
    delta = protocol.Delta(rid, protocol.pack_ids([5]), protocol.pack_logprobs([-1.0]))
    await pool.handle_message(lost, _frame(delta, lost))
    other, link = await _add(pool, "b")
    await pool.remove_worker(lost, "gone")
    await _wait_sent(link, 1)
    again = link.sent[0]
    assert isinstance(again, protocol.Generate)
    assert again.routed_experts_from == 0
    await pool.handle_message(other, _frame(_done(rid, [6], 0, 3), other))
    [e async for e in call.events()]
    assert call.routed is not None
    assert bytes(call.routed.data) == rows(0, 3)


def test_rows_that_do_not_fit_are_dropped_and_a_gap_is_missing() -> None:
    """Rows of the wrong size are refused (nothing kept); rows starting later than asked
    leave the positions between missing, as zeros."""
    gathered = RoutedRows(2)
    bad = protocol.RoutedExperts(2, 2, rows(2, 3))
    with pytest.raises(ValueError, match="not 2 rows"):
        gathered.add(bad, SHAPE, 0)
    assert gathered.add(protocol.RoutedExperts(4, 2, rows(4, 6)), SHAPE, 0) == 2
    assert gathered.missing == [(2, 4)]
    assert bytes(gathered.data) == bytes(2 * SHAPE.row_bytes) + rows(4, 6)


async def test_a_call_stopped_by_the_proxy_keeps_the_rows_of_its_last_frame() -> None:
    """Cancelled to keep its rows (a stop string matched), a call takes the rows of the
    Done that follows the cancel; cancelled otherwise (its client left) it waits for
    nothing, and the pool holds no reference to it either way."""
    pool = WorkerPool(wait_seconds=1)
    handle, _ = await _add(pool, "w")
    stopped = await pool.start(
        "moe", [1, 2, 3], protocol.Sampling(max_tokens=8), routed_experts_from=0
    )
    await stopped.cancel(keep_rows=True)
    await pool.handle_message(handle, _frame(_done(stopped.request_id, [4, 5], 0, 4), handle))
    await stopped.rows_after_cancel()
    assert stopped.routed is not None
    assert (stopped.routed.end, bytes(stopped.routed.data)) == (4, rows(0, 4))
    left = await pool.start(
        "moe", [1, 2, 3], protocol.Sampling(max_tokens=8), routed_experts_from=0
    )
    await left.cancel()
    await left.rows_after_cancel()  # returns at once: nobody waits for its rows
    assert pool._closing == {}
    waiting = await pool.start(
        "moe", [1, 2, 3], protocol.Sampling(max_tokens=8), routed_experts_from=0
    )
    await waiting.cancel(keep_rows=True)
    await pool.remove_worker(handle, "gone")  # the rows will never come
    await waiting.rows_after_cancel()
    assert pool._closing == {}
