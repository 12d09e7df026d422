"""Adaptive stream coalescing: while the event loop runs behind, a stream's tokens wait and
go out together; while it keeps up, every engine step is written at once.

Writing an engine step's tokens to a stream costs a socket write and an SSE event per
stream per step, however few tokens the step carries, so when the proxy cannot keep up,
fewer and larger events are what frees it. Two gauges say when, both read where worker
frames are handled (the relay pool's ``after_frame``), so an idle proxy pays nothing and
wakes for nothing. The loop's *lag*: after a frame, a probe is queued behind whatever else
the loop has to do, and how long it waits says whether the loop runs behind (one late
probe makes it *behind* for ``linger_s``). The loop's *busy share*: the CPU time of the
loop's thread over the wall time, per window of ``window_s``; a loop busy most of a window
is behind too (even where each probe finds a short queue, as when one worker's frames keep
it busy), until a window is much less busy again. While behind, a stream that has shown
its first event holds its tokens (``Delivery.HELD``) until ``group`` of them wait (then
the step that makes the group writes them, as ``--stream-interval`` would) or the first of
them has waited ``hold_s`` (then a sweep writes them); when the loop is caught up, what is
held goes out at once. Nothing else changes: a reply's first event and its end never
wait, a socket that is not ready makes tokens wait for the stream's own task as before,
and nothing is dropped or reordered (held tokens stay in their call, where the next tokens
join them).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from relay.pool import RelayCall


class CoalesceMode(enum.Enum):
    """``rollout-relay proxy --stream-coalesce``."""

    ADAPTIVE = "adaptive"  # hold streams' tokens while the loop runs behind
    OFF = "off"  # write every engine step as it arrives, however busy the proxy is


class LoopState(enum.Enum):
    IDLE = "idle"  # the loop keeps up: every engine step is written at once
    BEHIND = "behind"  # a recent probe was late: streams hold their tokens


@dataclass(slots=True, frozen=True)
class CoalescePolicy:
    """When the loop counts as behind, and how long held tokens wait."""

    late_s: float = 0.002  # a probe that waited this long: the loop runs behind
    linger_s: float = 0.25  # behind for this long after the last late probe
    window_s: float = 0.1  # the loop's busy share is measured over windows this long
    busy_from: float = 0.8  # a window this busy (CPU of the loop's thread ÷ wall): behind
    busy_until: float = 0.5  # and behind until a window is less busy than this
    group: int = 8  # held tokens go out with the step that makes this many
    hold_s: float = 0.025  # or once the first of them has waited this long


def loop_state(
    now: float, last_late_at: float | None, busy: bool, policy: CoalescePolicy
) -> LoopState:
    """Behind while the loop is busy, or while the last late probe is at most
    ``linger_s`` old."""
    if busy or (last_late_at is not None and now - last_late_at <= policy.linger_s):
        return LoopState.BEHIND
    return LoopState.IDLE


def still_busy(share: float, busy: bool, policy: CoalescePolicy) -> bool:
    """Whether the loop counts as busy after a window in which its thread ran ``share``
    of the time: it becomes busy from ``busy_from`` and stays so down to ``busy_until``
    (coalescing lowers the share it answers, which must not end it at once)."""
    return share >= (policy.busy_until if busy else policy.busy_from)


def should_hold(state: LoopState, waiting: int, policy: CoalescePolicy) -> bool:
    """Whether a stream that has shown its first event holds its ``waiting`` tokens."""
    return state is LoopState.BEHIND and waiting < policy.group


def due(held_since: float, now: float, policy: CoalescePolicy) -> bool:
    """Whether tokens held since ``held_since`` go out at a sweep at ``now`` (a
    millisecond early counts: the sweep's timer runs on the loop's own clock)."""
    return now - held_since >= policy.hold_s - 0.001


@dataclass(slots=True)
class CoalesceStats:
    """Monotonic counters."""

    probes: int = 0
    late_probes: int = 0
    holds: int = 0  # offers of a stream's tokens that were held
    sweeps: int = 0
    swept: int = 0  # streams whose held tokens a sweep wrote


@dataclass(slots=True)
class LoopGauge:
    """The loop's lag as the probes measure it, and its busy share per window. No I/O, no
    asyncio."""

    policy: CoalescePolicy = field(default_factory=CoalescePolicy)
    last_lag: float = 0.0
    last_late_at: float | None = None
    busy: bool = False
    share: float = 0.0  # of the last whole window
    window_at: float | None = None  # (wall, loop thread's CPU) when the window began
    window_cpu: float = 0.0

    def sample(self, lag: float, now: float) -> bool:
        """Record a probe's lag; whether it was late."""
        self.last_lag = lag
        if lag >= self.policy.late_s:
            self.last_late_at = now
            return True
        return False

    def tick(self, now: float, cpu: float) -> None:
        """The wall clock and the loop thread's CPU time now: a window that is over
        updates the busy state."""
        if self.window_at is None:
            self.window_at, self.window_cpu = now, cpu
            return
        elapsed = now - self.window_at
        if elapsed < self.policy.window_s:
            return
        self.share = (cpu - self.window_cpu) / elapsed
        self.busy = still_busy(self.share, self.busy, self.policy)
        self.window_at, self.window_cpu = now, cpu

    def state(self, now: float) -> LoopState:
        return loop_state(now, self.last_late_at, self.busy, self.policy)


