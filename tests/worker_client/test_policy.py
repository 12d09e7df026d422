"""Pause/resume for weight sync: new requests wait, running ones finish or are aborted,
and every reply carries the version it was sampled with."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from relay.protocol import PREEMPTED, PauseMode
from worker_client.backends.instant import InstantEngine
from worker_client.engine import FinishReason, ImageSpan, SamplingParams, TokenChunk
from worker_client.exceptions import EngineError, WeightsError
from worker_client.policy import (
    POLICY_VERSION,
    PolicyState,
    UpdateState,
    VersionedEngine,
    WorkerPolicy,
)

SAMPLING = SamplingParams(max_tokens=64)


async def _reply(engine: VersionedEngine, rid: str) -> TokenChunk:
    chunks = [c async for c in engine.generate(rid, [1, 2, 3], SAMPLING)]
    return chunks[-1]


async def _started(engine: VersionedEngine, rid: str) -> asyncio.Task[TokenChunk]:
    """A request that has produced its first token (so it is in flight), finishing in a task."""
    stream = engine.generate(rid, [1, 2, 3], SAMPLING)
    first = await anext(stream)

    async def rest() -> TokenChunk:
        last = first
        async for chunk in stream:
            last = chunk
        return last

    return asyncio.create_task(rest())


def _engine(tiny_model_dir: Path, tokens_per_second: float = 0.0) -> VersionedEngine:
    inner = InstantEngine.load(tiny_model_dir, reply_tokens=40, tokens_per_second=tokens_per_second)
    return VersionedEngine(inner, version=1)


async def test_requests_wait_while_paused_and_run_on_the_new_version(
    tiny_model_dir: Path,
) -> None:
    """A request made while paused starts only after resume, on the new version."""
    engine = _engine(tiny_model_dir)
    assert (await _reply(engine, "a")).extra[POLICY_VERSION] == 1
    await engine.pause()
    assert engine.state is PolicyState.PAUSED
    waiting = asyncio.create_task(_reply(engine, "b"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()
    assert engine.in_flight == 0
    assert await engine.resume() == 2
    last = await waiting
    assert last.extra[POLICY_VERSION] == 2
    assert last.finish_reason is FinishReason.STOP


async def test_pause_lets_running_requests_finish_or_aborts_them(tiny_model_dir: Path) -> None:
    """pause() returns once nothing runs: in-flight replies complete, or end with abort."""
    engine = _engine(tiny_model_dir, tokens_per_second=200.0)
    running = await _started(engine, "r1")
    await engine.pause()
    assert running.done()
    assert running.result().finish_reason is FinishReason.STOP
    await engine.resume(5)
    running = await _started(engine, "r2")
    await engine.pause(abort_in_flight=True)
    assert running.result().finish_reason is FinishReason.ABORT
    assert running.result().extra[POLICY_VERSION] == 5


# ---------------------------------------------------------------------------- WorkerPolicy


def _policy(tiny_model_dir: Path, *, path: str | None = None) -> WorkerPolicy:
    return WorkerPolicy([_engine(tiny_model_dir, tokens_per_second=200.0)], path=path)


async def test_a_checkpoint_the_engine_cannot_load_is_refused_and_rolled_back(
    tiny_model_dir: Path,
) -> None:
    """Loading a path on an engine without weight loading raises WeightsError and leaves
    the update paused; rolling back serves the old version again, and the all-in-one
    update does the same by itself."""
    policy = _policy(tiny_model_dir)
    await policy.pause("u1", PauseMode.WAIT)
    with pytest.raises(WeightsError, match="cannot load weights"):
        await policy.load("u1", 2, "/ckpt/2")
    assert (policy.state, policy.engines[0].state) == (UpdateState.PAUSED, PolicyState.PAUSED)
    await policy.rollback("u1")
    assert (policy.state, policy.update_id, policy.version) == (UpdateState.IDLE, None, 1)
    assert policy.engines[0].state == PolicyState.SERVING
    assert (await _reply(policy.engines[0], "after")).extra[POLICY_VERSION] == 1
    with pytest.raises(WeightsError):
        await policy.update(2, "/ckpt/2")
    assert (policy.state, policy.version) == (UpdateState.IDLE, 1)
    assert policy.engines[0].state is PolicyState.SERVING


async def test_a_stamp_only_update_moves_the_version_and_names_no_checkpoint(
    tiny_model_dir: Path,
) -> None:
    """Without a path nothing is loaded: the version moves, replies carry it, and no
    checkpoint is named for it (the hello and the notices report none), so a proxy that
    hears of it never loads the old checkpoint under the new number."""
    policy = _policy(tiny_model_dir, path="/ckpt/1")
    await policy.pause("u1", PauseMode.WAIT)
    await policy.load("u1", 2, None)
    assert policy.state is UpdateState.LOADED
    assert await policy.commit("u1") == 2
    assert (policy.version, policy.path, policy.state) == (2, None, UpdateState.IDLE)
    assert (await _reply(policy.engines[0], "r")).extra[POLICY_VERSION] == 2
    assert await policy.update(3) == 3
    assert (policy.version, policy.path) == (3, None)


async def test_one_update_at_a_time_and_its_phases_in_order(tiny_model_dir: Path) -> None:
    """A second pause while an update runs is refused; phases of another update, a commit
    before the load, and a version that is not newer are refused without ending the
    running update."""
    policy = _policy(tiny_model_dir)
    await policy.pause("u1", PauseMode.WAIT)
    with pytest.raises(WeightsError, match="in progress"):
        await policy.pause("u2", PauseMode.WAIT)
    with pytest.raises(WeightsError):
        await policy.load("u2", 2, None)
    with pytest.raises(WeightsError):
        await policy.commit("u1")
    with pytest.raises(WeightsError, match="not newer"):
        await policy.load("u1", 1, None)
    await policy.rollback("u2")  # not the running update: nothing happens
    assert (policy.state, policy.update_id) == (UpdateState.PAUSED, "u1")
    await policy.load("u1", 2, None)
    assert await policy.commit("u1") == 2
    await policy.rollback("u1")  # already committed: idempotent, nothing changes
    assert (policy.version, policy.state) == (2, UpdateState.IDLE)


async def test_listeners_hear_committed_versions_only(tiny_model_dir: Path) -> None:
    """A listener is told each committed version with its checkpoint; rolled back or
    failed updates are not announced, and a stopped listener hears nothing more."""
    policy = _policy(tiny_model_dir, path="/ckpt/1")
    heard: list[tuple[int, str | None]] = []
    stop = policy.listen(lambda version, path: heard.append((version, path)))
    await policy.update(2)
    await policy.pause("u3", PauseMode.WAIT)
    await policy.load("u3", 3, None)
    await policy.rollback("u3")
    with pytest.raises(WeightsError):
        await policy.update(3, "/ckpt/3")
    assert heard == [(2, None)]
    stop()
    await policy.update(4)
    assert heard == [(2, None)]
    assert policy.version == 4


async def test_an_abort_mode_pause_marks_its_replies_preempted(tiny_model_dir: Path) -> None:
    """Replies an abort-mode pause stops end with abort and extra preempted=1 (the proxy
    continues them); a wait-mode pause lets them finish unmarked, and a request aborted
    for another reason is not marked."""
    policy = _policy(tiny_model_dir)
    engine = policy.engines[0]
    running = await _started(engine, "r1")
    await policy.pause("u1", PauseMode.ABORT)
    last = running.result()
    assert last.finish_reason is FinishReason.ABORT
    assert last.extra[PREEMPTED] == 1
    assert last.extra[POLICY_VERSION] == 1
    await policy.rollback("u1")

    running = await _started(engine, "r2")
    await policy.pause("u2", PauseMode.WAIT)
    assert running.result().finish_reason is FinishReason.STOP
    assert PREEMPTED not in running.result().extra
    await policy.rollback("u2")

    running = await _started(engine, "r3")
    await engine.abort("r3")
    last = await asyncio.wait_for(running, 5)
    assert last.finish_reason is FinishReason.ABORT
    assert PREEMPTED not in last.extra


async def test_a_rollback_while_requests_drain_ends_the_pause(tiny_model_dir: Path) -> None:
    """An update rolled back before its pause finished draining (the proxy stopped
    waiting) leaves the engine serving, not paused for nobody: the pause reports it, and
    new requests run on the old version."""
    policy = _policy(tiny_model_dir)
    engine = policy.engines[0]
    running = await _started(engine, "r1")
    pausing = asyncio.create_task(policy.pause("u1", PauseMode.WAIT))
    await asyncio.sleep(0.01)
    assert engine.state == PolicyState.PAUSING
    await policy.rollback("u1")
    assert (await asyncio.wait_for(running, 5)).finish_reason is FinishReason.STOP
    with pytest.raises(WeightsError, match="rolled back"):
        await asyncio.wait_for(pausing, 5)
    assert (policy.state, engine.state) == (UpdateState.IDLE, PolicyState.SERVING)
    last = await asyncio.wait_for(_reply(engine, "after"), 5)
    assert last.extra[POLICY_VERSION] == 1


async def test_closing_a_reply_closes_the_engines_at_once(tiny_model_dir: Path) -> None:
    """A consumer that stops reading and closes the stream finishes the engine's request
    now (it may hold a slot or a lock), not when the garbage collector gets to it."""
    engine = _engine(tiny_model_dir, tokens_per_second=200.0)
    inner = engine.engine
    assert isinstance(inner, InstantEngine)
    stream = engine.generate("r1", [1, 2, 3], SAMPLING)
    await anext(stream)
    assert inner._running == {"r1"}
    await stream.aclose()
    assert inner._running == set()
    assert engine.in_flight == 0


async def test_a_commit_the_engine_cannot_do_resumes_it_and_reports_failure(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose weight swap raises (a device error while the parameters change) is
    never left paused: the update fails with WeightsError, the engine serves again on its
    old version, the update is over, and no listener hears of the version."""
    from worker_client.backends.hf import HFEngine
    from worker_client.checkpoints import perturbed_checkpoint

    hf = HFEngine.load(tiny_model_dir, name="tiny")
    checkpoint = perturbed_checkpoint(tiny_model_dir, tmp_path / "step-2", seed=2)

    def device_error(tensors: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(hf, "_apply_checkpoint", device_error)
    engine = VersionedEngine(hf, version=1)
    policy = WorkerPolicy([engine])
    heard: list[tuple[int, str | None]] = []
    policy.listen(lambda version, path: heard.append((version, path)))
    await policy.pause("u1", PauseMode.WAIT)
    await policy.load("u1", 2, str(checkpoint))
    with pytest.raises(WeightsError, match=r"did not commit.*illegal memory access"):
        await policy.commit("u1")
    assert (engine.state, engine.version) == (PolicyState.SERVING, 1)
    assert (policy.state, policy.update_id, policy.version) == (UpdateState.IDLE, None, 1)
    assert heard == []
    sampling = SamplingParams(max_tokens=2)
    chunks = [c async for c in engine.generate("after", [1, 2, 3], sampling)]
    assert chunks[-1].extra[POLICY_VERSION] == 1
    await policy.update(3)  # the next update is not refused as "in progress"
    assert policy.version == 3


async def test_a_second_update_is_refused_as_busy(tiny_model_dir: Path) -> None:
    """A pause while another update holds the worker raises WeightsBusyError (the proxy
    answers a busy worker as retryable), and changes nothing of the running update."""
    from worker_client.exceptions import WeightsBusyError

    policy = _policy(tiny_model_dir)
    await policy.pause("u1", PauseMode.WAIT)
    with pytest.raises(WeightsBusyError):
        await policy.pause("u2", PauseMode.WAIT)
    assert (policy.state, policy.update_id) == (UpdateState.PAUSED, "u1")
    await policy.rollback("u1")


class _Scorer(InstantEngine):
    """The instant engine with a teacher's forcing: -1.0 for every id scored."""

    async def prompt_logprobs(
        self, request_id: str, ids: Sequence[int], start: int, images: Sequence[ImageSpan] = ()
    ) -> list[float]:
        return [-1.0] * (len(ids) - start)


async def test_scoring_waits_out_a_pause_and_needs_an_engine_that_scores(
    tiny_model_dir: Path,
) -> None:
    """A score asked while paused runs once the engine serves again; an engine that cannot
    score refuses it."""
    engine = VersionedEngine(_Scorer.load(tiny_model_dir), version=1)
    await engine.pause()
    waiting = asyncio.create_task(engine.prompt_logprobs("s1", [1, 2, 3], 1))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()
    await engine.resume()
    assert await waiting == [-1.0, -1.0]
    assert engine.in_flight == 0
    with pytest.raises(EngineError, match="cannot score"):
        await _engine(tiny_model_dir).prompt_logprobs("s2", [1, 2, 3], 1)
