"""Adaptive stream coalescing on the real proxy, a real worker process and the official
OpenAI client: while the proxy's event loop is kept busy (a callback that spins on the CPU
most of the time), a stream's tokens arrive in fewer, larger events; with the loop idle,
every engine step is its own event; either way the text and the recorded ids are those of
the stream that went step by step. The worker runs in its own process
(``tests.scripted_worker``, a token every 10 ms), so its pace does not depend on the
proxy's loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from proxy.appkeys import POOL, SERVICE
from proxy.config import ProxyConfig
from proxy.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR, wait_until_joined

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOKENS = 64  # LONG_STORY cut here: 64 steps of one token


@pytest.fixture
async def paced(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=30 * TIMEOUT_FACTOR,
        max_tokens=TOKENS,
        cache_dir=tmp_path / "cache",
    )
    running = await start_proxy(config)
    command = ["-m", "tests.scripted_worker", "--proxy", running.worker_url, "--delay", "0.01"]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        "--model",
        str(tiny_model_dir),
        "--worker-id",
        "paced",
        cwd=REPO,
        env=os.environ | {"RELAY_WORKER_TOKEN": ""},
    )
    try:
        await wait_until_joined(running, process, "paced")
        yield running
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await running.stop()


@contextlib.contextmanager
def busy_loop(busy_s: float = 0.03) -> Iterator[None]:
    """A callback that spins for ``busy_s`` in every turn of the event loop (as a proxy
    whose CPU is used up runs behind): everything else still runs, between two spins."""
    loop = asyncio.get_running_loop()
    handle: asyncio.Handle | None = None

    def hog() -> None:
        nonlocal handle
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        handle = loop.call_soon(hog)

    handle = loop.call_soon(hog)
    try:
        yield
    finally:
        handle.cancel()


async def _stream(client: AsyncOpenAI) -> tuple[list[str], int]:
    """The content pieces of a streamed reply (one per SSE event) and its token count."""
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "a long story"}],
        max_tokens=TOKENS,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        pieces += [c.delta.content for c in chunk.choices if c.delta.content]
    return pieces, tokens


async def test_a_busy_loop_sends_fewer_larger_events_with_the_same_tokens(
    paced: RunningProxy,
) -> None:
    """Idle: an event per engine step. Busy: far fewer events (and without coalescing,
    busy as well, again one per step), the same text; every turn records the same ids."""
    async with ProxyClient(paced.url) as proxy:
        trial = await proxy.create_session()
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
            idle, tokens = await asyncio.wait_for(_stream(client), 60 * TIMEOUT_FACTOR)
            with busy_loop():
                await asyncio.sleep(0.3)  # the proxy's gauge sees a busy loop from the start
                busy, busy_tokens = await asyncio.wait_for(_stream(client), 60 * TIMEOUT_FACTOR)
                service, pool = paced.app[SERVICE], paced.app[POOL]
                coalescer = service.coalescer
                assert coalescer is not None
                service.coalescer, pool.after_frame = None, None  # --stream-coalesce off
                try:
                    stepwise, _ = await asyncio.wait_for(_stream(client), 60 * TIMEOUT_FACTOR)
                finally:
                    service.coalescer, pool.after_frame = coalescer, coalescer.frame_handled
        export: dict[str, Any] = await proxy.trajectories(trial.trial_id)
    assert tokens == busy_tokens == TOKENS
    assert "".join(busy) == "".join(idle) == "".join(stepwise)
    assert len(idle) >= tokens - 1, len(idle)  # every step (the last comes with the end)
    assert len(stepwise) >= tokens * 0.8, len(stepwise)
    assert len(busy) <= tokens // 2, len(busy)
    print(f"events: idle {len(idle)}, busy {len(busy)}, busy without coalescing {len(stepwise)}")
    assert coalescer.stats.holds > 0
    trajectories = export["trajectories"]
    assert [len(t["turns"]) for t in trajectories] == [1, 1, 1]  # three branches of one turn
    assert all(not t["turns"][0]["truncated"] for t in trajectories)
    idle_ids, busy_ids, stepwise_ids = (t["response_ids"] for t in trajectories)
    assert len(idle_ids) == TOKENS
    assert idle_ids == busy_ids == stepwise_ids
    assert [t["response_logprobs"] for t in trajectories[1:]] == [
        trajectories[0]["response_logprobs"]
    ] * 2
