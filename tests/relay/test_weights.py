"""Weight updates across the pool: the update's state machine, and ``WeightSync`` driving
workers through Pause / Load / Commit or Rollback.

The transport is an in-memory link that answers each phase as a worker would (or fails,
stays silent, or leaves, as configured); the pool, protocol endpoints and ``WeightSync``
are real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from relay import protocol
from relay.exceptions import (
    RelayError,
    UpdateFailedError,
    UpdateRefusedError,
    WeightsUpdateError,
)
from relay.pool import WorkerHandle, WorkerId, WorkerPool, WorkerState
from relay.weights import Admission, UpdateState, WeightsUpdate, WeightSync, admit

Phase = protocol.UpdatePhase

_PHASES: dict[type, protocol.UpdatePhase] = {
    protocol.Pause: Phase.PAUSED,
    protocol.Load: Phase.LOADED,
    protocol.Commit: Phase.COMMITTED,
    protocol.Rollback: Phase.ROLLED_BACK,
}


class WorkerLink:
    """A worker on the other end of the link: answers each update phase with an
    ``UpdateAck`` through the pool, as the worker client does. ``fail``: phases answered
    ``ok=False`` with that message; ``silent``: phases never answered; ``leave_on``: the
    phase on whose arrival the worker disconnects; ``gate``: awaited before answering
    (``gate_on``: only that phase's answer); ``busy``: the pause is refused as a worker
    in another proxy replica's update refuses it. ``paused`` says whether the worker's
    engine holds its requests (paused and neither committed nor rolled back)."""

    def __init__(
        self,
        pool: WorkerPool,
        *,
        version: int = 0,
        fail: dict[protocol.UpdatePhase, str] | None = None,
        silent: frozenset[protocol.UpdatePhase] = frozenset(),
        leave_on: protocol.UpdatePhase | None = None,
        gate: asyncio.Event | None = None,
        gate_on: protocol.UpdatePhase | None = None,
        busy: bool = False,
    ) -> None:
        self.pool = pool
        self.handle: WorkerHandle | None = None
        self.sent: list[protocol.ProxyMessage] = []
        self.closed = False
        self.version = version  # what the worker's engine serves
        self.staged: int | None = None
        self.fail = fail or {}
        self.silent = silent
        self.leave_on = leave_on
        self.gate = gate
        self.gate_on = gate_on
        self.busy = busy
        self.paused = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError("closed")
        message = protocol.decode_proxy_message(data)
        self.sent.append(message)
        if isinstance(
            message, protocol.Pause | protocol.Load | protocol.Commit | protocol.Rollback
        ):
            task = asyncio.create_task(self._answer(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self, reason: str) -> None:
        self.closed = True

    def phases(self) -> list[str]:
        """The update messages received, by name (``Load`` with its version and path)."""
        names: list[str] = []
        for message in self.sent:
            if isinstance(message, protocol.Load):
                names.append(f"Load({message.version}, {message.path})")
            elif not isinstance(message, protocol.Ping):
                names.append(type(message).__name__)
        return names

    async def _answer(self, message: protocol.UpdateMessage) -> None:
        phase = _PHASES[type(message)]
        if self.gate is not None and self.gate_on in (None, phase):
            await self.gate.wait()
        await asyncio.sleep(0)  # the answer comes later than the send, as over a socket
        handle = self.handle
        assert handle is not None
        if phase is self.leave_on:
            self.closed = True
            await self.pool.remove_worker(handle, "connection lost")
            return
        if phase in self.silent or self.closed:
            return
        if phase is Phase.PAUSED and self.busy:
            ack = protocol.UpdateAck(
                message.update_id,
                phase,
                False,
                self.version,
                "another update",
                code=protocol.ACK_BUSY,
            )
            await self.pool.handle_message(handle, handle.endpoint.receive(protocol.encode(ack)))
            return
        ok = phase not in self.fail
        if ok and isinstance(message, protocol.Pause):
            self.paused = True
        elif isinstance(message, protocol.Commit | protocol.Rollback):
            self.paused = False  # a failed commit resumes the engine on its old weights
        if ok and isinstance(message, protocol.Load):
            self.staged = message.version
        elif ok and isinstance(message, protocol.Commit):
            assert self.staged is not None
            self.version, self.staged = self.staged, None
        elif isinstance(message, protocol.Rollback):
            self.staged = None
        version = self.staged if self.staged is not None else self.version
        ack = protocol.UpdateAck(message.update_id, phase, ok, version, self.fail.get(phase, ""))
        await self.pool.handle_message(handle, handle.endpoint.receive(protocol.encode(ack)))


async def _add(
    pool: WorkerPool,
    wid: str,
    *,
    version: int = 0,
    path: str | None = None,
    protocol_version: int = protocol.PROTOCOL_VERSION,
    **link_options: object,
) -> tuple[WorkerHandle, WorkerLink]:
    link = WorkerLink(pool, version=version, **link_options)  # type: ignore[arg-type]
    endpoint = protocol.ProxyEndpoint()
    endpoint.state = protocol.ConnectionState.OPEN
    endpoint.version = protocol_version
    info = protocol.ModelInfo("tiny", 1024, "raw", "hf", {})
    handle = WorkerHandle(
        WorkerId(wid), link, endpoint, {"tiny": info}, 4, version=version, weights_path=path
    )
    link.handle = handle
    await pool.add_worker(handle)
    return handle, link


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


def _generates(link: WorkerLink) -> list[protocol.Generate]:
    return [m for m in link.sent if isinstance(m, protocol.Generate)]


# --------------------------------------------------------------------------- decisions


def test_admit_joins_retries_and_refuses_old_versions_and_concurrent_updates() -> None:
    """The same update (version and path) joins the running one or replays the last
    finished one; otherwise an update must name a newer version than the pool's, and
    only one runs at a time."""
    assert admit((3, "/c"), (4, "/a"), None, None) is Admission.START
    for version in (3, 2):
        with pytest.raises(UpdateRefusedError) as refused:
            admit((3, "/c"), (version, "/a"), None, None)
        assert refused.value.code == "version_not_newer"
        assert not refused.value.retryable
    with pytest.raises(UpdateRefusedError) as busy:
        admit((3, "/c"), (5, "/b"), (4, "/a"), None)
    assert busy.value.code == "update_in_progress"
    assert busy.value.retryable
    assert admit((3, "/c"), (4, "/a"), (4, "/a"), None) is Admission.JOIN
    assert admit((4, "/a"), (4, "/a"), None, (4, "/a")) is Admission.REPLAY
    assert admit((4, "/a"), (4, "/a"), (5, "/b"), (4, "/a")) is Admission.REPLAY
    with pytest.raises(UpdateRefusedError):  # the same version from another path is new
        admit((4, "/a"), (4, "/other"), None, (4, "/a"))


def test_admit_answers_an_update_that_is_served_already_as_a_success() -> None:
    """Exactly the version and checkpoint served (a retry whose update committed before a
    restart, or through another replica) is served already, even while another update
    runs; the same version from another checkpoint, or stamped where a checkpoint holds
    it, is still refused."""
    assert admit((4, "/a"), (4, "/a"), None, None) is Admission.SERVED
    assert admit((4, None), (4, None), None, None) is Admission.SERVED
    assert admit((4, "/a"), (4, "/a"), (5, "/b"), None) is Admission.SERVED
    for asked in ((4, "/b"), (4, None)):
        with pytest.raises(UpdateRefusedError) as refused:
            admit((4, "/a"), asked, None, None)
        assert refused.value.code == "version_not_newer"
    with pytest.raises(UpdateRefusedError):
        admit((4, None), (4, "/a"), None, None)


def test_an_update_advances_only_along_its_state_machine() -> None:
    """Legal paths reach committed or rolled back; skipping a phase, committing a
    rollback or moving on from a final state raises."""
    update = WeightsUpdate("u1", 1, "/ckpt", protocol.PauseMode.WAIT)
    assert update.state is UpdateState.PAUSING
    with pytest.raises(RelayError):
        update.advance(UpdateState.COMMITTING)
    update.advance(UpdateState.LOADING)
    update.advance(UpdateState.COMMITTING)
    with pytest.raises(RelayError):
        update.advance(UpdateState.ROLLING_BACK)
    update.advance(UpdateState.COMMITTED)
    for state in UpdateState:
        with pytest.raises(RelayError):
            update.advance(state)
    back = WeightsUpdate("u2", 1, None, protocol.PauseMode.ABORT)
    back.advance(UpdateState.ROLLING_BACK)
    with pytest.raises(RelayError):
        back.advance(UpdateState.COMMITTED)
    back.advance(UpdateState.ROLLED_BACK)
    assert back.state is UpdateState.ROLLED_BACK
    lost = WeightsUpdate("u3", 1, None, protocol.PauseMode.WAIT)
    lost.advance(UpdateState.LOADING)
    lost.advance(UpdateState.COMMITTING)
    lost.advance(UpdateState.COMMIT_FAILED)
    with pytest.raises(RelayError):
        lost.advance(UpdateState.COMMITTED)


# --------------------------------------------------------------------------- updates


async def test_an_update_reaches_every_worker_in_three_phases() -> None:
    """Every worker gets Pause, Load(version, path) and Commit; then the pool, every
    handle and the report say the new version, and every worker serves again."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    (a, link_a), (b, link_b) = await _add(pool, "a"), await _add(pool, "b")
    report = await sync.update(1, "/ckpt/1", protocol.PauseMode.ABORT)
    for link in (link_a, link_b):
        assert link.phases() == ["Pause", "Load(1, /ckpt/1)", "Commit"]
        assert link.version == 1
    pause = link_a.sent[0]
    assert isinstance(pause, protocol.Pause)
    assert pause.mode is protocol.PauseMode.ABORT
    assert (pool.version, pool.weights_path) == (1, "/ckpt/1")
    assert [(h.version, h.weights_path, h.state) for h in (a, b)] == [
        (1, "/ckpt/1", WorkerState.SERVING)
    ] * 2
    assert report["version"] == 1
    assert [(w["worker_id"], w["version"]) for w in report["workers"]] == [("a", 1), ("b", 1)]
    assert (pool.held, sync.current) == (0, None)
    assert a.endpoint.updates == set()  # the final ack forgot the update


async def test_a_stamp_only_update_names_no_checkpoint() -> None:
    """Without a path the workers load nothing; the version moves, and neither the pool
    nor the handles name a checkpoint for it any more (none is known to hold it)."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    handle, link = await _add(pool, "a")
    await sync.update(1, "/ckpt/1")
    await sync.update(2)
    assert link.phases()[-3:] == ["Pause", "Load(2, None)", "Commit"]
    assert (pool.version, pool.weights_path) == (2, None)
    assert (handle.version, handle.weights_path) == (2, None)


async def test_one_worker_failing_to_load_rolls_every_worker_back() -> None:
    """All or nothing: when one worker cannot load, every worker is rolled back, nothing
    commits, and the pool and every handle keep the old version."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    a, link_a = await _add(pool, "a")
    b, link_b = await _add(pool, "b", fail={Phase.LOADED: "no such directory"})
    with pytest.raises(UpdateFailedError) as failed:
        await sync.update(1, "/missing")
    assert failed.value.code == "weights_load_failed"
    assert "no such directory" in failed.value.message
    for link in (link_a, link_b):
        assert link.phases() == ["Pause", "Load(1, /missing)", "Rollback"]
        assert link.version == 0
    assert (pool.version, pool.weights_path) == (0, None)
    assert [(h.version, h.state) for h in (a, b)] == [(0, WorkerState.SERVING)] * 2
    assert (pool.held, sync.current) == (0, None)
    # The pool serves again, on the old version.
    call = await asyncio.wait_for(pool.start("tiny", [1], protocol.Sampling(max_tokens=1)), 1)
    assert call.segments == [(0, 0)]


async def test_a_failed_pause_rolls_back_without_loading() -> None:
    """A worker that cannot pause (another update runs on it) stops the update before
    anything is loaded."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    _, link_a = await _add(pool, "a")
    _, link_b = await _add(pool, "b", fail={Phase.PAUSED: "another update is in progress"})
    with pytest.raises(UpdateFailedError):
        await sync.update(1, "/ckpt/1")
    for link in (link_a, link_b):
        assert link.phases() == ["Pause", "Rollback"]
    assert pool.version == 0


async def test_refused_updates_send_nothing() -> None:
    """A version that is not newer, an update while one runs, or a worker that speaks
    protocol 2 is refused before any worker is asked anything."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    gate = asyncio.Event()
    _, link = await _add(pool, "a", gate=gate)
    pool.version = 2
    with pytest.raises(UpdateRefusedError) as old:
        await sync.update(2, "/ckpt/2")
    assert old.value.code == "version_not_newer"
    assert link.sent == []

    running = asyncio.create_task(sync.update(3, "/ckpt/3"))
    await _until(lambda: len(link.sent) == 1, "the first update paused the worker")
    with pytest.raises(UpdateRefusedError) as busy:
        await sync.update(4, "/ckpt/4")
    assert busy.value.code == "update_in_progress"
    assert link.phases() == ["Pause"]
    gate.set()
    await asyncio.wait_for(running, 5)
    assert pool.version == 3

    legacy_pool = WorkerPool(wait_seconds=1)
    legacy_sync = WeightSync(legacy_pool, phase_seconds=5)
    _, new = await _add(legacy_pool, "a")
    _, legacy = await _add(legacy_pool, "b", protocol_version=2)
    with pytest.raises(UpdateRefusedError) as cannot:
        await legacy_sync.update(1, "/ckpt/1")
    assert cannot.value.code == "worker_cannot_update"
    assert "b" in cannot.value.message
    assert (new.sent, legacy.sent) == ([], [])
    assert (legacy_pool.version, legacy_pool.held) == (0, 0)


async def test_requests_started_during_an_update_wait_for_the_commit() -> None:
    """The pool is held while an update runs: a request that arrives meanwhile is not
    dispatched, is not refused even past ``wait_seconds``, and runs on the new version
    once it commits."""
    pool = WorkerPool(wait_seconds=0.05)
    sync = WeightSync(pool, phase_seconds=5)
    gate = asyncio.Event()
    _, link = await _add(pool, "a", gate=gate)
    update = asyncio.create_task(sync.update(1, "/ckpt/1"))
    await _until(lambda: bool(link.sent), "the update paused the worker")
    request = asyncio.create_task(pool.start("tiny", [1, 2], protocol.Sampling(max_tokens=4)))
    await asyncio.sleep(0.3)  # six times the wait bound
    assert not request.done()
    assert _generates(link) == []
    gate.set()
    await asyncio.wait_for(update, 5)
    call = await asyncio.wait_for(request, 5)
    assert link.phases() == ["Pause", "Load(1, /ckpt/1)", "Commit", "Generate"]
    assert call.segments == [(0, 1)]
    assert pool.stats.rejected_wait_timeout == 0


async def test_a_worker_that_leaves_mid_update_is_dropped_and_the_rest_commit() -> None:
    """A worker that disconnects during the load is no longer part of the update: the
    others commit the new version."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    a, link_a = await _add(pool, "a")
    _, link_b = await _add(pool, "b", leave_on=Phase.LOADED)
    report = await asyncio.wait_for(sync.update(1, "/ckpt/1"), 5)
    assert link_a.phases() == ["Pause", "Load(1, /ckpt/1)", "Commit"]
    assert link_b.phases() == ["Pause", "Load(1, /ckpt/1)"]
    assert list(pool.workers) == ["a"]
    assert (pool.version, a.version, a.state) == (1, 1, WorkerState.SERVING)
    assert [w["worker_id"] for w in report["workers"]] == ["a"]


async def test_a_worker_that_cannot_commit_is_taken_out_of_service() -> None:
    """A commit that fails leaves that worker's weights unknown: it is closed and removed
    rather than left serving under the new version; the others serve it, and the answer
    is a commit_failed error naming the worker, not a success."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    a, link_a = await _add(pool, "a")
    b, link_b = await _add(pool, "b", fail={Phase.COMMITTED: "engine crashed"})
    with pytest.raises(UpdateFailedError) as failed:
        await sync.update(1, "/ckpt/1")
    assert failed.value.code == "commit_failed"
    assert failed.value.workers == ("b",)
    assert "engine crashed" in failed.value.message
    assert pool.version == 1
    assert (a.version, a.state, link_a.closed) == (1, WorkerState.SERVING, False)
    assert b.state is WorkerState.OUT_OF_SERVICE
    assert b.version == 0
    assert link_b.closed
    assert list(pool.workers) == ["a"]
    assert (link_a.paused, link_b.paused) == (False, False)


async def test_a_commit_failing_on_every_worker_moves_no_version() -> None:
    """When no worker commits, nothing serves the new version: the pool keeps its version
    and checkpoint, the workers are out of service, and the answer names them all."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    crash = {Phase.COMMITTED: "engine crashed"}
    (a, link_a), (b, link_b) = await _add(pool, "a", fail=crash), await _add(pool, "b", fail=crash)
    with pytest.raises(UpdateFailedError) as failed:
        await sync.update(1, "/ckpt/1")
    assert (failed.value.code, failed.value.workers) == ("commit_failed", ("a", "b"))
    assert (pool.version, pool.weights_path) == (0, None)
    assert sync.report()["version"] == 0
    assert (a.state, b.state) == (WorkerState.OUT_OF_SERVICE, WorkerState.OUT_OF_SERVICE)
    assert (link_a.closed, link_b.closed) == (True, True)
    assert pool.workers == {}
    assert (pool.held, sync.current) == (0, None)


async def test_a_phase_without_an_answer_times_out_and_rolls_back() -> None:
    """A worker that does not answer within ``phase_seconds`` fails the update with
    ``update_timeout``; every worker is rolled back."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=0.2)
    a, link_a = await _add(pool, "a")
    b, link_b = await _add(pool, "b", silent=frozenset({Phase.LOADED}))
    with pytest.raises(UpdateFailedError) as failed:
        await asyncio.wait_for(sync.update(1, "/ckpt/1"), 5)
    assert failed.value.code == "update_timeout"
    for link in (link_a, link_b):
        assert link.phases() == ["Pause", "Load(1, /ckpt/1)", "Rollback"]
    assert (pool.version, a.version, b.version) == (0, 0, 0)
    assert b.acks == {}  # the unanswered wait was dropped


# --------------------------------------------------------------------------- joining


async def test_a_worker_joining_behind_is_caught_up_before_it_serves() -> None:
    """A worker that joins on an older version loads the pool's checkpoint (Pause, Load,
    Commit) before any request is dispatched to it."""
    pool = WorkerPool(wait_seconds=2)
    WeightSync(pool, phase_seconds=5)
    pool.version, pool.weights_path = 2, "/ckpt/2"
    gate = asyncio.Event()
    handle, link = await _add(pool, "late", gate=gate)
    assert handle.state is WorkerState.JOINING
    request = asyncio.create_task(pool.start("tiny", [1], protocol.Sampling(max_tokens=1)))
    await asyncio.sleep(0.05)
    assert not request.done()
    gate.set()
    call = await asyncio.wait_for(request, 5)
    assert link.phases() == ["Pause", "Load(2, /ckpt/2)", "Commit", "Generate"]
    assert (handle.version, handle.weights_path, handle.state) == (
        2,
        "/ckpt/2",
        WorkerState.SERVING,
    )
    assert call.segments == [(0, 2)]


async def test_a_worker_that_cannot_catch_up_is_taken_out_of_service() -> None:
    """A worker behind that cannot load the current checkpoint is rolled back, closed and
    removed: it never serves old weights."""
    pool = WorkerPool(wait_seconds=1)
    WeightSync(pool, phase_seconds=5)
    pool.version, pool.weights_path = 2, "/ckpt/2"
    handle, link = await _add(pool, "late", fail={Phase.LOADED: "unreadable"})
    await _until(lambda: "late" not in pool.workers, "the worker was removed")
    assert link.phases() == ["Pause", "Load(2, /ckpt/2)", "Rollback"]
    assert link.closed
    assert handle.state is WorkerState.OUT_OF_SERVICE


async def test_a_worker_joining_on_a_newer_version_brings_the_pool_to_it() -> None:
    """A worker updated through another replica joins with a newer version: the pool
    adopts it and catches up the workers it had."""
    pool = WorkerPool(wait_seconds=1)
    WeightSync(pool, phase_seconds=5)
    old, old_link = await _add(pool, "a")
    new, new_link = await _add(pool, "b", version=5, path="/ckpt/5")
    assert (pool.version, pool.weights_path) == (5, "/ckpt/5")
    assert new.state is WorkerState.SERVING
    await _until(lambda: old.version == 5, "the old worker caught up")
    assert old_link.phases() == ["Pause", "Load(5, /ckpt/5)", "Commit"]
    assert new_link.sent == []
    assert old.state is WorkerState.SERVING


async def test_a_weights_notice_updates_the_handle_and_the_pool() -> None:
    """A worker's Weights notice (an update committed through another replica) sets its
    handle's version and path, the pool adopts the version, and the other workers are
    brought up to it."""
    pool = WorkerPool(wait_seconds=1)
    WeightSync(pool, phase_seconds=5)
    a, _ = await _add(pool, "a")
    b, link_b = await _add(pool, "b")
    notice = a.endpoint.receive(protocol.encode(protocol.Weights(3, "/ckpt/3")))
    await pool.handle_message(a, notice)
    assert (a.version, a.weights_path) == (3, "/ckpt/3")
    assert (pool.version, pool.weights_path) == (3, "/ckpt/3")
    await _until(lambda: b.version == 3, "the other worker caught up")
    assert link_b.phases() == ["Pause", "Load(3, /ckpt/3)", "Commit"]


async def test_a_worker_joining_during_an_update_serves_only_after_loading_it() -> None:
    """A worker that joins on the old version while an update runs is not part of it and
    gets nothing to do until it has loaded the update's checkpoint too."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    gate = asyncio.Event()
    _, link_a = await _add(pool, "a", gate=gate)
    update = asyncio.create_task(sync.update(1, "/ckpt/1"))
    await _until(lambda: bool(link_a.sent), "the update paused the first worker")
    late, link_late = await _add(pool, "b")
    assert late.state is WorkerState.JOINING
    request = asyncio.create_task(pool.start("tiny", [1], protocol.Sampling(max_tokens=1)))
    await asyncio.sleep(0.05)
    assert (_generates(link_a), _generates(link_late)) == ([], [])
    gate.set()
    await asyncio.wait_for(update, 5)
    await _until(lambda: late.version == 1, "the late worker caught up")
    assert link_late.phases()[:3] == ["Pause", "Load(1, /ckpt/1)", "Commit"]
    call = await asyncio.wait_for(request, 5)
    assert call.segments == [(0, 1)]


async def test_a_worker_behind_a_stamped_version_is_not_stamped_on_old_weights() -> None:
    """After a stamp-only update, a worker joining behind is not given the last checkpoint
    under the stamped number (that checkpoint holds an older version): it serves nothing
    until it reports the stamped version itself (its trainer's own sync), then serves."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    await _add(pool, "a")
    await sync.update(1, "/ckpt/1")
    await sync.update(2)
    late, link = await _add(pool, "late", version=1, path="/ckpt/1")
    assert late.state is WorkerState.JOINING
    await asyncio.sleep(0.1)
    assert (link.phases(), late.version, late.state) == ([], 1, WorkerState.JOINING)
    notice = late.endpoint.receive(protocol.encode(protocol.Weights(2, "/ckpt/1")))
    await pool.handle_message(late, notice)
    await _until(lambda: late.state is WorkerState.SERVING, "the late worker serves")
    assert (link.phases(), late.version) == ([], 2)


@pytest.mark.parametrize("checkpoint", ["/ckpt/1", None])
async def test_a_worker_that_never_reaches_a_stamped_version_is_taken_out_of_service(
    checkpoint: str | None,
) -> None:
    """A worker behind a version stamped without a checkpoint (here, or adopted from
    workers that report none) that does not reach it within a phase is closed and
    removed, never stamped with a version its weights are not."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=0.2)
    await _add(pool, "a")
    if checkpoint is None:
        await _add(pool, "b", version=2)  # adopted: stamped elsewhere
    else:
        await sync.update(1, checkpoint)
        await sync.update(2)
    late, link = await _add(pool, "late")
    await _until(lambda: "late" not in pool.workers, "the late worker was removed")
    assert "Load" not in " ".join(link.phases())
    assert (late.version, late.state, link.closed) == (0, WorkerState.OUT_OF_SERVICE, True)


async def test_a_retry_of_a_committed_update_succeeds_after_a_restart_or_elsewhere() -> None:
    """An update that committed, retried on a proxy that did not run it (restarted, or
    another replica: its workers brought the version), answers as a success without
    asking any worker anything; another checkpoint under that version is still refused."""
    restarted = WorkerPool(wait_seconds=1)
    sync = WeightSync(restarted, phase_seconds=5)
    _, link = await _add(restarted, "a", version=3, path="/ckpt/3")
    report = await sync.update(3, "/ckpt/3")
    assert (report["version"], report["path"], link.sent) == (3, "/ckpt/3", [])

    replica = WorkerPool(wait_seconds=1)
    sync = WeightSync(replica, phase_seconds=5)
    a, link = await _add(replica, "a", version=2, path="/ckpt/2")
    notice = a.endpoint.receive(protocol.encode(protocol.Weights(3, "/ckpt/3")))
    await replica.handle_message(a, notice)
    assert (await sync.update(3, "/ckpt/3"))["version"] == 3
    with pytest.raises(UpdateRefusedError) as other:
        await sync.update(3, "/ckpt/other")
    assert other.value.code == "version_not_newer"
    assert link.sent == []


# --------------------------------------------------------------------------- ownership


async def _settled(sync: WeightSync) -> None:
    await _until(lambda: sync.current is None, "the update finished")


def _assert_nothing_paused(pool: WorkerPool, *links: WorkerLink) -> None:
    assert [link.paused for link in links] == [False] * len(links)
    assert [h.state for h in pool.workers.values()] == [WorkerState.SERVING] * len(pool.workers)
    assert pool.held == 0


@pytest.mark.parametrize("phase", [Phase.PAUSED, Phase.LOADED, Phase.COMMITTED])
async def test_a_caller_that_goes_away_does_not_stop_the_update(phase: Phase) -> None:
    """The update belongs to the proxy: cancelling the caller at any of its awaits (the
    client hung up) lets it run to its commit; no worker stays paused or updating, and
    the next request is served on the new version."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    gate = asyncio.Event()
    _, link_a = await _add(pool, "a", gate=gate, gate_on=phase)
    _, link_b = await _add(pool, "b")
    caller = asyncio.create_task(sync.update(1, "/ckpt/1"))
    sent = [Phase.PAUSED, Phase.LOADED, Phase.COMMITTED].index(phase) + 1
    await _until(lambda: len(link_b.sent) == sent, f"the update waits for {phase.value}")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    await _settled(sync)
    for link in (link_a, link_b):
        assert link.phases() == ["Pause", "Load(1, /ckpt/1)", "Commit"]
    _assert_nothing_paused(pool, link_a, link_b)
    assert pool.version == 1
    call = await asyncio.wait_for(pool.start("tiny", [1], protocol.Sampling(max_tokens=1)), 1)
    assert call.segments == [(0, 1)]
    assert await sync.update(1, "/ckpt/1") == sync.report()  # its outcome, kept


@pytest.mark.parametrize("phase", [Phase.PAUSED, Phase.LOADED])
async def test_closing_the_service_rolls_a_running_update_back(phase: Phase) -> None:
    """An update stopped before its commit (the proxy shuts down) rolls every worker back
    in its cleanup: none is left paused or updating and the version does not move."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    gate = asyncio.Event()
    _, link_a = await _add(pool, "a", gate=gate, gate_on=phase)
    _, link_b = await _add(pool, "b")
    caller = asyncio.create_task(sync.update(1, "/ckpt/1"))
    sent = 1 if phase is Phase.PAUSED else 2
    await _until(lambda: len(link_b.sent) == sent, f"the update waits for {phase.value}")
    gate.set()  # the rollback is answered
    await sync.close()
    with pytest.raises((asyncio.CancelledError, WeightsUpdateError)):
        await caller
    for link in (link_a, link_b):
        assert link.phases()[-1] == "Rollback"
        assert "Commit" not in link.phases()
    _assert_nothing_paused(pool, link_a, link_b)
    assert (pool.version, sync.current) == (0, None)


async def test_a_retry_of_the_same_update_gets_its_outcome() -> None:
    """A second request for the running update (same version and path) waits for it and
    gets its answer, a retry after it finished gets the same answer, and the workers see
    one update; a different update while it runs is refused as retryable."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    gate = asyncio.Event()
    _, link = await _add(pool, "a", gate=gate)
    first = asyncio.create_task(sync.update(1, "/ckpt/1"))
    await _until(lambda: bool(link.sent), "the update paused the worker")
    again = asyncio.create_task(sync.update(1, "/ckpt/1", protocol.PauseMode.ABORT))
    with pytest.raises(UpdateRefusedError) as other:
        await sync.update(2, "/ckpt/2")
    assert (other.value.code, other.value.retryable) == ("update_in_progress", True)
    await asyncio.sleep(0.01)
    assert not again.done()
    gate.set()
    report = await asyncio.wait_for(first, 5)
    assert await asyncio.wait_for(again, 5) == report
    assert await sync.update(1, "/ckpt/1") == report
    assert link.phases() == ["Pause", "Load(1, /ckpt/1)", "Commit"]
    assert report["version"] == 1


async def test_a_retry_of_a_failed_update_gets_the_same_error() -> None:
    """A retry of an update that failed for good (its checkpoint did not load) is answered
    with the same error, without asking the workers again."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    _, link = await _add(pool, "a", fail={Phase.LOADED: "no such directory"})
    with pytest.raises(UpdateFailedError) as first:
        await sync.update(1, "/missing")
    with pytest.raises(UpdateFailedError) as again:
        await sync.update(1, "/missing")
    assert (again.value.code, again.value.message) == (first.value.code, first.value.message)
    assert not again.value.retryable
    assert link.phases() == ["Pause", "Load(1, /missing)", "Rollback"]


async def test_a_worker_busy_with_another_replicas_update_is_retryable() -> None:
    """A worker paused by another replica's update refuses the pause: the update is rolled
    back with the retryable worker_busy, and asking again runs it (the outcome is not
    kept) once the worker is free."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    _, link_a = await _add(pool, "a")
    _, link_b = await _add(pool, "b", busy=True)
    with pytest.raises(UpdateFailedError) as failed:
        await sync.update(1, "/ckpt/1")
    assert (failed.value.code, failed.value.retryable) == ("worker_busy", True)
    assert failed.value.workers == ("b",)
    assert link_a.phases() == ["Pause", "Rollback"]
    _assert_nothing_paused(pool, link_a, link_b)
    link_b.busy = False
    report = await sync.update(1, "/ckpt/1")
    assert report["version"] == 1
    assert link_b.phases()[-2:] == ["Load(1, /ckpt/1)", "Commit"]


async def test_the_pool_version_never_moves_backwards() -> None:
    """A newer version adopted while an update runs (a worker updated through another
    replica joined) stays the pool's when the update commits its older version, and the
    update's workers are brought up to it."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    gate = asyncio.Event()
    a, link_a = await _add(pool, "a", gate=gate, gate_on=Phase.COMMITTED)
    update = asyncio.create_task(sync.update(1, "/ckpt/1"))
    await _until(lambda: len(link_a.sent) == 3, "the update commits")
    await _add(pool, "c", version=5, path="/ckpt/5")
    assert pool.version == 5
    gate.set()
    await asyncio.wait_for(update, 5)
    assert (pool.version, pool.weights_path) == (5, "/ckpt/5")
    await _until(lambda: a.version == 5, "the updated worker caught up")
    assert link_a.phases()[-3:] == ["Pause", "Load(5, /ckpt/5)", "Commit"]
    assert pool.version == 5


async def test_an_update_stopped_before_it_ran_releases_the_pool() -> None:
    """An update whose task is stopped before it ever ran (the proxy shuts down at once)
    still lets the pool go: requests are dispatched again and a new update may start."""
    pool = WorkerPool(wait_seconds=1)
    sync = WeightSync(pool, phase_seconds=5)
    _, link = await _add(pool, "a")
    caller = asyncio.create_task(sync.update(1, "/ckpt/1"))
    await asyncio.sleep(0)  # the caller started the update's task, which has not run
    assert sync.current is not None
    await sync.close()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert (sync.current, pool.held, link.sent) == (None, 0, [])
    assert (await sync.update(1, "/ckpt/1"))["version"] == 1
