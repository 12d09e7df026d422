"""Pause/resume for weight sync: new requests wait, running ones finish or are aborted,
and every reply carries the version it was sampled with."""

from __future__ import annotations

import asyncio
from pathlib import Path

from worker_client.backends.instant import InstantEngine
from worker_client.engine import FinishReason, SamplingParams, TokenChunk
from worker_client.policy import POLICY_VERSION, PolicyState, VersionedEngine

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
