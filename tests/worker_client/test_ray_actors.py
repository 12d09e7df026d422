"""Ray worker actors on a local CPU cluster: an hf worker actor dials the proxy, serves a
turn, pauses/resumes for a weight update with the new version recorded per turn, and loads
a checkpoint all or nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.ray_cluster import ray_cluster, start_tiny_group

__all__ = ["ray_cluster"]


@pytest.fixture
async def bare_proxy(tmp_path: Path) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0, worker_wait_seconds=120 * TIMEOUT_FACTOR, max_tokens=8, cache_dir=tmp_path
    )
    running = await start_proxy(config)
    yield running
    await running.stop()


async def _turn(proxy: ProxyClient, trial_id: str, base_url: str, api_key: str) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    export = await proxy.trajectories(trial_id)
    turns: list[dict[str, Any]] = [t for tr in export["trajectories"] for t in tr["turns"]]
    return turns[-1]


async def test_worker_actor_serves_and_records_policy_versions(
    ray_cluster: Any, bare_proxy: RunningProxy, tiny_model_dir: Path
) -> None:
    """One actor serves turns; a paused group holds new turns until resumed on version 7."""
    group = await start_tiny_group(bare_proxy.worker_url, tiny_model_dir)
    try:
        await bare_proxy.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        (status,) = await group.status()
        assert status["connected"] is True
        assert status["worker_id"] == group.worker_ids[0]
        async with ProxyClient(bare_proxy.url) as proxy:
            trial = await proxy.create_session()
            turn = await _turn(proxy, trial.trial_id, trial.base_url, trial.api_key)
            assert turn["worker_id"] == group.worker_ids[0]
            assert turn["extra"]["policy_version"] == 0

            await group.pause()
            (status,) = await group.status()
            assert status["state"] == "paused"
            waiting = asyncio.create_task(
                _turn(proxy, trial.trial_id, trial.base_url, trial.api_key)
            )
            await asyncio.sleep(1.0)
            assert not waiting.done()  # held while the weights are being updated
            await group.resume(7)
            turn = await asyncio.wait_for(waiting, 120 * TIMEOUT_FACTOR)
            assert turn["extra"]["policy_version"] == 7
            (status,) = await group.status()
            assert status["version"] == 7
            assert status["state"] == "serving"
            await proxy.delete(trial.trial_id)
    finally:
        await group.stop()


async def test_worker_group_loads_a_checkpoint_all_or_nothing(
    ray_cluster: Any, bare_proxy: RunningProxy, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """update_weights loads the checkpoint in every actor (the next turn scores as it, and
    the proxy hears of the version); a path that does not load raises WeightsError and
    the actors keep serving the version before."""
    from sdk.fidelity import check_fidelity
    from tests.e2e.test_weights import write_checkpoint
    from worker_client.backends.hf import HFEngine
    from worker_client.exceptions import WeightsError

    checkpoint = write_checkpoint(tiny_model_dir, tmp_path / "step-3", seed=3)
    group = await start_tiny_group(bare_proxy.worker_url, tiny_model_dir)
    try:
        await bare_proxy.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        assert await group.update_weights(3, str(checkpoint)) == 3
        with pytest.raises(WeightsError, match="did not load"):
            await group.update_weights(4, str(tmp_path / "missing"))
        assert (await group.weights())["version"] == 3
        async with ProxyClient(bare_proxy.url) as proxy:
            assert (await proxy.weights())["version"] == 3
            trial = await proxy.create_session(sampling={"temperature": 1.0})
            turn = await _turn(proxy, trial.trial_id, trial.base_url, trial.api_key)
            assert turn["versions"][0][0] == 3
            export = await proxy.trajectories(trial.trial_id)
        assert check_fidelity(export, HFEngine.load(checkpoint).score).max_abs_error <= 1e-4
    finally:
        await group.stop()


async def test_an_actor_that_cannot_pause_leaves_no_other_actor_paused(
    ray_cluster: Any, bare_proxy: RunningProxy, tiny_model_dir: Path
) -> None:
    """An update of the group while one actor is held by another update fails with
    WeightsError naming that actor; the other actor is not left paused but serves on its
    version, and the other update's pause is left to it."""
    from worker_client.exceptions import WeightsError
    from worker_client.ray_actors import WorkerActorGroup, _get

    group = await WorkerActorGroup.start(
        bare_proxy.worker_url,
        backend="instant",
        model=str(tiny_model_dir),
        num_workers=2,
        gpus_per_worker=0,
        cpus_per_worker=0.5,
        engine_options={"name": "tiny", "reply_tokens": 4},
        within_seconds=120 * TIMEOUT_FACTOR,
    )
    try:
        held = group.actors[1]
        await _get(ray_cluster, held.pause.remote())  # another update holds this actor
        with pytest.raises(WeightsError, match=f"{group.worker_ids[1]} could not pause"):
            await group.update_weights(1)
        free, busy = await group.status()
        assert (free["state"], free["version"]) == ("serving", 0)
        assert (busy["state"], busy["version"]) == ("paused", 0)
        await _get(ray_cluster, held.rollback.remote())
        assert await group.update_weights(1) == 1
        assert [s["version"] for s in await group.status()] == [1, 1]
        # The proxy hears of version 1 from each actor (and checks the other caught up).
        async with ProxyClient(bare_proxy.url) as proxy:
            for _ in range(int(200 * TIMEOUT_FACTOR)):
                report = await proxy.weights()
                workers = [(w["version"], w["state"]) for w in report["workers"]]
                if workers == [(1, "serving")] * 2:
                    break
                await asyncio.sleep(0.05)
            assert (report["version"], workers) == (1, [(1, "serving")] * 2)
        assert [s["state"] for s in await group.status()] == ["serving"] * 2
    finally:
        await group.stop()
