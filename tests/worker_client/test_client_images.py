"""Images across the relay, end to end below the agent APIs: a real proxy, a real worker
on the tiny vision-language model, and the pool sending each image's bytes once per worker
before the requests that use it; what the worker samples re-scores with the same pixels."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from proxy.appkeys import POOL
from relay import protocol
from relay.images import PromptImage
from rollout_relay.embedded import RunningProxy, start_proxy
from tests.worker_client.backends.test_hf_images import BLUE, RED, Prompt, user
from tests.worker_client.test_client import TOKEN, _collect, _config, _running
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel, WorkerClient
from worker_client.engine import ImageSpan
from worker_client.tiny_vlm import SHIPPED_TINY_VLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[RunningProxy]:
    running = await start_proxy(_config(tmp_path))
    yield running
    await running.stop()


def _prompt_images(spans: list[ImageSpan]) -> list[PromptImage]:
    return [PromptImage(s.sha256, s.data, s.start, s.end) for s in spans]


async def test_images_cross_the_relay_once_and_reach_the_engine(proxy: RunningProxy) -> None:
    """The worker announces the model's image token and image processor; two requests
    carrying the same screenshot send its bytes once; the tokens sampled with the images
    re-score by teacher forcing with the same pixels within 1e-4."""
    engine = HFEngine.load(SHIPPED_TINY_VLM, name="vlm")
    client = WorkerClient(
        proxy.worker_url, {"vlm": ServedModel(engine, SHIPPED_TINY_VLM)}, token=TOKEN
    )
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TINY_VLM)
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        (handle,) = pool.workers.values()
        info = handle.models["vlm"]
        assert info.image_token_id == engine.card.image_token_id
        assert "preprocessor_config.json" in info.tokenizer_files
        first = Prompt(engine, tokenizer, [user(RED, "What is it?")])
        later = Prompt(
            engine,
            tokenizer,
            [
                user(RED, "What is it?"),
                {"role": "assistant", "content": "red"},
                user(BLUE, "And this?"),
            ],
        )
        for prompt in (first, later):
            call = await pool.start(
                "vlm",
                prompt.ids,
                protocol.Sampling(max_tokens=5, seed=3),
                images=_prompt_images(prompt.images),
            )
            tokens, logprobs, _ = await asyncio.wait_for(_collect(call), 30)
            scored = engine.score(prompt.ids, tokens, prompt.images)
            assert max(abs(a - b) for a, b in zip(scored, logprobs, strict=True)) < 1e-4
        red, blue = (hashlib.sha256(d).hexdigest() for d in (RED, BLUE))
        assert handle.endpoint.images == {red, blue}  # a second send of red would have failed
        assert handle.images.held_bytes == len(RED) + len(BLUE)
    await engine.close()


async def test_a_text_worker_announces_no_images(proxy: RunningProxy, tiny_model_dir: Path) -> None:
    """A worker on a text model names no image token and ships no image processor."""
    engine = HFEngine.load(tiny_model_dir, name="tiny")
    client = WorkerClient(
        proxy.worker_url, {"tiny": ServedModel(engine, tiny_model_dir)}, token=TOKEN
    )
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        (handle,) = proxy.app[POOL].workers.values()
        assert handle.models["tiny"].image_token_id is None
        assert "preprocessor_config.json" not in handle.models["tiny"].tokenizer_files
    await engine.close()


async def test_a_request_naming_an_image_the_worker_lacks_fails_alone(
    proxy: RunningProxy,
) -> None:
    """A proxy whose ledger says the worker holds an image it never got: the worker answers
    that request alone with ``image_missing`` and keeps its connection; the pool sends the
    image again and the request completes on the same connection."""
    engine = HFEngine.load(SHIPPED_TINY_VLM, name="vlm")
    client = WorkerClient(
        proxy.worker_url, {"vlm": ServedModel(engine, SHIPPED_TINY_VLM)}, token=TOKEN
    )
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TINY_VLM)
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        (handle,) = pool.workers.values()
        prompt = Prompt(engine, tokenizer, [user(RED, "What is it?")])
        red = hashlib.sha256(RED).hexdigest()
        # What a frame lost on its way used to leave behind: the proxy believes it was sent.
        handle.images.plan([red], {red: len(RED)})
        handle.endpoint.images.add(red)
        call = await pool.start(
            "vlm",
            prompt.ids,
            protocol.Sampling(max_tokens=3, seed=3),
            images=_prompt_images(prompt.images),
        )
        tokens, _, finished = await asyncio.wait_for(_collect(call), 30)
        assert len(tokens) == 3
        assert finished.finish_reason == "length"
        assert pool.workers.get(handle.worker_id) is handle
        assert pool.stats.worker_disconnects == 0
        assert handle.in_flight == set()
        assert handle.endpoint.images == {red}
    await engine.close()
