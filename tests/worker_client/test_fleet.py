"""One worker process serving two proxies: one admission limit per engine, however many
connections bring it requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from proxy.appkeys import POOL
from proxy.config import ProxyConfig
from relay import protocol
from rollout_relay.embedded import start_proxy
from tests.e2e.conftest import TIMEOUT_FACTOR
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel
from worker_client.engine import SamplingParams, TokenChunk
from worker_client.fleet import WorkerFleet


class Counting:
    """The real engine, with a count of the generations running at once."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.card = engine.card
        self.running = 0
        self.most = 0

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenChunk, None]:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            async for chunk in self.engine.generate(request_id, prompt_ids, sampling):
                await asyncio.sleep(0.02)  # long enough for the other proxy's request to try
                yield chunk
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def close(self) -> None:
        await self.engine.close()


async def test_two_proxies_share_one_admission_limit(tiny_model_dir: Path, tmp_path: Path) -> None:
    proxies = [
        await start_proxy(ProxyConfig(port=0, cache_dir=tmp_path / str(i))) for i in range(2)
    ]
    engine = Counting(HFEngine.load(tiny_model_dir, name="tiny"))
    fleet = WorkerFleet(
        [p.worker_url for p in proxies],
        {"tiny": ServedModel(engine, tiny_model_dir)},  # type: ignore[arg-type]
        worker_id="shared",
        max_concurrency=1,
    )
    task = asyncio.get_running_loop().create_task(fleet.run())
    try:
        for running in proxies:
            await running.wait_for_workers(1, within_seconds=60 * TIMEOUT_FACTOR)
            # Each proxy sees the whole engine's limit...
            assert running.app[POOL].workers["shared"].max_concurrency == 1

        async def one(running: Any, seed: int) -> int:
            call = await running.app[POOL].start(
                "tiny", [1, 2, 3], protocol.Sampling(max_tokens=6, seed=seed, stop_token_ids=[])
            )
            count = 0
            async for event in call.events():
                count += len(getattr(event, "token_ids", ()) or ())
            return count

        # ...and the engine runs one request at a time, from either of them.
        results = await asyncio.gather(*(one(p, seed) for seed in range(3) for p in proxies))
        assert len(results) == 6
        assert all(count > 0 for count in results)
        assert engine.most == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for running in proxies:
            await running.stop()