class StreamCoalescer:
    """One per proxy: the gauge (fed by ``frame_handled``, the relay pool's
    ``after_frame``), the streams holding tokens, and the sweep that writes them."""

    def __init__(
        self,
        policy: CoalescePolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.policy = policy or CoalescePolicy()
        self.gauge = LoopGauge(self.policy)
        self.stats = CoalesceStats()
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._probing = False
        self.state = LoopState.IDLE
        # Streams holding tokens, and since when (in the order they began to hold).
        self._held: dict[RelayCall, float] = {}
        self._sweep: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<StreamCoalescer {self.state.value} held={len(self._held)}>"

    @property
    def held(self) -> int:
        return len(self._held)

    def frame_handled(self) -> None:
        """A worker frame was handled: the state for the next frame's streams, and a
        probe queued behind what the loop has to do (one at a time)."""
        now = self._clock()
        self.gauge.tick(now, self._cpu_clock())
        state = self.gauge.state(now)
        if state is not self.state:
            self.state = state
            if state is LoopState.IDLE and self._held:
                self.flush_all()  # caught up: what streams hold goes out now
        if self._probing:
            return
        self._probing = True
        asyncio.get_running_loop().call_soon(self._probe, now)

    def _probe(self, queued_at: float) -> None:
        self._probing = False
        now = self._clock()
        self.stats.probes += 1
        if self.gauge.sample(now - queued_at, now):
            self.stats.late_probes += 1
            self.state = LoopState.BEHIND

    def hold(self, call: RelayCall, waiting: int) -> bool:
        """Whether ``call`` (a stream past its first event) holds its ``waiting`` tokens
        now; a call that holds is written by a sweep unless it writes them first. The
        state is the one at the last frame's end or probe (no clock read per stream)."""
        if not should_hold(self.state, waiting, self.policy):
            if self._held:
                self._held.pop(call, None)
            return False
        self.stats.holds += 1
        if call not in self._held:
            self._held[call] = self._clock()
            if self._sweep is None:
                self._arm(self.policy.hold_s)
        return True

    def _arm(self, delay: float) -> None:
        self._sweep = asyncio.get_running_loop().call_later(delay, self.sweep)

    def sweep(self) -> None:
        """Write the tokens of every stream that has held them for ``hold_s`` (or wake
        its task, where its socket is busy); come back for the others."""
        self._sweep = None
        self.stats.sweeps += 1
        now = self._clock()
        out = [call for call, since in self._held.items() if due(since, now, self.policy)]
        for call in out:
            del self._held[call]
        for call in out:
            self.stats.swept += call.flush()
        if self._held:  # in the order they began to hold: the first is due first
            first = next(iter(self._held.values()))
            self._arm(max(0.0, first + self.policy.hold_s - now))

    def flush_all(self) -> None:
        """Write what every stream holds now, and stop sweeping until one holds again."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        held, self._held = self._held, {}
        for call in held:
            call.flush()
