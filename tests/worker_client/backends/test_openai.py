"""The ``openai`` backend against an upstream speaking vLLM's token-id completions API.

No vLLM or SGLang server can run here (no GPU), so the upstream is a small aiohttp server
implementing vLLM's ``/v1/completions`` streaming with ``return_token_ids`` on top of the
``hf`` engine and the real tiny model: the tokens and logprobs are the model's."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from proxy.cli import main
from proxy.config import ProxyConfig
from proxy.embedded import start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import wait_until_joined, worker_command
from worker_client.backends.hf import HFEngine
from worker_client.backends.openai import OpenAIEngine, chunk_from_event
from worker_client.engine import FinishReason, SamplingParams, TokenChunk
from worker_client.exceptions import EngineError

PROMPT = [5, 17, 42, 9, 3]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> HFEngine:
    return HFEngine.load(tiny_model_dir)


@pytest.fixture
async def upstream(hf: HFEngine) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if body.get("model") == "broken":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        sampling = SamplingParams(
            max_tokens=body["max_tokens"],
            temperature=body["temperature"],
            top_p=body["top_p"],
            top_k=body.get("top_k", 0),
            seed=body.get("seed"),
            stop_token_ids=tuple(body.get("stop_token_ids", ())),
        )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in hf.generate("up", body["prompt"], sampling):
            choice = {
                "index": 0,
                "text": "",
                "token_ids": chunk.token_ids,
                "logprobs": {"token_logprobs": chunk.logprobs},
                "finish_reason": chunk.finish_reason.value if chunk.finish_reason else None,
            }
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("/v1")), bodies
    await server.close()


async def _collect(engine: OpenAIEngine, sampling: SamplingParams) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate("r1", PROMPT, sampling)]


async def test_tokens_and_logprobs_are_the_upstream_models(
    upstream: tuple[str, list[dict[str, Any]]], hf: HFEngine, tiny_model_dir: Path
) -> None:
    """Token-id prompt in, sampled ids and faithful logprobs out, streamed per token."""
    url, bodies = upstream
    engine = OpenAIEngine.load(tiny_model_dir, base_url=url, name="tiny")
    chunks = await _collect(engine, SamplingParams(max_tokens=6, seed=3))
    await engine.close()
    ids = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert chunks[-1].finish_reason in {FinishReason.STOP, FinishReason.LENGTH}
    assert len(chunks) == len(ids) >= 1  # one chunk per token: real streaming
    assert bodies[0]["prompt"] == PROMPT
    assert bodies[0]["return_token_ids"] is True
    assert bodies[0]["logprobs"] == 0
    expected = hf.score(PROMPT, ids)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4


async def test_length_and_errors(
    upstream: tuple[str, list[dict[str, Any]]], tiny_model_dir: Path
) -> None:
    """max_tokens ends with length; an upstream error becomes EngineError."""
    url, _ = upstream
    engine = OpenAIEngine.load(tiny_model_dir, base_url=url)
    eos = set(json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"])
    chunks = await _collect(engine, SamplingParams(max_tokens=1, seed=1))
    assert chunks[-1].finish_reason is (
        FinishReason.STOP if chunks[-1].token_ids[0] in eos else FinishReason.LENGTH
    )
    broken = OpenAIEngine.load(tiny_model_dir, base_url=url, upstream_model="broken")
    with pytest.raises(EngineError, match="500"):
        await _collect(broken, SamplingParams(max_tokens=2))
    await engine.close()
    await broken.close()


def test_chunk_without_token_ids_is_refused() -> None:
    """An upstream without return_token_ids support is reported, not guessed around."""
    with pytest.raises(EngineError, match="return_token_ids"):
        chunk_from_event({"choices": [{"text": "hi", "finish_reason": None}]})
    with pytest.raises(EngineError, match="logprob"):
        chunk_from_event({"choices": [{"token_ids": [1, 2], "finish_reason": None}]})
    assert chunk_from_event({"choices": [], "usage": {}}) is None


async def test_worker_cli_serves_a_chat_turn_through_the_upstream(
    tmp_path: Path, tiny_model_dir: Path, upstream: tuple[str, list[dict[str, Any]]]
) -> None:
    """`rollout-relay worker --backend openai --upstream-url U` joins a real proxy, and a
    chat completion through the proxy is generated by the upstream from token ids."""
    url, bodies = upstream
    running = await start_proxy(
        ProxyConfig(port=0, cache_dir=tmp_path / "proxy-cache", worker_token="w")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    worker = await asyncio.create_subprocess_exec(
        *worker_command(
            running.worker_url,
            tiny_model_dir,
            "--backend",
            "openai",
            "--name",
            "upstream-tiny",
            "--upstream-url",
            url,
            "--token",
            "w",
        ),
        env=env,
    )
    try:
        await wait_until_joined(running, worker)
        async with ProxyClient(running.url) as proxy:
            trial = await proxy.create_session(sampling={"seed": 3, "max_tokens": 8})
            async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
                reply = await client.chat.completions.create(
                    model="upstream-tiny", messages=[{"role": "user", "content": "hi"}]
                )
            (traj,) = (await proxy.trajectories(trial.trial_id))["trajectories"]
    finally:
        worker.terminate()
        await worker.wait()
        await running.stop()
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(traj["response_mask"]) >= 1
    (body,) = bodies
    assert body["prompt"] == traj["prompt_ids"]  # token ids in, no re-tokenization upstream
    assert body["model"] == "upstream-tiny"
    sampled = [t for t, m in zip(traj["response_ids"], traj["response_mask"], strict=True) if m]
    assert len(sampled) == reply.usage.completion_tokens


def test_worker_cli_needs_the_upstream_url(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --upstream-url the openai backend refuses with exit 2 and says why."""
    code = main(
        [
            "worker",
            "--proxy",
            "ws://127.0.0.1:1/ws/worker",
            "--backend",
            "openai",
            "--model",
            "/nonexistent",
        ]
    )
    assert code == 2
    assert "--upstream-url" in capsys.readouterr().err
