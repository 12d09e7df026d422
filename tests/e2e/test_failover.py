"""Worker failures mid-stream, with two real workers on the tiny model: an ``hf`` worker in
this process (the survivor) and one as a separate process that the test kills (SIGKILL:
the connection drops) or freezes (SIGSTOP: it stops answering heartbeats and must be
evicted). The victim's engine is scripted to keep talking (``tests.scripted_worker``), so
it is always mid-reply when it is hit. The agent's streamed call succeeds, the session
records exactly what was delivered, and the next turn continues on the surviving worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from proxy.appkeys import MODELS, POOL
from proxy.config import ProxyConfig
from relay import protocol
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.scripted_worker import LONG_STORY, PacedScriptedEngine

pytestmark = pytest.mark.e2e

SURVIVOR = "b-survivor"
# Ties between idle workers go to the smaller id, so new trials start on the victim.
VICTIM = "a-victim"
LONG = 240  # tokens: long enough that the victim is still generating when it is hit
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
async def two_workers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=30 * TIMEOUT_FACTOR,
        max_tokens=LONG,
        heartbeat_seconds=1.5 * TIMEOUT_FACTOR,
        cache_dir=tmp_path_factory.mktemp("failover-cache"),
    )
    running = await start_proxy(config)
    start_hf_worker(running, tiny_model_dir, worker_id=SURVIVOR)
    await running.wait_for_workers(1, within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


@pytest.fixture(scope="module")
def victim(two_workers: RunningProxy, tiny_model_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A worker process that joins the proxy as VICTIM (frozen by the first test and thawed
    again, so that it reconnects; killed by the second). It answers every request with
    ``LONG_STORY``, a token every 20 ms: LONG tokens take it about five seconds."""
    command = [sys.executable, "-m", "tests.scripted_worker", "--proxy", two_workers.worker_url]
    process = subprocess.Popen(
        [*command, "--model", str(tiny_model_dir), "--worker-id", VICTIM, "--delay", "0.02"],
        cwd=REPO,
        env=os.environ | {"RELAY_WORKER_TOKEN": ""},
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()  # also ends a stopped process
            process.wait(30)


async def _stream_and_hit(client: AsyncOpenAI, hit: Any) -> tuple[str, Any, str | None, int]:
    """Stream a long reply; call ``hit()`` once the first text arrived. Returns the text,
    the usage, the finish reason and how many content chunks came before the hit."""
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "tell"}],
        max_tokens=LONG,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish, before = "", None, None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if not text:
                    hit()
                    before = 1
                text += choice.delta.content
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    return text, usage, finish, before


async def _check_failover(
    two_workers: RunningProxy, victim: subprocess.Popen[bytes], hit_signal: signal.Signals
) -> None:
    pool = two_workers.app[POOL]
    await two_workers.wait_for_workers(2, within_seconds=120 * TIMEOUT_FACTOR)
    async with ProxyClient(two_workers.url) as proxy:
        trial = await proxy.create_session()
        before = (pool.stats.resumed, pool.stats.worker_disconnects)
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as c:
            # Bounded: a reply that never comes fails the test instead of hanging the suite.
            text, usage, finish, _ = await asyncio.wait_for(
                _stream_and_hit(c, lambda: victim.send_signal(hit_signal)),
                120 * TIMEOUT_FACTOR,
            )
            # After the hit another worker samples the rest: it may stop before the cap.
            assert finish in {"stop", "length"}
            assert usage is not None
            assert pool.stats.resumed == before[0] + 1
            assert pool.stats.worker_disconnects == before[1] + 1
            assert VICTIM not in pool.workers

            export = await proxy.trajectories(trial.trial_id)
            (trajectory,) = export["trajectories"]
            (turn,) = trajectory["turns"]
            assert turn["worker_id"] == SURVIVOR
            assert turn["finish_reason"] == finish
            assert turn["truncated"] is False
            assert sum(trajectory["response_mask"]) == usage.completion_tokens
            assert (usage.completion_tokens == LONG) == (finish == "length")
            # The recorded turn is the one that was delivered.
            renderer = two_workers.app[MODELS].models[turn["model"]].renderer
            sampled = trajectory["response_ids"]
            assert renderer.tokenizer.decode(sampled, skip_special_tokens=True) == text

            # The next turn continues this context on the surviving worker.
            follow = await c.chat.completions.create(
                model="m",
                messages=[
                    {"role": "user", "content": "tell"},
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": "more"},
                ],
                max_tokens=4,
                seed=1,
            )
            assert follow.choices[0].finish_reason in {"stop", "length"}
        export = await proxy.trajectories(trial.trial_id)
        (trajectory,) = export["trajectories"]  # one path: the turn extended the first
        first, second = trajectory["turns"]
        assert second["parent"] == first["turn"]
        assert second["worker_id"] == SURVIVOR


async def test_hung_worker_is_evicted_mid_stream(
    two_workers: RunningProxy, victim: subprocess.Popen[bytes]
) -> None:
    """SIGSTOP on the worker that is streaming: it misses its heartbeat, is evicted, and
    the reply completes on the other worker."""
    evictions = two_workers.app[POOL].stats.worker_evictions
    await _check_failover(two_workers, victim, signal.SIGSTOP)
    assert two_workers.app[POOL].stats.worker_evictions == evictions + 1
    victim.send_signal(signal.SIGCONT)  # it notices its socket is gone and reconnects


async def test_worker_killed_mid_stream(
    two_workers: RunningProxy, victim: subprocess.Popen[bytes]
) -> None:
    """SIGKILL on the worker that is streaming: the reply goes on from the tokens already
    sampled on the other worker and the agent sees one normal, complete stream."""
    await _check_failover(two_workers, victim, signal.SIGKILL)


async def test_worker_error_mid_stream_keeps_what_was_sampled(
    scripted_stack: tuple[RunningProxy, PacedScriptedEngine], scripted: PacedScriptedEngine
) -> None:
    """A worker that reports an error after streaming some tokens: the agent gets a clear
    error event, and the tokens sampled so far are recorded as a truncated turn."""
    # A long reply at a token every 20 ms: still running when the error comes.
    scripted.policy = lambda prompt: LONG_STORY
    scripted.delay = 0.02
    stack, _ = scripted_stack
    pool = stack.app[POOL]
    (handle,) = pool.workers.values()
    async with ProxyClient(stack.url) as proxy:
        trial = await proxy.create_session()
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as c:
            stream = await c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "tell"}],
                max_tokens=48,
                seed=1,
                stream=True,
            )
            chunks = aiter(stream)
            text = ""
            while not text:
                chunk = await anext(chunks)
                text = "".join(ch.delta.content or "" for ch in chunk.choices)
            (rid,) = handle.in_flight
            await pool.handle_message(handle, protocol.Error("engine_error", "device lost", rid))
            with pytest.raises(openai.APIError, match="device lost"):
                async for _ in chunks:
                    pass
        summary = await proxy.get_session(trial.trial_id)
        export = await proxy.trajectories(trial.trial_id)
    assert summary["turns"] == 1
    (turn,) = export["trajectories"][0]["turns"]
    assert turn["truncated"] is True
    assert turn["finish_reason"] == "abort"
    assert 1 <= turn["completion_tokens"] < 48
