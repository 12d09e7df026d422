"""``--stream-interval``: a proxy that streams in groups of tokens, on the real proxy, worker
and OpenAI client (the worker's engine scripted to stream a long reply one token per step,
scored by the tiny model). Fewer events, the same text and the same recorded ids."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.scripted_worker import LONG_STORY, PacedScriptedEngine, serve_scripted

INTERVAL = 4


@pytest.fixture
async def grouped(
    tiny_model_dir: Path, tmp_path: Path
) -> AsyncIterator[tuple[RunningProxy, PacedScriptedEngine]]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=64,
        stream_interval=INTERVAL,
        cache_dir=tmp_path / "cache",
    )
    running = await start_proxy(config)
    engine = serve_scripted(running, tiny_model_dir, worker_id="grouped-scripted")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running, engine
    await running.stop()


async def test_grouped_stream_has_fewer_events_and_the_same_tokens(
    grouped: tuple[RunningProxy, PacedScriptedEngine],
) -> None:
    """Streamed in groups of INTERVAL tokens: the same text and ids as the whole reply,
    in about a quarter of the events."""
    running, engine = grouped
    engine.script(LONG_STORY, LONG_STORY)  # cut at max_tokens: 40 tokens each
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session()
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
            kwargs: dict[str, Any] = {
                "model": "m",
                "messages": [{"role": "user", "content": "a long story"}],
                "max_tokens": 40,
                "seed": 1,
            }
            whole = await client.chat.completions.create(**kwargs)
            assert whole.usage is not None
            assert whole.usage.completion_tokens >= 16
            stream = await client.chat.completions.create(stream=True, **kwargs)
            pieces = [
                c.choices[0].delta.content
                async for c in stream
                if c.choices and c.choices[0].delta.content
            ]
        export = await proxy.trajectories(trial.trial_id)
    sampled = whole.usage.completion_tokens
    assert "".join(pieces) == whole.choices[0].message.content
    # The first token at once, then groups of at least INTERVAL, and the rest at the end
    # (a character split over a group's edge can add one more piece).
    assert 1 < len(pieces) <= 3 + (sampled - 1) // INTERVAL, (len(pieces), sampled)
    whole_ids, streamed_ids = (t["response_ids"] for t in export["trajectories"][-2:])
    assert whole_ids == streamed_ids
