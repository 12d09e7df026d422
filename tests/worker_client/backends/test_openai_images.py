"""The ``openai`` backend with images: a vision-language model's requests with images go to
SGLang's native ``/generate`` (``input_ids`` with one placeholder per image, ``image_data``
with the agent's bytes), and SGLang's own expansion is checked against the proxy's.

SGLang cannot run here (no GPU), so the upstream is a loopback aiohttp stand-in that checks
the body's shape against the fields of SGLang's ``GenerateReqInput`` and its sampling
parameters, expands the placeholders the way SGLang's ``_expand_input_ids`` does (the i-th
placeholder repeated as many times as the i-th image takes), and streams the events as
SGLang's ``/generate`` writes them: cumulative ``output_ids`` with ``meta_info``'s
``output_token_logprobs`` and ``completion_tokens`` (or deltas, as with
``--incremental-streaming-output``), the request's ``prompt_token_ids``, ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from PIL import Image

from worker_client.backends.openai import OpenAIEngine, SGLangStream
from worker_client.engine import FinishReason, ImageSpan, SamplingParams, TokenChunk
from worker_client.exceptions import EngineError, EngineUnavailableError

PAD, VSTART, VEND = 151655, 151652, 151653
STOP = 5
REPLY = [21, 22, 23, STOP]

# Top-level fields of SGLang's GenerateReqInput and keys of its SamplingParams the backend
# may send (python/sglang/srt/managers/io_struct.py, sampling/sampling_params.py).
GENERATE_FIELDS = {
    "input_ids",
    "image_data",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_prompt_token_ids",
    "stream",
}
SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "skip_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    "logit_bias",
}


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


RED, BLUE = png((200, 30, 40), (64, 48)), png((10, 10, 240), (32, 32))
# What the stand-in's "processor" gives each image size, as the proxy's did.
TOKENS_FOR_SIZE = {(64, 48): 4, (32, 32): 2}


def prompt(text_len: int = 1) -> tuple[list[int], list[ImageSpan], list[int]]:
    """Expanded ids with RED (4 placeholders) and BLUE (2), their spans, the collapsed ids."""
    head = list(range(1000, 1000 + text_len))
    expanded = [*head, VSTART, PAD, PAD, PAD, PAD, VEND, 12, VSTART, PAD, PAD, VEND, 13]
    n = len(head)
    spans = [
        ImageSpan(hashlib.sha256(RED).hexdigest(), RED, n + 1, n + 5),
        ImageSpan(hashlib.sha256(BLUE).hexdigest(), BLUE, n + 8, n + 10),
    ]
    collapsed = [*head, VSTART, PAD, VEND, 12, VSTART, PAD, VEND, 13]
    return expanded, spans, collapsed


class SGLangStandIn:
    """``POST /generate`` as SGLang answers a streamed token-id request with images, and a
    ``/v1/completions`` for text requests."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.completions: list[dict[str, Any]] = []
        self.incremental = False
        self.extra_tokens = 0  # the stand-in's processor counts this many more for image 0
        self.error: str | None = None
        self.slow = False

    def expand(self, ids: list[int], images: list[bytes]) -> list[int]:
        counts = []
        for data in images:
            with Image.open(io.BytesIO(data)) as image:
                counts.append(TOKENS_FOR_SIZE[image.size])
        counts[0] += self.extra_tokens
        assert sum(1 for t in ids if t == PAD) == len(counts)  # one placeholder per image
        out: list[int] = []
        it = iter(counts)
        for token in ids:
            out.extend([PAD] * next(it) if token == PAD else [token])
        return out

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        assert set(body) <= GENERATE_FIELDS, set(body) - GENERATE_FIELDS
        assert set(body["sampling_params"]) <= SAMPLING_KEYS
        images = []
        for url in body["image_data"]:
            head, _, payload = url.partition(",")
            assert head == "data:image/png;base64"
            images.append(base64.b64decode(payload, validate=True))
        prompt_ids = self.expand(body["input_ids"], images)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.error is not None:
            await response.write(
                b"data: " + json.dumps({"error": {"message": self.error}}).encode()
            )
            await response.write(b"\n\ndata: [DONE]\n\n")
            return response
        limit = body["sampling_params"]["max_new_tokens"]
        reply = REPLY[:limit]
        for n in range(1, len(reply) + 1):
            done = n == len(reply)
            start = n - 1 if self.incremental else 0
            ids = reply[start:n]
            finish = None
            if done:
                finish = {"type": "stop", "matched": STOP} if reply[-1] == STOP else None
                finish = finish or {"type": "length", "length": limit}
            event = {
                "text": "",
                "output_ids": ids,
                "meta_info": {
                    "id": "abc",
                    "finish_reason": finish,
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": n,
                    "cached_tokens": 0,
                    "output_token_logprobs": [
                        [-0.5 * (start + i + 1), t, None] for i, t in enumerate(ids)
                    ],
                },
                "prompt_token_ids": prompt_ids,
            }
            # Written in small pieces, so that a long event crosses many reads.
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            for at in range(0, len(data), 4096):
                await response.write(data[at : at + 4096])
            if self.slow:
                await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def completion(self, request: web.Request) -> web.StreamResponse:
        self.completions.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        choice = {
            "index": 0,
            "token_ids": [STOP],
            "logprobs": {"token_logprobs": [-0.25]},
            "finish_reason": "stop",
        }
        await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
