"""Images on the real vLLM engine: the tiny VLM (heads 32 wide) behind the real proxy, through
the official openai client. vLLM expands each image's placeholder itself; the worker checks
that its prompt ids are the proxy's expansion, and the sampled logprobs are transformers'
float32 teacher forcing with the same pixels within 1e-4 (and not with other pixels)."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from sdk.fidelity import check_samples
from sdk.images import VisionScorer
from sdk.samples import build_samples
from tests.e2e.vllm.conftest import TIMEOUT_FACTOR, within
from tests.images import GREEN, RED, png
from worker_client.backends import vllm as vllm_backend
from worker_client.backends.hf import HFEngine
from worker_client.backends.vllm import VLLMEngine
from worker_client.client import ServedModel, WorkerClient

pytestmark = pytest.mark.e2e

SCREENSHOT = png((10, 10, 240), (1280, 800))  # 60 image tokens with the tiny VLM's processor


@pytest.fixture(scope="module")
async def vlm_proxy(
    vlm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    if importlib.util.find_spec("torchvision") is None:
        pytest.fail(
            "vLLM's Qwen3-VL path needs torchvision's Python code: put "
            ".cache/vllm-venv/torchvision-shim on PYTHONPATH (make test-vllm does)"
        )
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=30 * TIMEOUT_FACTOR,
        max_tokens=256,
        cache_dir=tmp_path_factory.mktemp("vllm-vlm-cache"),
    )
    engine = VLLMEngine.load(
        str(vlm_model), name="vlm", enforce_eager=True, max_model_len=2048, max_num_seqs=4
    )
    running = await start_proxy(config)
    client = WorkerClient(
        running.worker_url, {"vlm": ServedModel(engine, vlm_model)}, worker_id="vllm-vlm"
    )
    running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    try:
        await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        yield running
    finally:
        await running.stop()
        await engine.close()


def _user(*parts: bytes | str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": p}
            if isinstance(p, str)
            else {
                "type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()},
            }
            for p in parts
        ],
    }


async def test_an_image_chain_samples_at_teacher_forcing_with_the_pixels(
    vlm_proxy: RunningProxy, vlm_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two turns, three images (two of 4 placeholder tokens, a screenshot of 60): vLLM's
    prompt ids are the proxy's expansion each turn, one chain is recorded, and teacher
    forcing with the recorded pixels gives every sampled logprob within 1e-4; with the
    images' pixels swapped it does not."""
    compared: list[int] = []  # the length of each prompt checked
    check = vllm_backend.check_expansion

    def spying(engine: str, expected: Sequence[int], reported: Sequence[int] | None) -> None:
        check(engine, expected, reported)  # raises on a difference, failing the request
        compared.append(len(expected))

    monkeypatch.setattr(vllm_backend, "check_expansion", spying)
    async with ProxyClient(vlm_proxy.url) as proxy:
        trial = await proxy.create_session(sampling={"temperature": 1.0, "top_p": 1.0, "seed": 3})
        client = openai.AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
        first = [_user("What is in this picture?", RED)]
        reply = await client.chat.completions.create(model="vlm", messages=first, max_tokens=16)  # type: ignore[arg-type]
        second = [
            *first,
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            _user(GREEN, "and in these two?", SCREENSHOT),
        ]
        async for _ in await client.chat.completions.create(
            model="vlm",
            messages=second,  # type: ignore[arg-type]
            max_tokens=16,
            stream=True,
        ):
            pass
        await client.close()
        export = await proxy.trajectories(trial.trial_id)
        (trajectory,) = export["trajectories"]
        assert [t["branch_reason"] for t in trajectory["turns"]] == ["new_session", "continued"]
        spans = [i["span"] for i in trajectory["multi_modal_data"]["images"]]
        assert [end - start for start, end in spans] == [4, 4, 60]
        assert compared == [turn["prompt_tokens"] for turn in trajectory["turns"]], compared
        (sample,) = build_samples(export)
        await proxy.fill_images(trial.trial_id, [sample])

    teacher = HFEngine.load(vlm_model)
    image_token = json.loads((vlm_model / "config.json").read_text())["image_token_id"]
    assert teacher.image_processor is not None
    ids = sample.prompt_ids + sample.response_ids
    assert all(set(ids[i.start : i.end]) == {image_token} for i in sample.images)
    report = check_samples([sample], VisionScorer(teacher.model, teacher.image_processor).score)
    assert report.images == 3
    assert within(report), report
    first_image, second_image = sample.images[0], sample.images[1]
    first_image.data, second_image.data = second_image.data, first_image.data
    first_image.sha256, second_image.sha256 = second_image.sha256, first_image.sha256
    swapped = check_samples([sample], VisionScorer(teacher.model, teacher.image_processor).score)
    assert swapped.max_abs_error > 1e-3  # the pixels matter: the check can fail
