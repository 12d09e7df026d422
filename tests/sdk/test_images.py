"""A vision-language sample as the trainer's forward inputs, on the tiny VLM: what the ``hf``
engine samples with images re-scores within 1e-4 from ``forward_inputs`` (pixels from the
model's own processor, M-RoPE positions from the model, in both the 3-row and verl's 4-row
layout), images in later turns included, and not with another image; a span the processor
disagrees with fails; the fidelity check re-scores with the recorded pixels."""

from __future__ import annotations

import hashlib
import io
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from sdk.exceptions import ImageSpanError
from sdk.fidelity import check_fidelity, check_samples
from sdk.images import (
    VisionScorer,
    forward_inputs,
    response_logprobs,
    verl_position_ids,
)
from sdk.samples import Sample, SampleImage
from tests.images import GREEN, RED, png
from worker_client.backends.hf import HFEngine
from worker_client.engine import ImageSpan, SamplingParams
from worker_client.tiny_vlm import IMAGE_PAD, SHIPPED_TINY_VLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


BLUE = png((10, 10, 240), (128, 96))
DARK = png((90, 0, 0), (128, 96))
BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(slots=True)
class Stack:
    engine: HFEngine  # the worker's engine: what samples
    model: Any  # the trainer's copy of the same weights
    tokenizer: Any
    processor: Any

    @property
    def pad(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(IMAGE_PAD))

    def encode(
        self, text: str, images: Sequence[bytes], offset: int
    ) -> tuple[list[int], list[SampleImage]]:
        """``text``'s ids with each image placeholder expanded to the processor's count, and
        the images' spans (``offset``: where the ids start in the whole sequence)."""
        ids: list[int] = []
        spans: list[SampleImage] = []
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if token != self.pad:
                ids.append(token)
                continue
            data = images[len(spans)]
            with Image.open(io.BytesIO(data)) as opened:
                width, height = opened.size
            count = (
                self.processor.get_number_of_image_patches(height, width, {})
                // self.processor.merge_size**2
            )
            start = offset + len(ids)
            ids.extend([self.pad] * count)
            digest = hashlib.sha256(data).hexdigest()
            spans.append(
                SampleImage(digest, "image/png", width, height, start, start + count, data)
            )
        assert len(spans) == len(images)
        return ids, spans

    async def sample(
        self, ids: Sequence[int], images: Sequence[SampleImage], seed: int
    ) -> tuple[list[int], list[float]]:
        spans = [ImageSpan(i.sha256, i.data or b"", i.start, i.end) for i in images]
        tokens: list[int] = []
        logprobs: list[float] = []
        sampling = SamplingParams(max_tokens=6, seed=seed)
        async for chunk in self.engine.generate(f"r{seed}", ids, sampling, spans):
            tokens += chunk.token_ids
            logprobs += chunk.logprobs
        return tokens, logprobs


@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[Stack]:
    engine = HFEngine.load(SHIPPED_TINY_VLM, name="tiny-vlm")
    model = AutoModelForImageTextToText.from_pretrained(SHIPPED_TINY_VLM, dtype=torch.float32)
    yield Stack(
        engine,
        model.eval(),
        AutoTokenizer.from_pretrained(SHIPPED_TINY_VLM),
        AutoImageProcessor.from_pretrained(SHIPPED_TINY_VLM),
    )
    await engine.close()


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


async def one_turn(stack: Stack, image: bytes = RED) -> Sample:
    prompt, images = stack.encode(user(f"{BLOCK}What is it?"), [image], 0)
    tokens, logprobs = await stack.sample(prompt, images, seed=1)
    return Sample(
        trial_id="t",
        prompt_ids=prompt,
        response_ids=tokens,
        response_mask=[1] * len(tokens),
        response_logprobs=logprobs,
        reward=None,
        num_turns=1,
        branch=0,
        response_versions=[0] * len(tokens),
        images=images,
    )


async def two_turns(stack: Stack) -> Sample:
    """A trajectory whose second turn brings another image: it lies in the response ids
    (context between the turns, mask 0)."""
    first = await one_turn(stack)
    head = first.prompt_ids + first.response_ids
    between, later = stack.encode(f"<|im_end|>\n{user(f'Now this: {BLOCK}')}", [BLUE], len(head))
    prompt2 = head + between
    tokens, logprobs = await stack.sample(prompt2, first.images + later, seed=2)
    response = first.response_ids + between + tokens
    mask = first.response_mask + [0] * len(between) + [1] * len(tokens)
    return replace(
        first,
        response_ids=response,
        response_mask=mask,
        response_logprobs=first.response_logprobs + [0.0] * len(between) + logprobs,
        num_turns=2,
        response_versions=[0 if m else -1 for m in mask],
        images=first.images + later,
    )


