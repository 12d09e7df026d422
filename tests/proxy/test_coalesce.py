"""Adaptive stream coalescing: when the loop counts as behind, which tokens a stream holds,
and the sweep that writes them (a real pool and relay call; a clock the test sets)."""

from __future__ import annotations

import asyncio

from proxy.coalesce import (
    CoalescePolicy,
    LoopGauge,
    LoopState,
    StreamCoalescer,
    due,
    loop_state,
    should_hold,
    still_busy,
)
from relay import protocol
from relay.pool import Delivery, RelayCall, TokensEvent, WorkerPool
from tests.relay.test_pool import _add, _frame

POLICY = CoalescePolicy(
    late_s=0.002, linger_s=0.25, window_s=0.1, busy_from=0.8, busy_until=0.5, group=8, hold_s=0.02
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 0.0

    def __call__(self) -> float:
        return self.now

    def thread(self) -> float:
        return self.cpu


def _state(coalescer: StreamCoalescer) -> LoopState:
    return coalescer.state  # read anew each time (mypy would keep an earlier check's type)


def test_a_late_probe_makes_the_loop_behind_for_the_linger() -> None:
    """Behind from a late probe until ``linger_s`` after it; never late: idle."""
    assert loop_state(10.0, None, False, POLICY) is LoopState.IDLE
    assert loop_state(10.0, 9.9, False, POLICY) is LoopState.BEHIND
    assert loop_state(10.0, 10.0 - POLICY.linger_s, False, POLICY) is LoopState.BEHIND
    assert loop_state(10.0, 9.7, False, POLICY) is LoopState.IDLE
    assert loop_state(10.0, None, True, POLICY) is LoopState.BEHIND


def test_a_busy_loop_stays_busy_down_to_the_lower_share() -> None:
    """Busy from ``busy_from``, and once busy down to ``busy_until`` (hysteresis)."""
    assert not still_busy(0.79, False, POLICY)
    assert still_busy(0.8, False, POLICY)
    assert still_busy(0.6, True, POLICY)
    assert not still_busy(0.49, True, POLICY)


def test_only_a_stream_short_of_a_group_holds_and_only_while_behind() -> None:
    """Behind: fewer than ``group`` waiting tokens are held, a group goes out; idle:
    nothing is held."""
    assert should_hold(LoopState.BEHIND, 1, POLICY)
    assert should_hold(LoopState.BEHIND, POLICY.group - 1, POLICY)
    assert not should_hold(LoopState.BEHIND, POLICY.group, POLICY)
    assert not should_hold(LoopState.IDLE, 1, POLICY)
    assert not due(10.0, 10.0 + POLICY.hold_s / 2, POLICY)
    assert due(10.0, 10.0 + POLICY.hold_s, POLICY)


def test_the_gauge_measures_the_loops_busy_share_per_window() -> None:
    """A window's share is the loop thread's CPU over the wall time; a window still
    open changes nothing."""
    gauge = LoopGauge(POLICY)
    gauge.tick(0.0, 0.0)
    gauge.tick(0.05, 0.05)  # the window is not over
    assert not gauge.busy
    gauge.tick(0.1, 0.09)
    assert gauge.busy
    assert abs(gauge.share - 0.9) < 1e-9
    assert gauge.state(0.1) is LoopState.BEHIND
    gauge.tick(0.2, 0.15)  # 0.6: still busy
    assert gauge.busy
    gauge.tick(0.32, 0.19)  # 0.33: no longer
    assert not gauge.busy
    assert gauge.state(0.3) is LoopState.IDLE


async def test_a_probe_that_waits_behind_other_work_makes_the_loop_behind() -> None:
    """The probe queued after a frame measures how long the loop made it wait: a short
    wait leaves the loop idle, a long one makes it behind until the linger is over."""
    clock = Clock()
    coalescer = StreamCoalescer(POLICY, clock=clock, cpu_clock=clock.thread)
    coalescer.frame_handled()
    await asyncio.sleep(0)
    coalescer.frame_handled()
    assert _state(coalescer) is LoopState.IDLE
    await asyncio.sleep(0)
    coalescer.frame_handled()
    clock.now += 0.01  # the loop was busy elsewhere before the probe ran
    await asyncio.sleep(0)
    assert coalescer.stats.late_probes == 1
    assert _state(coalescer) is LoopState.BEHIND
    clock.now += POLICY.linger_s + 0.01
    coalescer.frame_handled()
    assert _state(coalescer) is LoopState.IDLE


async def _stream(
    pool: WorkerPool, coalescer: StreamCoalescer
) -> tuple[RelayCall, list[str], asyncio.Task[None]]:
    """A call whose sink does what the proxy's stream does: hold while the coalescer says
    so, else write (recorded as "ids", or "ids!" when a flush wrote them)."""
    call = await pool.start("tiny", [1], protocol.Sampling(max_tokens=64))
    written: list[str] = []

    def sink(tokens: TokensEvent, may_hold: bool) -> Delivery:
        if may_hold and written and coalescer.hold(call, len(tokens.token_ids)):
            return Delivery.HELD
        ids = ",".join(str(t) for t in tokens.token_ids)
        written.append(ids if may_hold else ids + "!")
        return Delivery.WRITTEN

    call.deliver_to(sink, group=POLICY.group)

    async def consume() -> None:
        async for _event in call.events():
            pass

    task = asyncio.get_running_loop().create_task(consume())
    await asyncio.sleep(0)
    return call, written, task


async def test_behind_a_stream_writes_groups_and_the_sweep_writes_the_rest() -> None:
    """While behind, a stream's first step goes out at once, later steps wait until a
    group is there (written with the step that completes it) or until the sweep after
    ``hold_s`` writes what waits; idle again, what waits goes out at once and then every
    step as it comes."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    coalescer = StreamCoalescer(POLICY)
    pool.after_frame = coalescer.frame_handled
    call, written, consumer = await _stream(pool, coalescer)
    rid = call.request_id
    coalescer.gauge.busy = True  # as if the last window had been busy
    coalescer.frame_handled()
    assert _state(coalescer) is LoopState.BEHIND

    async def step(*tokens: int) -> None:
        ids, logprobs = protocol.pack_ids(tokens), protocol.pack_logprobs([-1.0] * len(tokens))
        await pool.handle_message(handle, _frame(protocol.Delta(rid, ids, logprobs), handle))

    for token in range(1, 11):
        await step(token)
    assert written == ["1", "2,3,4,5,6,7,8,9"]  # the first, then a group of eight
    assert coalescer.held == 1  # 10 waits
    await step(11)
    await asyncio.sleep(POLICY.hold_s * 3)
    assert written[2:] == ["10,11!"]  # the sweep wrote what had waited hold_s
    assert coalescer.held == 0
    assert coalescer.stats.swept == 1
    await step(12)
    assert written[3:] == []
    assert coalescer.held == 1
    coalescer.gauge.busy = False
    coalescer.frame_handled()  # a frame's end finds the loop idle again
    assert _state(coalescer) is LoopState.IDLE
    assert written[3:] == ["12!"]
    await step(13)
    await step(14)
    assert written[4:] == ["13", "14"]
    await pool.handle_message(handle, _frame(protocol.Done(rid, "stop"), handle))
    await asyncio.wait_for(consumer, 5)
    assert list(call.received) == list(range(1, 15))
