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

from proxy.config import ProxyConfig
from rollout_relay.cli import main
from rollout_relay.embedded import start_proxy
from sdk.client import ProxyClient
from sdk.fidelity import check_fidelity
from tests.e2e.conftest import wait_until_joined, worker_command
from worker_client.backends.hf import HFEngine
from worker_client.backends.openai import (
    OpenAIEngine,
    chunk_from_event,
    sglang_generate_request,
)
from worker_client.engine import FinishReason, SamplingParams, TokenChunk
from worker_client.exceptions import EngineError, WeightsError
from worker_client.tiny_vlm import SHIPPED_TINY_VLM

PROMPT = [5, 17, 42, 9, 3]


async def stream_completion(
    request: web.Request,
    engine: HFEngine,
    request_id: str,
    prompt: list[int],
    sampling: SamplingParams,
) -> web.StreamResponse:
    """A streamed ``/v1/completions`` answer as vLLM writes it with ``return_token_ids``:
    one chunk per engine step with the sampled ids and their logprobs."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    async for chunk in engine.generate(request_id, prompt, sampling):
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
        return await stream_completion(request, hf, "up", body["prompt"], sampling)

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


async def test_a_vision_language_models_placeholders_are_never_sampled(
    upstream: tuple[str, list[dict[str, Any]]], tiny_model_dir: Path
) -> None:
    """A vision-language model's image and video placeholders go to the upstream with the
    lowest logit_bias, in every request (vLLM's completions and SGLang's /generate); a
    text model's requests carry none."""
    url, bodies = upstream
    vlm = OpenAIEngine.load(SHIPPED_TINY_VLM, base_url=url, max_model_len=4096)
    config = json.loads((SHIPPED_TINY_VLM / "config.json").read_text())
    placeholders = {str(config["image_token_id"]), str(config["video_token_id"])}
    await _collect(vlm, SamplingParams(max_tokens=1, seed=1))
    await vlm.close()
    assert bodies[-1]["logit_bias"] == dict.fromkeys(placeholders, -100.0)
    native = sglang_generate_request(PROMPT, [], None, SamplingParams(max_tokens=1), None, (7,))
    assert native["sampling_params"]["logit_bias"] == {"7": -100.0}
    text = OpenAIEngine.load(tiny_model_dir, base_url=url)
    await _collect(text, SamplingParams(max_tokens=1, seed=1))
    await text.close()
    assert "logit_bias" not in bodies[-1]


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


# --------------------------------------------------------------------------- weight updates


