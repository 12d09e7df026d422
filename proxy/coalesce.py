"""Adaptive stream coalescing: while the event loop runs behind, a stream's tokens wait and
go out together; while it keeps up, every engine step is written at once.

Writing an engine step's tokens to a stream costs a socket write and an SSE event per
stream per step, however few tokens the step carries, so when the proxy cannot keep up,
fewer and larger events are what frees it. Two gauges say when, both read where worker
frames are handled (the relay pool's ``after_frame``), so an idle proxy pays nothing and
wakes for nothing. The loop's *lag*: after a frame, a probe is queued behind whatever else
the loop has to do, and how long it waits says whether the loop runs behind. The loop's
*busy share*: the CPU time of the loop's thread over the wall time. Both are judged per
window of ``window_s``: a window mostly busy, or with more than one late probe, makes the
loop *behind* (one late probe is a hiccup: a collection, a long request); it stays behind
until a window is much less busy and has no late probe. While behind, a stream that has
shown its first event holds its tokens (``Delivery.HELD``) until ``group`` of them wait
(then the step that makes the group writes them, as ``--stream-interval`` would) or the
first of them has waited ``hold_s`` (then the next frame's end writes them, or a timer
where no frame comes); when the loop has caught up, what is held goes out at once. Nothing
else changes: a reply's first event and its end never wait, a socket that is not ready
makes tokens wait for the stream's own task as before, and nothing is dropped or
reordered (held tokens stay in their call, where the next tokens join them).
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
    BEHIND = "behind"  # the last window was busy or lagged: streams hold their tokens


@dataclass(slots=True, frozen=True)
class CoalescePolicy:
    """When the loop counts as behind, and how long held tokens wait."""

    window_s: float = 0.1  # the loop is judged per window this long (closed by a frame)
    busy_from: float = 0.8  # a window this busy (CPU of the loop's thread ÷ wall): behind
    busy_until: float = 0.5  # and behind until a window is less busy than this
    late_s: float = 0.005  # a probe that waited this long was late
    late_from: int = 2  # this many late probes in a window: behind
    group: int = 16  # held tokens go out with the step that makes this many
    hold_s: float = 0.03  # or once the first of them has waited this long


def still_behind(share: float, late: int, behind: bool, policy: CoalescePolicy) -> bool:
    """The verdict on a window in which the loop's thread ran ``share`` of the time and
    ``late`` probes were late. Behind from ``busy_from`` (or ``late_from`` late probes: a
    loop starved of CPU, or kept from its frames by other work); once behind, until a
    window below ``busy_until`` without a late probe (coalescing lowers the share it
    answers, which must not end it at once)."""
    if behind:
        return share >= policy.busy_until or late > 0
    return share >= policy.busy_from or late >= policy.late_from


def should_hold(state: LoopState, waiting: int, policy: CoalescePolicy) -> bool:
    """Whether a stream that has shown its first event holds its ``waiting`` tokens."""
    return state is LoopState.BEHIND and waiting < policy.group


def due(held_since: float, now: float, policy: CoalescePolicy) -> bool:
    """Whether tokens held since ``held_since`` go out at ``now`` (a millisecond early
    counts: the sweep's timer runs on the loop's own clock)."""
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
    """The loop's state, judged per window from its busy share and its probes' lag. No
    I/O, no asyncio."""

    policy: CoalescePolicy = field(default_factory=CoalescePolicy)
    state: LoopState = LoopState.IDLE
    last_lag: float = 0.0
    share: float = 0.0  # of the last whole window
    late: int = 0  # late probes in the window so far
    window_at: float | None = None  # (wall, loop thread's CPU) when the window began
    window_cpu: float = 0.0

    def sample(self, lag: float) -> bool:
        """Record a probe's lag; whether it was late."""
        self.last_lag = lag
        if lag >= self.policy.late_s:
            self.late += 1
            return True
        return False

    def tick(self, now: float, cpu: float) -> LoopState:
        """The wall clock and the loop thread's CPU time now: a window that is over
        gets its verdict."""
        if self.window_at is None:
            self.window_at, self.window_cpu = now, cpu
            return self.state
        elapsed = now - self.window_at
        if elapsed < self.policy.window_s:
            return self.state
        self.share = (cpu - self.window_cpu) / elapsed
        behind = still_behind(self.share, self.late, self.state is LoopState.BEHIND, self.policy)
        self.state = LoopState.BEHIND if behind else LoopState.IDLE
        self.window_at, self.window_cpu, self.late = now, cpu, 0
        return self.state


class StreamCoalescer:
    """One per proxy: the gauge (fed by ``frame_handled``, the relay pool's
    ``after_frame``), the streams holding tokens, and the sweeps that write them: at the
    end of the first frame after they are due (the loop is awake then anyway) or, where
    no frame comes, by a timer."""

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
        self._timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"<StreamCoalescer {self.state.value} held={len(self._held)}>"

    @property
    def held(self) -> int:
        return len(self._held)

    def frame_handled(self) -> None:
        """A worker frame was handled: the state for the next frames' streams, what is
        due written, and a probe queued behind what the loop has to do (one at a
        time)."""
        now = self._clock()
        self.state = self.gauge.tick(now, self._cpu_clock())
        if self._held:
            if self.state is LoopState.IDLE:
                self.flush_all()  # caught up: what streams hold goes out now
            elif due(next(iter(self._held.values())), now, self.policy):
                self.sweep()
        if self._probing:
            return
        self._probing = True
        asyncio.get_running_loop().call_soon(self._probe, now)

    def _probe(self, queued_at: float) -> None:
        self._probing = False
        self.stats.probes += 1
        if self.gauge.sample(self._clock() - queued_at):
            self.stats.late_probes += 1

    def hold(self, call: RelayCall, waiting: int) -> bool:
        """Whether ``call`` (a stream past its first event) holds its ``waiting`` tokens
        now; a call that holds is written by a sweep unless it writes them first. The
        state is the one at the last frame's end (no clock read per stream)."""
        if not should_hold(self.state, waiting, self.policy):
            if self._held and self._held.pop(call, None) is not None and not self._held:
                self._disarm()
            return False
        self.stats.holds += 1
        if call not in self._held:
            self._held[call] = self._clock()
            if self._timer is None:
                self._arm(2 * self.policy.hold_s)
        return True

    def _arm(self, delay: float) -> None:
        # Frames usually sweep first: the timer is for streams whose worker went quiet.
        self._timer = asyncio.get_running_loop().call_later(delay, self._timed_sweep)

    def _disarm(self) -> None:
        """Nothing is held: no timer wakes the loop for nothing."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_sweep(self) -> None:
        self._timer = None
        self.sweep()

    def sweep(self) -> None:
        """Write the tokens of every stream that has held them for ``hold_s`` (or wake
        its task, where its socket is busy)."""
        self.stats.sweeps += 1
        now = self._clock()
        out = []
        for call, since in self._held.items():  # in the order they began to hold
            if not due(since, now, self.policy):
                break
            out.append(call)
        for call in out:
            del self._held[call]
        for call in out:
            self.stats.swept += call.flush()
        if not self._held:
            self._disarm()
        elif self._timer is None:
            first = next(iter(self._held.values()))
            self._arm(max(0.0, first + 2 * self.policy.hold_s - now))

    def flush_all(self) -> None:
        """Write what every stream holds now."""
        self._disarm()
        held, self._held = self._held, {}
        for call in held:
            call.flush()
