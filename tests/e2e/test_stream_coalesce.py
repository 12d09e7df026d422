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

import aiohttp
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from proxy.appkeys import POOL, SERVICE
from proxy.coalesce import CoalescePolicy, StreamCoalescer
from proxy.config import ProxyConfig
from relay.pool import RelayCall
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR, wait_until_joined

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOKENS = 64  # LONG_STORY cut here: 64 steps of one token


@pytest.fixture(scope="module")
async def paced(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=30 * TIMEOUT_FACTOR,
        max_tokens=TOKENS,
        cache_dir=tmp_path_factory.mktemp("coalesce-cache"),
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
    assert len(busy) <= tokens * 0.6, len(busy)
    print(f"events: idle {len(idle)}, busy {len(busy)}, busy without coalescing {len(stepwise)}")
    assert coalescer.stats.holds > 0
    async with aiohttp.ClientSession() as http, http.get(f"{paced.url}/metrics") as response:
        metrics = await response.text()
    assert f"relay_stream_holds_total {float(coalescer.stats.holds)}" in metrics
    trajectories = export["trajectories"]
    assert [len(t["turns"]) for t in trajectories] == [1, 1, 1]  # three branches of one turn
    assert all(not t["turns"][0]["truncated"] for t in trajectories)
    idle_ids, busy_ids, stepwise_ids = (t["response_ids"] for t in trajectories)
    assert len(idle_ids) == TOKENS
    assert idle_ids == busy_ids == stepwise_ids
    assert [t["response_logprobs"] for t in trajectories[1:]] == [
        trajectories[0]["response_logprobs"]
    ] * 2


async def test_a_client_that_leaves_while_tokens_are_held_leaves_a_truncated_turn(
    paced: RunningProxy,
) -> None:
    """With the loop busy, a client that closes its stream while the proxy holds some of
    its tokens leaves a truncated turn: a prefix of the whole reply, covering what it
    saw."""
    async with ProxyClient(paced.url) as proxy:
        trial = await proxy.create_session()
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
            whole = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "a long story"}],
                max_tokens=TOKENS,
                seed=1,
            )
            coalescer = paced.app[SERVICE].coalescer
            assert coalescer is not None
            holds = coalescer.stats.holds
            seen = ""
            with busy_loop():
                await asyncio.sleep(0.3)
                stream = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "a long story"}],
                    max_tokens=TOKENS,
                    seed=1,
                    stream=True,
                )
                async for chunk in stream:
                    seen += "".join(c.delta.content or "" for c in chunk.choices)
                    if coalescer.held and seen:
                        break  # leave while the proxy holds some of the reply's tokens
                await stream.close()
                assert coalescer.stats.holds > holds  # the stream held tokens
        deadline = asyncio.get_running_loop().time() + 30 * TIMEOUT_FACTOR
        while True:
            export: dict[str, Any] = await proxy.trajectories(trial.trial_id)
            if len(export["trajectories"]) == 2:
                break
            assert asyncio.get_running_loop().time() < deadline, "no cut turn recorded"
            await asyncio.sleep(0.1)
    full, cut = export["trajectories"]
    assert not full["turns"][0]["truncated"]
    assert cut["turns"][0]["truncated"]
    kept = cut["response_ids"]
    assert 0 < len(kept) < TOKENS
    assert kept == full["response_ids"][: len(kept)]
    assert whole.choices[0].message.content is not None
    assert whole.choices[0].message.content.startswith(seen)


class _HoldingUntilTheEnd(StreamCoalescer):
    """A coalescer that counts the loop as behind from its first window on and holds a
    stream's tokens (after its first event) until the reply's end, and keeps the calls it
    held: what a stream holds when its client leaves is then known, whatever the
    machine's speed."""

    def __init__(self) -> None:
        super().__init__(CoalescePolicy(busy_from=0.0, busy_until=0.0, group=1 << 20, hold_s=600.0))
        self.calls: list[RelayCall] = []

    def hold(self, call: RelayCall, waiting: int) -> bool:
        if call not in self.calls:
            self.calls.append(call)
        return super().hold(call, waiting)


@contextlib.contextmanager
def holding_until_the_end(running: RunningProxy) -> Iterator[_HoldingUntilTheEnd]:
    service, pool = running.app[SERVICE], running.app[POOL]
    before = service.coalescer
    held = _HoldingUntilTheEnd()
    service.coalescer, pool.after_frame = held, held.frame_handled
    try:
        yield held
    finally:
        held.flush_all()
        service.coalescer = before
        pool.after_frame = before.frame_handled if before is not None else None


async def test_a_cut_turn_keeps_the_tokens_the_coalescer_held(
    paced: RunningProxy, tiny_model_dir: Path
) -> None:
    """A client that leaves while the proxy holds some of its stream's tokens leaves a cut
    turn with every token the worker had sent by then (what the client was shown, then
    what was held for it), a prefix of the whole reply; undelivered, and counted so."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ask: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": TOKENS,
        "seed": 1,
    }
    async with ProxyClient(paced.url) as proxy:
        trial = await proxy.create_session()
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
            with holding_until_the_end(paced) as coalescer:
                # A whole reply first: the gauge has judged windows (behind) by its end.
                whole = await client.chat.completions.create(**ask)
                seen = ""
                stream = await client.chat.completions.create(**ask, stream=True)
                async for chunk in stream:
                    seen += "".join(c.delta.content or "" for c in chunk.choices)
                    if seen:
                        break
                deadline = asyncio.get_running_loop().time() + 30 * TIMEOUT_FACTOR
                while not coalescer.calls or len(coalescer.calls[0].received) < TOKENS // 4:
                    assert asyncio.get_running_loop().time() < deadline, "nothing was held"
                    await asyncio.sleep(0.01)
                (call,) = coalescer.calls
                assert coalescer.held == 1
                received = len(call.received)  # by the proxy, when the client leaves
                await stream.close()
                deadline = asyncio.get_running_loop().time() + 30 * TIMEOUT_FACTOR
                while True:
                    export: dict[str, Any] = await proxy.trajectories(trial.trial_id)
                    if len(export["trajectories"]) == 2:
                        break
                    assert asyncio.get_running_loop().time() < deadline, "no cut turn recorded"
                    await asyncio.sleep(0.05)
        summary = await proxy.get_session(trial.trial_id)
    full, cut = export["trajectories"]
    assert not full["turns"][0]["truncated"]
    assert full["turns"][0]["delivered"] is True
    (turn,) = cut["turns"]
    assert turn["truncated"] is True
    assert turn["delivered"] is False
    assert summary["undelivered_turns"] == 1
    whole_ids = full["response_ids"]
    assert len(whole_ids) == TOKENS
    kept = cut["response_ids"]
    assert kept == whole_ids[: len(kept)]
    assert cut["response_logprobs"] == full["response_logprobs"][: len(kept)]
    # The client was shown the text of a few tokens; the rest it did not get are kept too.
    shown = next(k for k in range(TOKENS + 1) if tokenizer.decode(whole_ids[:k]).startswith(seen))
    assert shown < received <= len(kept) <= TOKENS, (shown, received, len(kept))
    assert whole.choices[0].message.content is not None
    assert whole.choices[0].message.content.startswith(seen)
