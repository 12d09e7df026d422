"""Scoring through the worker's connection to a real proxy on loopback: the hello announces
a teacher (protocol 6), a ``Score`` reaches the engine's teacher forcing and its logprobs
come back in the request's ``Done``; a model not served as a teacher scores nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.appkeys import POOL
from proxy.config import ProxyConfig
from relay.exceptions import WorkerFailedError
from relay.scoring import score
from rollout_relay.embedded import RunningProxy, start_proxy
from worker_client.backends.hf import HFEngine
from worker_client.backends.instant import InstantEngine
from worker_client.client import ServedModel, WorkerClient
from worker_client.exceptions import EngineError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path, models: dict[str, ServedModel]) -> AsyncIterator[RunningProxy]:
    """A proxy with one worker client serving ``models`` joined to it."""
    running = await start_proxy(ProxyConfig(port=0, cache_dir=tmp_path / "cache"))
    client = WorkerClient(running.worker_url, models)
    task = asyncio.create_task(client.run())
    try:
        await asyncio.wait_for(client.connected.wait(), 30)
        await running.wait_for_workers()
        yield running
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await running.stop()


async def test_a_teacher_scores_what_its_engine_scores(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The hello marks the teacher; a score request gets the engine's own teacher forcing
    of the ids asked, in order."""
    engine = HFEngine.load(tiny_model_dir, name="teacher")
    ids = [5, 17, 230, 41, 9, 300, 12]
    expected = engine.score(ids[:3], ids[3:])
    models = {"teacher": ServedModel(engine, tiny_model_dir, teacher=True)}
    async with _serving(tmp_path, models) as running:
        pool = running.app[POOL]
        (handle,) = pool.workers.values()
        assert handle.models["teacher"].teacher
        logprobs = await asyncio.wait_for(score(pool, "teacher", ids, 3), 30)
    assert logprobs == pytest.approx(expected, abs=1e-6)


async def test_a_model_not_served_as_a_teacher_scores_nothing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A score request for a policy's model is refused by the worker; an engine that cannot
    score cannot be served as a teacher."""
    engine = HFEngine.load(tiny_model_dir, name="tiny")
    async with _serving(tmp_path, {"tiny": ServedModel(engine, tiny_model_dir)}) as running:
        with pytest.raises(WorkerFailedError, match="no teacher 'tiny'"):
            await asyncio.wait_for(score(running.app[POOL], "tiny", [1, 2, 3], 1), 30)
    instant = InstantEngine.load(tiny_model_dir, name="instant")
    with pytest.raises(EngineError, match="cannot serve a teacher"):
        ServedModel(instant, tiny_model_dir, teacher=True)
