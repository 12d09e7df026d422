"""The ``openai`` backend returning routing (R3) for a mixture-of-experts model, against a
loopback aiohttp stand-in for the servers (no GPU here): SGLang's ``/generate`` with
``return_routed_experts`` and ``routed_experts_start_len``, answering
``meta_info.routed_experts`` as SGLang does (base64 of C-order int32 ``[positions
[start_len, prompt + output - 1), decoder layers, top_k]``, on the finishing event), and
vLLM's ``/v1/completions`` with ``routed_experts_prompt_start``, answered whole with
``choices[0].routed_experts`` (base64 of an ``.npy`` array, vLLM's ``numpy2base64``)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from worker_client.backends.openai import OpenAIEngine
from worker_client.engine import FinishReason, SamplingParams, TokenChunk
from worker_client.exceptions import EngineError, EngineUnavailableError
from worker_client.routing import RoutingShape, unpack_rows

PROMPT = [11, 12, 13, 14, 15]
REPLY = [21, 22, 23]
DECODER_LAYERS, MOE = 4, [1, 2, 3]  # a DeepSeek-shaped config: layer 0 dense


def routing(first: int, end: int) -> np.ndarray[Any, Any]:
    """Every decoder layer's experts of positions [first, end): (p + l) % 8, (p + l + 1) % 8
    (the dense layer's columns 0, as the engines leave them)."""
    rows = np.zeros((end - first, DECODER_LAYERS, 2), dtype=np.int32)
    for i, p in enumerate(range(first, end)):
        for layer in MOE:
            rows[i, layer] = [(p + layer) % 8, (p + layer + 1) % 8]
    return rows


class Upstream:
    def __init__(self) -> None:
        self.generates: list[dict[str, Any]] = []
        self.completions: list[dict[str, Any]] = []
        self.ignore_start = False  # an SGLang that returns every row

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generates.append(body)
        ids = body["input_ids"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(1, len(REPLY) + 1):
            meta: dict[str, Any] = {
                "finish_reason": {"type": "length", "length": 3} if n == len(REPLY) else None,
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "output_token_logprobs": [[-0.5, t, None] for t in REPLY[:n]],
            }
            if n == len(REPLY) and body.get("return_routed_experts"):
                start = 0 if self.ignore_start else body.get("routed_experts_start_len", 0)
                rows = routing(start, len(ids) + n - 1)
                meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode()
            event = {"text": "", "output_ids": REPLY[:n], "meta_info": meta}
            event["prompt_token_ids"] = ids
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.completions.append(body)
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": REPLY,
            "logprobs": {"token_logprobs": [-0.5] * len(REPLY)},
            "finish_reason": "length",
        }
        if not body["stream"]:
            start = body.get("routed_experts_prompt_start", 0)
            rows = routing(start, len(body["prompt"]) + len(REPLY) - 1).astype(np.uint8)
            with io.BytesIO() as buffer:
                np.save(buffer, rows, allow_pickle=False)
                choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode()
            return web.json_response({"id": "cmpl-1", "choices": [choice]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    stand_in = Upstream()
    app = web.Application()
    app.router.add_post("/generate", stand_in.generate)
    app.router.add_post("/v1/completions", stand_in.completion)
    server = TestServer(app)
    await server.start_server()
    yield stand_in, f"http://127.0.0.1:{server.port}/v1"
    await server.close()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    config = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": DECODER_LAYERS,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


async def collect(engine: OpenAIEngine, **kwargs: Any) -> list[TokenChunk]:
    stream = engine.generate("r1", PROMPT, SamplingParams(max_tokens=3), **kwargs)
    return [chunk async for chunk in stream]


def check_rows(engine: OpenAIEngine, chunk: TokenChunk, start: int) -> None:
    assert chunk.routed_experts is not None
    assert engine.card.routing == RoutingShape(3, 2, 8)
    end = len(PROMPT) + len(REPLY) - 1
    assert (chunk.routed_experts.start, chunk.routed_experts.rows) == (start, end - start)
    rows = unpack_rows(chunk.routed_experts, engine.card.routing)
    assert rows.dtype == np.uint8
    assert np.array_equal(rows, routing(start, end)[:, MOE])


@pytest.mark.parametrize("ignores_start", [False, True])
async def test_sglang_returns_the_rows_from_the_asked_start(
    upstream: tuple[Upstream, str], model_dir: Path, ignores_start: bool
) -> None:
    """A text request asking for routing goes to /generate with the start (the prompt's
    length at most); SGLang's int32 rows of every decoder layer are cut to the MoE layers
    from the asked position, also from an SGLang that gives them from 0."""
    stand_in, url = upstream
    stand_in.ignore_start = ignores_start
    engine = OpenAIEngine.load(model_dir, base_url=url, routing_api="sglang")
    try:
        chunks = await collect(engine, routed_experts_from=6)
    finally:
        await engine.close()
    (body,) = stand_in.generates
    assert body["input_ids"] == PROMPT
    assert (body["return_routed_experts"], body["routed_experts_start_len"]) == (True, 5)
    assert "image_data" not in body
    assert [t for c in chunks for t in c.token_ids] == REPLY
    assert all(c.routed_experts is None for c in chunks[:-1])
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    check_rows(engine, chunks[-1], 6)


async def test_vllm_returns_the_rows_in_a_whole_response(
    upstream: tuple[Upstream, str], model_dir: Path
) -> None:
    stand_in, url = upstream
    engine = OpenAIEngine.load(model_dir, base_url=url, routing_api="vllm")
    try:
        (chunk,) = await collect(engine, routed_experts_from=2)
    finally:
        await engine.close()
    (body,) = stand_in.completions
    assert (body["stream"], body["routed_experts_prompt_start"]) == (False, 2)
    assert body["prompt"] == PROMPT
    assert body["return_token_ids"] is True
    assert chunk.token_ids == REPLY
    check_rows(engine, chunk, 2)


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_text_requests_that_ask_nothing_stream_as_before(
    upstream: tuple[Upstream, str], model_dir: Path, api: str
) -> None:
    stand_in, url = upstream
    engine = OpenAIEngine.load(model_dir, base_url=url, routing_api=api)
    try:
        chunks = await collect(engine)
    finally:
        await engine.close()
    assert not stand_in.generates
    (body,) = stand_in.completions
    assert body["stream"] is True
    assert "routed_experts_prompt_start" not in body
    assert chunks[-1].routed_experts is None


async def test_without_a_routing_api_the_card_has_none_and_asking_fails(
    upstream: tuple[Upstream, str], model_dir: Path
) -> None:
    _, url = upstream
    engine = OpenAIEngine.load(model_dir, base_url=url)
    try:
        assert engine.card.routing is None
        with pytest.raises(EngineError, match="reports no routing"):
            await collect(engine, routed_experts_from=0)
    finally:
        await engine.close()


def test_a_dense_model_cannot_return_routing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "max_position_embeddings": 64})
    )
    with pytest.raises(EngineUnavailableError, match="mixture-of-experts"):
        OpenAIEngine.load(tmp_path, base_url="http://127.0.0.1:9/v1", routing_api="sglang")
