"""``--stream-interval``: a proxy that streams in groups of tokens, on the real proxy, hf
worker and OpenAI client. Fewer events, the same text and the same recorded ids."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from proxy.config import ProxyConfig
from proxy.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR, first_seed

INTERVAL = 4


@pytest.fixture
async def grouped(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=64,
        stream_interval=INTERVAL,
        cache_dir=tmp_path / "cache",
    )
    running = await start_proxy(config)
    start_hf_worker(running, tiny_model_dir, worker_id="grouped-hf")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


async def test_grouped_stream_has_fewer_events_and_the_same_tokens(
    grouped: RunningProxy,
) -> None:
    async with ProxyClient(grouped.url) as proxy:
        trial = await proxy.create_session()
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:

            async def attempt(seed: int) -> tuple[Any, list[str]] | None:
                kwargs: dict[str, Any] = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"a long story {seed}"}],
                    "max_tokens": 40,
                    "seed": seed,
                }
                whole = await client.chat.completions.create(**kwargs)
                if whole.usage is None or whole.usage.completion_tokens < 16:
                    return None
                stream = await client.chat.completions.create(stream=True, **kwargs)
                pieces = [
                    c.choices[0].delta.content
                    async for c in stream
                    if c.choices and c.choices[0].delta.content
                ]
                return whole, pieces

            whole, pieces = await first_seed(attempt)
        export = await proxy.trajectories(trial.trial_id)
    sampled = whole.usage.completion_tokens
    assert "".join(pieces) == whole.choices[0].message.content
    # The first token at once, then groups of at least INTERVAL, and the rest at the end
    # (a character split over a group's edge can add one more piece).
    assert 1 < len(pieces) <= 3 + (sampled - 1) // INTERVAL, (len(pieces), sampled)
    whole_ids, streamed_ids = (t["response_ids"] for t in export["trajectories"][-2:])
    assert whole_ids == streamed_ids
