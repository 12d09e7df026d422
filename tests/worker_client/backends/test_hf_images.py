"""The ``hf`` engine on the tiny vision-language model: images reach what it samples and
what it scores, each image's placeholder range is checked against its own processor, the
prefix cache and chunked prefill keep every image whole and its own, and a model without a
vision tower refuses images."""

from __future__ import annotations

import hashlib
import io
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from tests.images import GREEN, RED, png
from worker_client.backends.hf import HFEngine, is_vision_model
from worker_client.engine import ImageSpan, SamplingParams
from worker_client.exceptions import EngineError
from worker_client.tiny_vlm import IMAGE_PAD, SHIPPED_TINY_VLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
async def vlm() -> AsyncIterator[HFEngine]:
    engine = HFEngine.load(SHIPPED_TINY_VLM, name="tiny-vlm")
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED_TINY_VLM)


BLUE = png((10, 10, 240), (1280, 800))


class Prompt:
    """A conversation rendered with the model's template and its image placeholders expanded
    to each image's token count, with the images' spans."""

    def __init__(self, engine: HFEngine, tokenizer: Any, messages: list[dict[str, Any]]) -> None:
        pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        images = [
            part["data"]
            for m in messages
            if isinstance(m["content"], list)
            for part in m["content"]
            if part["type"] == "image"
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        processor = engine.image_processor
        self.ids: list[int] = []
        self.images: list[ImageSpan] = []
        for token in tokenizer.encode(text, add_special_tokens=False):
            if token != pad:
                self.ids.append(token)
                continue
            data = images[len(self.images)]
            with Image.open(io.BytesIO(data)) as opened:
                width, height = opened.size
            count = (
                processor.get_number_of_image_patches(height, width, {}) // processor.merge_size**2
            )
            start = len(self.ids)
            self.ids.extend([pad] * count)
            self.images.append(
                ImageSpan(hashlib.sha256(data).hexdigest(), data, start, start + count)
            )


def user(*parts: bytes | str) -> dict[str, Any]:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "data": p}
        for p in parts
    ]
    return {"role": "user", "content": content}


async def sample(
    engine: HFEngine,
    ids: Sequence[int],
    images: Sequence[ImageSpan],
    seed: int | None = 1,
    temperature: float = 1.0,
) -> tuple[list[int], list[float]]:
    sampling = SamplingParams(max_tokens=6, seed=seed, temperature=temperature)
    tokens: list[int] = []
    logprobs: list[float] = []
    async for chunk in engine.generate(f"r{seed}-{temperature}", ids, sampling, images):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
    return tokens, logprobs