def sampled_error(sample: Sample, scored: Sequence[float]) -> float:
    return max(
        abs(r - s)
        for r, s, m in zip(sample.response_logprobs, scored, sample.response_mask, strict=True)
        if m
    )


async def test_forward_inputs_reproduce_the_sampled_logprobs(stack: Stack) -> None:
    """The forward with the helper's inputs gives what the engine sampled (1e-4), with
    the 3-row positions and with verl's 4-row layout; a different image does not."""
    sample = await one_turn(stack)
    inputs = forward_inputs(sample, stack.processor, stack.model)
    length = len(sample.prompt_ids) + len(sample.response_ids)
    assert inputs["input_ids"].tolist() == [sample.prompt_ids + sample.response_ids]
    assert inputs["position_ids"].shape == (3, 1, length)
    image = sample.images[0]
    assert inputs["mm_token_type_ids"][0].nonzero().flatten().tolist() == list(
        range(image.start, image.end)
    )
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]  # 64×48 → 4 tokens
    prompt_length = len(sample.prompt_ids)
    assert sampled_error(sample, response_logprobs(stack.model, inputs, prompt_length)) <= 1e-4

    verl = verl_position_ids(inputs["position_ids"])
    assert verl.shape == (1, 4, length)
    assert verl[0, 0].tolist() == list(range(length))
    assert torch.equal(verl[0, 1:], inputs["position_ids"][:, 0])
    four_rows = {**inputs, "position_ids": verl.transpose(0, 1)}  # the model takes (4, 1, L)
    assert sampled_error(sample, response_logprobs(stack.model, four_rows, prompt_length)) <= 1e-4

    other = replace(sample, images=[replace(image, sha256=sha(GREEN), data=GREEN)])
    moved = response_logprobs(
        stack.model, forward_inputs(other, stack.processor, stack.model), prompt_length
    )
    assert sampled_error(sample, moved) > 0.05


async def test_an_image_in_a_later_turn_re_scores_too(stack: Stack) -> None:
    """Both turns' sampled tokens re-score within 1e-4 with both images at their spans;
    the second image, swapped, moves the second turn."""
    sample = await two_turns(stack)
    assert len(sample.images) == 2
    assert sample.images[1].start > len(sample.prompt_ids)
    scorer = VisionScorer(stack.model, stack.processor)
    assert sampled_error(sample, scorer.score_sample(sample)) <= 1e-4
    swapped = replace(
        sample,
        images=[
            sample.images[0],
            replace(sample.images[1], data=DARK, sha256=sha(DARK)),
        ],
    )
    assert sampled_error(sample, scorer.score_sample(swapped)) > 0.05


async def test_a_span_the_processor_disagrees_with_fails(stack: Stack) -> None:
    """One placeholder short, an image token no image claims, an image without bytes and
    bytes that are no image each raise ``ImageSpanError``, never a batch."""
    sample = await one_turn(stack)
    image = sample.images[0]
    short = replace(
        sample,
        prompt_ids=sample.prompt_ids[: image.end - 1] + sample.prompt_ids[image.end :],
        images=[replace(image, end=image.end - 1)],
    )
    with pytest.raises(ImageSpanError, match="takes 4 tokens"):
        forward_inputs(short, stack.processor, stack.model)
    stray = replace(sample, response_ids=[*sample.response_ids, stack.pad])
    with pytest.raises(ImageSpanError, match="not where"):
        forward_inputs(stray, stack.processor, stack.model)
    with pytest.raises(ImageSpanError, match="not where"):
        forward_inputs(replace(sample, images=[]), stack.processor, stack.model)
    with pytest.raises(ImageSpanError, match="no bytes"):
        forward_inputs(replace(sample, images=[replace(image, data=None)]), stack.processor)
    with pytest.raises(ImageSpanError, match="not the image named"):
        forward_inputs(replace(sample, images=[replace(image, data=GREEN)]), stack.processor)
    nope = replace(image, sha256=sha(b"nope"), data=b"nope")
    with pytest.raises(ImageSpanError, match="cannot be decoded"):
        forward_inputs(replace(sample, images=[nope]), stack.processor)


