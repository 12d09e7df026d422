"""A real proxy with a real ``hf`` worker on the tiny model, on loopback, in the test loop; and
one whose worker serves a scripted engine, for tests that need a reply of a given shape."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.appkeys import POOL
from proxy.coalesce import CoalesceMode
from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient
from tests.scripted_worker import PacedScriptedEngine, serve_scripted

# Scale every wait in the suite on slow machines: RELAY_TEST_TIMEOUT_FACTOR=3 pytest ...
TIMEOUT_FACTOR = float(os.environ.get("RELAY_TEST_TIMEOUT_FACTOR", "1"))

# The shared stacks' tests pin what each engine step sends, and their worker samples in
# the proxy's own thread, which can keep its event loop busy enough to coalesce streams
# (tests/e2e/test_stream_coalesce.py is where coalescing is tested): every step goes out.
IN_PROCESS_STREAMS = CoalesceMode.OFF


def worker_command(proxy_url: str, model: str | Path, *options: str) -> list[str]:
    """``rollout-relay worker`` as a separate process (the real CLI)."""
    cli = [sys.executable, "-m", "rollout_relay.cli", "--log-level", "WARNING", "worker"]
    return [*cli, "--proxy", proxy_url, "--model", str(model), *options]


async def wait_until_joined(
    running: RunningProxy, process: asyncio.subprocess.Process, worker_id: str | None = None
) -> None:
    """Until the worker process has joined the proxy's pool (any worker when no id)."""
    pool = running.app[POOL]
    deadline = asyncio.get_running_loop().time() + 120 * TIMEOUT_FACTOR
    while not (worker_id in pool.workers if worker_id else pool.workers):
        assert process.returncode is None, "the worker process exited"
        assert asyncio.get_running_loop().time() < deadline, "the worker did not join"
        await asyncio.sleep(0.2)


@pytest.fixture(scope="session")
async def stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_body_bytes=1024 * 1024,
        max_tokens=64,
        cache_dir=tmp_path_factory.mktemp("proxy-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
    )
    running = await start_proxy(config)
    start_hf_worker(running, tiny_model_dir, worker_id="test-hf")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


@pytest.fixture
async def proxy_client(stack: RunningProxy) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(stack.url) as client:
        yield client


@pytest.fixture(scope="session")
async def scripted_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[RunningProxy, PacedScriptedEngine]]:
    """A proxy like ``stack``'s whose worker serves a scripted engine on the tiny model,
    for tests that need a reply of a given shape (``tests.scripted_worker``)."""
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_body_bytes=1024 * 1024,
        max_tokens=64,
        cache_dir=tmp_path_factory.mktemp("scripted-proxy-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
    )
    running = await start_proxy(config)
    engine = serve_scripted(running, tiny_model_dir, worker_id="test-scripted")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running, engine
    await running.stop()


@pytest.fixture
def scripted(scripted_stack: tuple[RunningProxy, PacedScriptedEngine]) -> PacedScriptedEngine:
    """The scripted stack's engine with nothing queued: the test scripts its replies."""
    engine = scripted_stack[1]
    engine.reset()
    return engine


@pytest.fixture
async def scripted_client(
    scripted_stack: tuple[RunningProxy, PacedScriptedEngine],
) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(scripted_stack[0].url) as client:
        yield client
