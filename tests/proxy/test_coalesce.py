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
    should_hold,
    still_behind,
)
from relay import protocol
from relay.pool import Delivery, RelayCall, TokensEvent, WorkerPool
from tests.relay.test_pool import _add, _frame

POLICY = CoalescePolicy(
    window_s=0.1, busy_from=0.8, busy_until=0.5, late_s=0.005, late_from=2, group=8, hold_s=0.02
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


def test_a_busy_or_lagging_window_makes_the_loop_behind_until_one_is_calm() -> None:
    """Behind after a window busy from ``busy_from`` or with ``late_from`` late probes (one
    is a hiccup); once behind, until a window below ``busy_until`` with none late."""
    assert not still_behind(0.79, 0, False, POLICY)
    assert still_behind(0.8, 0, False, POLICY)
    assert not still_behind(0.1, 1, False, POLICY)
    assert still_behind(0.1, 2, False, POLICY)
    assert still_behind(0.6, 0, True, POLICY)
    assert still_behind(0.1, 1, True, POLICY)
    assert not still_behind(0.49, 0, True, POLICY)


def test_only_a_stream_short_of_a_group_holds_and_only_while_behind() -> None:
    """Behind: fewer than ``group`` waiting tokens are held, a group goes out; idle:
    nothing is held. Held tokens are due after ``hold_s``."""
    assert should_hold(LoopState.BEHIND, 1, POLICY)
    assert should_hold(LoopState.BEHIND, POLICY.group - 1, POLICY)
    assert not should_hold(LoopState.BEHIND, POLICY.group, POLICY)
    assert not should_hold(LoopState.IDLE, 1, POLICY)
    assert not due(10.0, 10.0 + POLICY.hold_s / 2, POLICY)
    assert due(10.0, 10.0 + POLICY.hold_s, POLICY)


def test_the_gauge_judges_each_window_by_busy_share_and_late_probes() -> None:
    """A window's share is the loop thread's CPU over the wall time; a window still open
    changes nothing; late probes count in the window they fell in."""
    gauge = LoopGauge(POLICY)
    gauge.tick(0.0, 0.0)
    assert gauge.tick(0.05, 0.05) is LoopState.IDLE  # the window is not over
    assert gauge.tick(0.1, 0.09) is LoopState.BEHIND
    assert abs(gauge.share - 0.9) < 1e-9
    assert gauge.tick(0.2, 0.15) is LoopState.BEHIND  # 0.6: still busy enough
    assert gauge.tick(0.32, 0.19) is LoopState.IDLE  # 0.33
    assert not gauge.sample(0.004)
    assert gauge.sample(0.006)
    assert gauge.tick(0.43, 0.2) is LoopState.IDLE  # one late probe: a hiccup
    gauge.sample(0.01)
    gauge.sample(0.02)
    assert gauge.tick(0.54, 0.21) is LoopState.BEHIND
    assert gauge.tick(0.65, 0.22) is LoopState.IDLE  # calm, none late


async def test_probes_that_wait_behind_other_work_make_the_loop_behind() -> None:
    """The probe queued after a frame measures how long the loop made it wait: short
    waits leave the loop idle, a window with late ones makes it behind."""
    clock = Clock()
    coalescer = StreamCoalescer(POLICY, clock=clock, cpu_clock=clock.thread)
    coalescer.frame_handled()
    await asyncio.sleep(0)
    for _ in range(2):
        coalescer.frame_handled()
        clock.now += 0.01  # the loop was busy elsewhere before the probe ran
        await asyncio.sleep(0)
    assert coalescer.stats.late_probes == 2
    assert _state(coalescer) is LoopState.IDLE  # judged when the window is over
    clock.now += POLICY.window_s + 0.01
    coalescer.frame_handled()
    assert _state(coalescer) is LoopState.BEHIND
    await asyncio.sleep(0)
    clock.now += POLICY.window_s + 0.01
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
    group is there (written with the step that completes it) or until they are due after
    ``hold_s`` (written at the next frame's end, or by the timer when no frame comes);
    idle again, what waits goes out at once and then every step as it comes."""
    pool = WorkerPool(wait_seconds=1)
    handle, _link = await _add(pool, "w1")
    clock = Clock()
    coalescer = StreamCoalescer(POLICY, clock=clock, cpu_clock=clock.thread)
    pool.after_frame = coalescer.frame_handled
    call, written, consumer = await _stream(pool, coalescer)
    rid = call.request_id
    coalescer.frame_handled()
    await asyncio.sleep(0)  # its probe runs at once
    clock.now += POLICY.window_s + 0.01
    clock.cpu += POLICY.window_s  # a window the loop was busy throughout
    coalescer.frame_handled()
    assert _state(coalescer) is LoopState.BEHIND

    async def step(*tokens: int) -> None:
        ids, logprobs = protocol.pack_ids(tokens), protocol.pack_logprobs([-1.0] * len(tokens))
        await pool.handle_message(handle, _frame(protocol.Delta(rid, ids, logprobs), handle))
        await asyncio.sleep(0)  # its probe runs before the clock moves on: never late

    for token in range(1, 11):
        await step(token)
    assert written == ["1", "2,3,4,5,6,7,8,9"]  # the first, then a group of eight
    assert coalescer.held == 1  # 10 waits
    await step(11)
    clock.now += POLICY.hold_s / 2
    clock.cpu += POLICY.hold_s / 2
    await step(12)
    assert written[2:] == []  # not due yet
    clock.now += POLICY.hold_s / 2
    clock.cpu += POLICY.hold_s / 2
    await step(13)
    assert written[2:] == ["10,11,12,13!"]  # due: the frame's end wrote them
    assert coalescer.held == 0
    await step(14)
    clock.now += POLICY.hold_s  # and no more frames: the timer writes them
    await asyncio.sleep(POLICY.hold_s * 3)
    assert written[3:] == ["14!"]
    assert coalescer.stats.swept == 2
    await step(15)
    assert written[4:] == []
    assert coalescer.held == 1
    clock.now += POLICY.window_s + 0.01  # a calm window
    coalescer.frame_handled()  # whose end finds the loop idle again
    assert _state(coalescer) is LoopState.IDLE
    assert written[4:] == ["15!"]
    await step(16)
    await step(17)
    assert written[5:] == ["16", "17"]
    await pool.handle_message(handle, _frame(protocol.Done(rid, "stop"), handle))
    await asyncio.wait_for(consumer, 5)
    assert list(call.received) == list(range(1, 18))
