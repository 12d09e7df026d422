"""Graceful shutdown: draining refuses new work in each API's format and turns /readyz
to 503, running turns finish (or, past the bound, are recorded truncated), and SIGTERM
makes the ``rollout-relay proxy`` process exit cleanly with JSON log lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI

from proxy.appkeys import SESSIONS
from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.scripted_worker import LONG_STORY, serve_scripted

pytestmark = pytest.mark.e2e


@pytest.fixture
async def own_stack(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    """A proxy and worker of its own: draining ends them. The worker's engine is scripted
    to keep talking (``LONG_STORY``, a token every 10 ms: a turn of 120 tokens runs for
    over a second), so that a turn is still running when the drain begins."""
    config = ProxyConfig(
        port=0, worker_wait_seconds=10 * TIMEOUT_FACTOR, max_tokens=200, cache_dir=tmp_path
    )
    running = await start_proxy(config)
    engine = serve_scripted(running, tiny_model_dir, worker_id="drain-scripted")
    engine.policy = lambda prompt: LONG_STORY
    engine.delay = 0.01
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


async def test_drain_finishes_running_turns_and_refuses_new_ones(own_stack: RunningProxy) -> None:
    """While draining, /readyz is 503, a new turn gets 503 shutting_down with Retry-After
    (OpenAI and Anthropic shapes), the session API still answers, and the stream that was
    running completes and is recorded."""
    async with ProxyClient(own_stack.url) as proxy:
        trial = await proxy.create_session()
    async with (
        AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as client,
        aiohttp.ClientSession() as http,
    ):
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "tell"}],
            max_tokens=120,
            seed=1,
            stream=True,
        )
        chunks = aiter(stream)
        await anext(chunks)  # the stream is open and the turn is running
        draining = asyncio.create_task(own_stack.shutdown(60 * TIMEOUT_FACTOR))
        await asyncio.sleep(0)
        auth = {"Authorization": f"Bearer {trial.api_key}", "x-api-key": trial.api_key}
        async with http.get(f"{own_stack.url}/readyz") as ready:
            assert ready.status == 503
            assert (await ready.json())["status"] == "draining"
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        async with http.post(f"{trial.base_url}/chat/completions", json=body, headers=auth) as r:
            assert r.status == 503
            assert int(r.headers["Retry-After"]) > 0
            assert (await r.json())["error"]["code"] == "shutting_down"
        async with http.post(f"{trial.base_url}/messages", json=body, headers=auth) as r:
            assert r.status == 503
            assert (await r.json())["error"]["type"] == "overloaded_error"
        finish = None
        async for chunk in chunks:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        assert finish in {"stop", "length"}
        assert await draining is True
    session = own_stack.app[SESSIONS].get(trial.trial_id)
    (turn,) = session.nodes
    assert turn.meta.truncated is False
    assert turn.meta.finish_reason in {"stop", "length"}


async def test_drain_bound_cancels_and_records_truncated(own_stack: RunningProxy) -> None:
    """A turn still running when the drain bound passes is cancelled, and what was sampled
    so far is recorded as a truncated turn."""
    async with ProxyClient(own_stack.url) as proxy:
        trial = await proxy.create_session()
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as c:
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "tell"}],
            max_tokens=200,
            seed=1,
            stream=True,
        )
        chunks = aiter(stream)
        await anext(chunks)
        assert await own_stack.shutdown(0.0) is False
        with contextlib.suppress(Exception):  # the connection is cut, however it surfaces
            async for _ in chunks:
                pass
    session = own_stack.app[SESSIONS].get(trial.trial_id)
    (last,) = session.nodes
    assert last.meta.truncated is True
    assert last.meta.finish_reason == "abort"
    assert len(last.completion_ids) < 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_sigterm_drains_and_exits(tmp_path: Path) -> None:
    """SIGTERM makes the proxy process exit with status 0 within its bound; its log lines
    are JSON and say it drained."""
    port = _free_port()
    env = os.environ | {"RELAY_WORKER_TOKEN": "w-token", "RELAY_ADMIN_TOKEN": "a-token"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rollout_relay.cli",
        "--log-format",
        "json",
        "proxy",
        "--port",
        str(port),
        "--cache-dir",
        str(tmp_path),
        "--drain-seconds",
        "5",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(int(300 * TIMEOUT_FACTOR)):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert process.returncode is None, "the proxy exited before serving"
                await asyncio.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30 * TIMEOUT_FACTOR):
            _, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, stderr.decode(errors="replace")
    records = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    assert any(r["message"] == "drained" for r in records), stderr
    for record in records:
        assert {"time", "level", "logger", "message", "trial_id", "request_id"} <= set(record)