async def test_the_fidelity_check_re_scores_with_the_recorded_pixels(stack: Stack) -> None:
    """``check_samples`` passes with the recorded image (the helper's scorer, and the
    engine's own for an image in the prompt) and reports a mismatch with another one; an
    export with images and no bytes for them is refused."""
    sample = await one_turn(stack)
    scorer = VisionScorer(stack.model, stack.processor)
    report = check_samples([sample], scorer.score)
    assert report.ok()
    assert report.images == 1
    assert check_samples([sample], stack.engine.score).ok()
    image = sample.images[0]
    wrong = replace(sample, images=[replace(image, sha256=sha(GREEN), data=GREEN)])
    report = check_samples([wrong], scorer.score)
    assert not report.ok()
    assert report.max_abs_error > 0.05

    traj = {
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "response_mask": sample.response_mask,
        "response_logprobs": sample.response_logprobs,
        "multi_modal_data": {
            "images": [
                {
                    "sha256": image.sha256,
                    "mime": "image/png",
                    "width": 64,
                    "height": 48,
                    "span": [image.start, image.end],
                }
            ]
        },
    }
    with pytest.raises(ValueError, match="not its bytes"):
        check_fidelity({"trajectories": [traj]}, scorer.score)
    assert check_fidelity({"trajectories": [traj]}, scorer.score, images={image.sha256: RED}).ok()
    traj["multi_modal_data"]["images"][0]["sha256"] = sha(GREEN)
    assert not check_fidelity(
        {"trajectories": [traj]}, scorer.score, images={sha(GREEN): GREEN}
    ).ok()


def verl_processor(stack: Stack) -> Any:
    """Qwen3-VL's processor as verl's ``hf_processor`` makes it (the model's
    ``get_rope_index`` and ``get_vision_position_ids`` bound to it), without the video processor, which needs torchvision
    (not installable on a CPU-only machine); images never reach it."""
    import types

    from transformers.models.qwen3_vl import Qwen3VLModel, Qwen3VLProcessor

    class ImagesOnly(Qwen3VLProcessor):  # type: ignore[misc]
        def check_argument_for_proper_class(self, name: str, argument: Any) -> Any:
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    processor = ImagesOnly(
        image_processor=stack.processor, tokenizer=stack.tokenizer, video_processor=None
    )
    processor.config = stack.model.config
    for name in ("get_rope_index", "get_vision_position_ids"):
        setattr(processor, name, types.MethodType(getattr(Qwen3VLModel, name), processor))
    return processor


async def test_verl_builds_the_same_inputs_from_the_adapter_output(stack: Stack) -> None:
    """The verl adapter's output carries the images as PIL images; verl's own agent-loop
    code (its processor inputs and its 4-row position ids) turns it into the helper's
    inputs, and the forward on them reproduces the sampled logprobs. Without a processor
    an episode with images is refused."""
    pytest.importorskip("verl.experimental.agent_loop.agent_loop")
    from types import SimpleNamespace

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from sdk.agent_loop import RolloutResult
    from sdk.verl import to_output

    sample = await two_turns(stack)
    result = RolloutResult(Path("task"), "t", [sample], None, {}, [], {})
    processor = verl_processor(stack)
    output = to_output(sample, result, processor)
    images = output.multi_modal_data["images"]
    assert [im.size for im in images] == [(64, 48), (128, 96)]

    # verl decodes the ids with skip_special_tokens=True before its processor re-expands the
    # placeholders; this tokenizer registers <|image_pad|> as a special token (as Qwen's
    # list it among their additional special tokens), which that decode would drop, leaving
    # the processor no placeholder for the images. The decode here keeps them.
    tokenizer = SimpleNamespace(
        decode=lambda ids, skip_special_tokens=False: stack.tokenizer.decode(ids)
    )
    worker = SimpleNamespace(
        processor=processor,
        tokenizer=tokenizer,
        _get_mm_processor_kwargs=lambda audios=None: {},
    )
    input_ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    attention = torch.ones_like(input_ids)
    verl_inputs = AgentLoopWorker._compute_multi_modal_inputs(worker, output, input_ids)
    positions = AgentLoopWorker._compute_position_ids(worker, input_ids, attention, verl_inputs)
    ours = forward_inputs(sample, stack.processor, stack.model)
    assert torch.equal(verl_inputs["image_grid_thw"], ours["image_grid_thw"])
    assert torch.equal(verl_inputs["pixel_values"], ours["pixel_values"])
    assert torch.equal(positions, verl_position_ids(ours["position_ids"]))

    batch = {
        "input_ids": input_ids,
        "pixel_values": verl_inputs["pixel_values"],
        "image_grid_thw": verl_inputs["image_grid_thw"],
        "mm_token_type_ids": ours["mm_token_type_ids"],
        "position_ids": positions.transpose(0, 1),  # verl's (1, 4, L) as the model's (4, 1, L)
    }
    scored = response_logprobs(stack.model, batch, len(sample.prompt_ids))
    assert sampled_error(sample, scored) <= 1e-4

    with pytest.raises(ImageSpanError, match="no processor"):
        to_output(sample, result, None)
    short = replace(sample, images=[replace(sample.images[0], end=sample.images[0].end - 1)])
    with pytest.raises(ImageSpanError):
        to_output(short, result, processor)