def close(a: Sequence[float], b: Sequence[float], tolerance: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


def test_the_card_says_whether_a_model_takes_images(vlm: HFEngine, tiny_model_dir: Path) -> None:
    """A directory with a vision tower loads as a vision-language model and says so; the
    text model does not."""
    assert is_vision_model(SHIPPED_TINY_VLM)
    assert vlm.card.vision
    assert not is_vision_model(tiny_model_dir)
    assert not HFEngine.load(tiny_model_dir).card.vision


@pytest.mark.parametrize("images", [[RED], [RED, BLUE]], ids=["one", "two"])
async def test_sampled_logprobs_re_score_with_the_same_pixels(
    vlm: HFEngine, tokenizer: Any, images: list[bytes]
) -> None:
    """What it samples with images re-scores within 1e-4 by teacher forcing with the same
    pixels, and not with another image in the first one's place."""
    prompt = Prompt(vlm, tokenizer, [user(*images, "What is in the picture?")])
    tokens, logprobs = await sample(vlm, prompt.ids, prompt.images)
    assert close(vlm.score(prompt.ids, tokens, prompt.images), logprobs)
    other = Prompt(vlm, tokenizer, [user(GREEN, *images[1:], "What is in the picture?")])
    assert other.ids == prompt.ids  # the same placeholders: only the pixels differ
    moved = vlm.score(other.ids, tokens, other.images)
    assert max(abs(x - y) for x, y in zip(moved, logprobs, strict=True)) > 0.05


async def test_a_later_turn_reuses_the_cache_only_with_the_same_images(
    vlm: HFEngine, tokenizer: Any
) -> None:
    """A second turn carrying the first's history continues from the cache; one whose
    earlier image was replaced computes it anew: both re-score with their own pixels."""
    first = [user(RED, "Look."), {"role": "assistant", "content": "I see."}]
    same = Prompt(vlm, tokenizer, [*first, user("And now?")])
    edited = Prompt(
        vlm,
        tokenizer,
        [user(GREEN, "Look."), {"role": "assistant", "content": "I see."}, user("And now?")],
    )
    await sample(
        vlm, Prompt(vlm, tokenizer, first[:1]).ids, Prompt(vlm, tokenizer, first[:1]).images
    )
    for prompt in (same, edited, same):
        tokens, logprobs = await sample(vlm, prompt.ids, prompt.images, seed=7)
        assert close(vlm.score(prompt.ids, tokens, prompt.images), logprobs)


async def test_an_image_is_never_cut_across_prefill_chunks(vlm: HFEngine, tokenizer: Any) -> None:
    """With prefill chunks smaller than an image, the image still goes through one forward
    whole and the logprobs are those of a single pass."""
    chunked = HFEngine(
        vlm.model,
        name="chunked",
        max_model_len=4096,
        eos_token_ids=(),
        prefill_chunk=3,
        image_processor=vlm.image_processor,
    )
    prompt = Prompt(vlm, tokenizer, [user("Two:", RED, "and", BLUE, "done")])
    tokens, logprobs = await sample(chunked, prompt.ids, prompt.images)
    assert close(vlm.score(prompt.ids, tokens, prompt.images), logprobs)
    await chunked.close()


async def test_text_after_an_image_turn_has_plain_positions(vlm: HFEngine, tokenizer: Any) -> None:
    """A text-only request after an image request re-scores as text (no position offsets
    left from the image turn)."""
    image_turn = Prompt(vlm, tokenizer, [user(BLUE, "Describe.")])
    await sample(vlm, image_turn.ids, image_turn.images)
    text = Prompt(vlm, tokenizer, [user("Only words here.")])
    tokens, logprobs = await sample(vlm, text.ids, [])
    assert close(vlm.score(text.ids, tokens), logprobs)


async def test_a_span_that_does_not_match_the_processor_fails(
    vlm: HFEngine, tokenizer: Any
) -> None:
    """An image whose placeholder count is not what the model's processor gives it, image
    tokens no image claims, bytes that are no image and a size the processor refuses each
    fail the request loudly."""
    prompt = Prompt(vlm, tokenizer, [user(RED, "Look.")])
    span = prompt.images[0]
    pad = prompt.ids[span.start]
    short = [*prompt.ids[: span.end - 1], *prompt.ids[span.end :]]
    wrong = [ImageSpan(span.sha256, span.data, span.start, span.end - 1)]
    with pytest.raises(EngineError, match="takes 4 tokens"):
        await sample(vlm, short, wrong)
    with pytest.raises(EngineError, match="not where"):
        await sample(vlm, prompt.ids, [])
    with pytest.raises(EngineError, match="not where"):
        await sample(vlm, [*prompt.ids, pad], prompt.images)
    broken = [ImageSpan("0" * 64, b"not an image", span.start, span.end)]
    with pytest.raises(EngineError, match="cannot be decoded"):
        await sample(vlm, prompt.ids, broken)
    thin = png((9, 9, 9), (10, 3000))  # an aspect ratio the processor refuses
    refused = [ImageSpan(hashlib.sha256(thin).hexdigest(), thin, span.start, span.end)]
    with pytest.raises(EngineError, match="cannot be processed"):
        await sample(vlm, prompt.ids, refused)


async def test_a_text_model_refuses_images(tiny_model_dir: Path) -> None:
    """Images sent to a model without a vision tower fail before anything runs."""
    engine = HFEngine.load(tiny_model_dir)
    image = ImageSpan(hashlib.sha256(RED).hexdigest(), RED, 1, 5)
    with pytest.raises(EngineError, match="does not take images"):
        await sample(engine, [1, 5, 5, 5, 5, 2], [image])
    with pytest.raises(EngineError, match="does not take images"):
        engine.score([1, 5, 5, 5, 5, 2], [3], [image])
    await engine.close()


async def test_new_weights_load_into_a_vision_language_model(vlm: HFEngine, tmp_path: Path) -> None:
    """A checkpoint of the same vision-language model stages and commits in place."""
    engine = HFEngine.load(SHIPPED_TINY_VLM)
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.add_(0.01)
    engine.model.save_pretrained(tmp_path / "ckpt")
    fresh = HFEngine.load(SHIPPED_TINY_VLM)
    await fresh.stage_weights(str(tmp_path / "ckpt"))
    await fresh.commit_weights(1)
    ours = dict(fresh.model.named_parameters())
    assert all(torch.equal(ours[name], p) for name, p in engine.model.named_parameters())
    await engine.close()
    await fresh.close()


async def test_a_placeholder_token_is_never_sampled(vlm: HFEngine, tokenizer: Any) -> None:
    """Even where the model puts nearly all its mass on its image and video placeholders,
    the engine samples other tokens, greedy or not (a sampled placeholder, carried into
    the next turn, would be counted as a media slot there); the recorded logprobs stay the
    model's raw ones, which teacher forcing reproduces."""
    config = vlm.model.config
    placeholders = [config.image_token_id, config.video_token_id]

    def favour_placeholders(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        output[..., placeholders] += 40.0
        return output

    prompt = Prompt(vlm, tokenizer, [user("What is in the picture?")])
    hook = vlm.model.lm_head.register_forward_hook(favour_placeholders)
    try:
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
            tokens, logprobs = await sample(
                vlm, prompt.ids, prompt.images, temperature=temperature, seed=seed
            )
            assert tokens
            assert not set(tokens) & set(placeholders)
            assert max(logprobs) < -20  # the placeholders' mass is still in the distribution
            assert close(vlm.score(prompt.ids, tokens, prompt.images), logprobs)
    finally:
        hook.remove()