async def sglang() -> AsyncIterator[tuple[str, SGLangStandIn]]:
    stand_in = SGLangStandIn()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/generate", stand_in.generate)
    app.router.add_post("/v1/completions", stand_in.completion)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("/v1")), stand_in
    await server.close()


@pytest.fixture
def vlm_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 200_000, "image_token_id": PAD})
    )
    return tmp_path


async def run(
    engine: OpenAIEngine, ids: list[int], images: list[ImageSpan], max_tokens: int = 8
) -> list[TokenChunk]:
    sampling = SamplingParams(max_tokens=max_tokens, seed=7, stop_token_ids=(STOP,))
    try:
        return [c async for c in engine.generate("r1", ids, sampling, images)]
    finally:
        await engine.close()


@pytest.mark.parametrize("incremental", [False, True])
async def test_images_go_to_sglang_generate(
    sglang: tuple[str, SGLangStandIn], vlm_dir: Path, incremental: bool
) -> None:
    """One placeholder per image and the images' bytes, in order, reach /generate; the
    tokens stream one chunk each with their logprobs, from cumulative or delta events."""
    url, stand_in = sglang
    stand_in.incremental = incremental
    engine = OpenAIEngine.load(vlm_dir, base_url=url, name="vl", images_api="sglang")
    assert engine.card.image_token_id == PAD
    expanded, spans, collapsed = prompt()
    chunks = await run(engine, expanded, list(reversed(spans)))
    assert chunks == [
        TokenChunk([21], [-0.5]),
        TokenChunk([22], [-1.0]),
        TokenChunk([23], [-1.5]),
        TokenChunk([STOP], [-2.0], FinishReason.STOP),
    ]
    (body,) = stand_in.bodies
    assert body["input_ids"] == collapsed
    assert [base64.b64decode(u.partition(",")[2]) for u in body["image_data"]] == [RED, BLUE]
    assert body["sampling_params"] == {
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 7,
        "stop_token_ids": [STOP],
        "logit_bias": {str(PAD): -100.0},  # the placeholder is never sampled
    }
    assert body["return_logprob"] is True
    assert body["return_prompt_token_ids"] is True
    assert body["stream"] is True
    assert stand_in.completions == []


async def test_length_limit(sglang: tuple[str, SGLangStandIn], vlm_dir: Path) -> None:
    url, _ = sglang
    engine = OpenAIEngine.load(vlm_dir, base_url=url, images_api="sglang")
    expanded, spans, _ = prompt()
    chunks = await run(engine, expanded, spans, max_tokens=2)
    assert [c.token_ids for c in chunks] == [[21], [22]]
    assert chunks[-1].finish_reason == FinishReason.LENGTH


async def test_a_long_prompt_streams_past_aiohttps_line_limit(
    sglang: tuple[str, SGLangStandIn], vlm_dir: Path
) -> None:
    """SGLang repeats the prompt's ids in every event: a 60k-token prompt makes lines far
    longer than aiohttp's readline takes, and they are read whole."""
    url, _ = sglang
    engine = OpenAIEngine.load(vlm_dir, base_url=url, images_api="sglang")
    expanded, spans, _ = prompt(text_len=60_000)
    chunks = await run(engine, expanded, spans)
    assert [t for c in chunks for t in c.token_ids] == REPLY


async def test_another_expansion_fails_before_any_token(
    sglang: tuple[str, SGLangStandIn], vlm_dir: Path
) -> None:
    """SGLang's processor counting another number of tokens for an image (other min/max
    pixels than the model's files) fails the request before a token goes out."""
    url, stand_in = sglang
    stand_in.extra_tokens = 1
    engine = OpenAIEngine.load(vlm_dir, base_url=url, images_api="sglang")
    expanded, spans, _ = prompt()
    received: list[TokenChunk] = []

    async def collect() -> None:
        stream = engine.generate("r1", expanded, SamplingParams(max_tokens=8), spans)
        received.extend([c async for c in stream])

    with pytest.raises(
        EngineError,
        match="SGLang expanded the prompt's images to 14 prompt ids where the proxy's expansion has 13",
    ):
        await collect()
    await engine.close()
    assert received == []