class UpdatableUpstream:
    """A stand-in for a vLLM or SGLang server that can load new weights: completions from
    its own ``hf`` engine, SGLang's ``/update_weights_from_disk`` and vLLM's RL routes
    (pause, ``/collective_rpc`` of ``reload_weights``, reset the prefix cache, stamp the
    version, resume) with their request and answer shapes. It records the routes called."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = HFEngine.load(model_dir)
        self.calls: list[tuple[str, Any]] = []
        self.paused = False
        self.weight_version = "default"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if self.paused:
            return web.json_response({"error": {"message": "paused"}}, status=503)
        body = await request.json()
        sampling = SamplingParams(
            max_tokens=body["max_tokens"],
            temperature=body["temperature"],
            top_p=body["top_p"],
            seed=body.get("seed"),
            stop_token_ids=tuple(body.get("stop_token_ids", ())),
        )
        return await stream_completion(
            request, self.engine, str(id(request)), body["prompt"], sampling
        )

    async def _load(self, path: str) -> str | None:
        """Load ``path``; the reason it did not load, or None."""
        try:
            await self.engine.stage_weights(path)
            await self.engine.commit_weights(0)
        except WeightsError as exc:
            return str(exc)
        return None

    async def sglang_update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/update_weights_from_disk", body))
        failed = await self._load(body["model_path"])
        if failed is None:
            self.weight_version = body.get("weight_version") or self.weight_version
        answer = {"success": failed is None, "message": failed or "", "num_paused_requests": 0}
        return web.json_response(answer, status=200 if failed is None else 400)

    async def vllm_route(self, request: web.Request) -> web.Response:
        route = request.path
        body = await request.json() if request.can_read_body else None
        self.calls.append(
            (f"{route}?{request.query_string}" if request.query_string else route, body)
        )
        if route == "/pause":
            self.paused = True
            return web.json_response({})
        if route == "/resume":
            self.paused = False
            return web.json_response({})
        if route == "/collective_rpc":
            assert body["method"] == "reload_weights"
            failed = await self._load(body["kwargs"]["weights_path"])
            if failed is not None:
                return web.json_response({"error": failed}, status=500)
            return web.json_response({"results": [None]})
        if route == "/reset_prefix_cache":
            return web.json_response({"success": True})
        self.weight_version = body["new_version"]  # /update_weight_version
        return web.json_response({})

    async def start(self) -> TestServer:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/update_weights_from_disk", self.sglang_update)
        for route in (
            "/pause",
            "/resume",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/update_weight_version",
        ):
            app.router.add_post(route, self.vllm_route)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        return server


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_weights_reach_the_upstream_server_through_its_routes(
    api: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """POST /weights through a worker with --weights-api loads the checkpoint on its
    upstream server through that server's own routes; the next reply's logprobs are the
    checkpoint's and it records the new version."""
    from tests.e2e.test_weights import write_checkpoint

    checkpoint = write_checkpoint(tiny_model_dir, tmp_path / "step-1", seed=1)
    upstream = UpdatableUpstream(tiny_model_dir)
    server = await upstream.start()
    running = await start_proxy(ProxyConfig(port=0, cache_dir=tmp_path / "proxy-cache"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    worker = await asyncio.create_subprocess_exec(
        *worker_command(
            running.worker_url,
            tiny_model_dir,
            "--backend",
            "openai",
            "--upstream-url",
            str(server.make_url("/v1")),
            "--weights-api",
            api,
        ),
        env=env,
    )
    try:
        await wait_until_joined(running, worker)
        async with ProxyClient(running.url) as proxy:
            report = await proxy.update_weights(1, str(checkpoint))
            assert [w["version"] for w in report["workers"]] == [1]
            trial = await proxy.create_session(sampling={"seed": 3, "max_tokens": 8})
            async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
                await client.chat.completions.create(
                    model="x", messages=[{"role": "user", "content": "hi"}]
                )
            export = await proxy.trajectories(trial.trial_id)
    finally:
        worker.terminate()
        await worker.wait()
        await running.stop()
        await server.close()
    (traj,) = export["trajectories"]
    assert set(traj["response_versions"]) == {1}
    scorer = HFEngine.load(checkpoint)
    assert check_fidelity(export, scorer.score).max_abs_error <= 1e-4
    assert upstream.weight_version == "1"
    routes = [route for route, _ in upstream.calls]
    if api == "sglang":
        assert routes == ["/update_weights_from_disk"]
        body = upstream.calls[0][1]
        assert (body["model_path"], body["flush_cache"]) == (str(checkpoint), True)
    else:
        assert routes == [
            "/pause?mode=wait",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/update_weight_version",
            "/resume",
        ]
        assert upstream.calls[1][1] == {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(checkpoint)},
        }
    assert not upstream.paused


async def test_upstream_that_cannot_load_fails_the_commit_and_is_resumed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A server that cannot load the checkpoint fails the engine's commit with a
    WeightsError (so the worker is taken out of service, never serving the old weights
    under the new version), and a vLLM server is resumed all the same."""
    upstream = UpdatableUpstream(tiny_model_dir)
    server = await upstream.start()
    url = str(server.make_url("/v1"))
    empty = tmp_path / "not-visible-here"
    try:
        for api in ("sglang", "vllm"):
            engine = OpenAIEngine.load(tiny_model_dir, base_url=url, weights_api=api)
            await engine.stage_weights(str(empty))
            with pytest.raises(WeightsError, match="load"):
                await engine.commit_weights(1)
            await engine.close()
            assert not upstream.paused
        plain = OpenAIEngine.load(tiny_model_dir, base_url=url)
        with pytest.raises(WeightsError, match="--weights-api"):
            await plain.stage_weights(str(tiny_model_dir))
        await plain.close()
        (tmp_path / "visible").mkdir()
        engine = OpenAIEngine.load(tiny_model_dir, base_url=url, weights_api="sglang")
        with pytest.raises(WeightsError, match=r"config\.json"):
            await engine.stage_weights(str(tmp_path / "visible"))
        await engine.close()
    finally:
        await server.close()