async def test_an_sglang_error_event_fails_the_request(
    sglang: tuple[str, SGLangStandIn], vlm_dir: Path
) -> None:
    url, stand_in = sglang
    stand_in.error = "prompt has 3 image placeholder token(s) but 2 image(s) were provided"
    engine = OpenAIEngine.load(vlm_dir, base_url=url, images_api="sglang")
    expanded, spans, _ = prompt()
    with pytest.raises(EngineError, match="SGLang failed the request: prompt has 3"):
        await run(engine, expanded, spans)


async def test_abort_ends_an_image_request(
    sglang: tuple[str, SGLangStandIn], vlm_dir: Path
) -> None:
    url, stand_in = sglang
    stand_in.slow = True
    engine = OpenAIEngine.load(vlm_dir, base_url=url, images_api="sglang")
    expanded, spans, _ = prompt()
    chunks = []
    async for chunk in engine.generate("r1", expanded, SamplingParams(max_tokens=8), spans):
        chunks.append(chunk)
        if len(chunks) == 1:
            await engine.abort("r1")
    await engine.close()
    assert chunks[-1] == TokenChunk([], [], FinishReason.ABORT)


async def test_text_requests_keep_completions(
    sglang: tuple[str, SGLangStandIn], vlm_dir: Path
) -> None:
    """A request without images goes to /v1/completions as before, images_api or not."""
    url, stand_in = sglang
    engine = OpenAIEngine.load(vlm_dir, base_url=url, images_api="sglang")
    chunks = await run(engine, [1, 2, 3], [])
    assert chunks == [TokenChunk([STOP], [-0.25], FinishReason.STOP)]
    assert [b["prompt"] for b in stand_in.completions] == [[1, 2, 3]]
    assert stand_in.bodies == []


async def test_without_images_api_images_are_refused(
    sglang: tuple[str, SGLangStandIn], vlm_dir: Path
) -> None:
    """In front of a vLLM server (no images_api) the model is announced as text, and images
    that reach it fail the request, saying what vLLM's HTTP server does not take."""
    url, stand_in = sglang
    engine = OpenAIEngine.load(vlm_dir, base_url=url, name="vl")
    assert engine.card.image_token_id is None
    expanded, spans, _ = prompt()
    with pytest.raises(EngineError, match="vLLM's OpenAI-compatible server takes no images"):
        await run(engine, expanded, spans)
    assert stand_in.bodies == []


def test_images_api_needs_a_vision_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    with pytest.raises(EngineUnavailableError, match="names no image_token_id"):
        OpenAIEngine.load(tmp_path, base_url="http://127.0.0.1:1/v1", images_api="sglang")
    with pytest.raises(EngineUnavailableError, match="images_api must be one of sglang"):
        OpenAIEngine.load(tmp_path, base_url="http://127.0.0.1:1/v1", images_api="vllm")


def test_sglang_events_are_checked() -> None:
    """Events whose ids, logprobs and counts disagree fail rather than record a wrong turn."""
    expanded, _, _ = prompt()
    stream = SGLangStream(expanded)
    with pytest.raises(EngineError, match="did not report the prompt ids"):
        stream.chunk({"output_ids": [], "meta_info": {"completion_tokens": 0}})
    stream = SGLangStream(expanded)
    meta = {"completion_tokens": 1, "output_token_logprobs": [[-0.1, 9, None]]}
    with pytest.raises(EngineError, match="not those of its output ids"):
        stream.chunk({"output_ids": [8], "meta_info": meta, "prompt_token_ids": expanded})
    stream = SGLangStream(expanded)
    with pytest.raises(EngineError, match="one logprob each"):
        stream.chunk(
            {"output_ids": [8], "meta_info": {"completion_tokens": 1}, "prompt_token_ids": expanded}
        )
    stream = SGLangStream(expanded)
    meta = {
        "completion_tokens": 1,
        "output_token_logprobs": [[-0.1, 8, None]],
        "finish_reason": {"type": "weird"},
    }
    with pytest.raises(EngineError, match="finish reason"):
        stream.chunk({"output_ids": [8], "meta_info": meta, "prompt_token_ids": expanded})
