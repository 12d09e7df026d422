"""The tiny vision-language model: what the project ships is what the generator writes, it
loads offline on a CPU-only machine with no torchvision, its template places one image
placeholder per image, its image processor decides how many tokens an image takes, and the
pixels reach what it samples."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from rollout_relay.cli import main
from worker_client import tiny_vlm
from worker_client.tiny_vlm import IMAGE_PAD, SHIPPED_TINY_VLM, write_tiny_vlm

SHIPPED = SHIPPED_TINY_VLM


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any, Any]:
    model = AutoModelForImageTextToText.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    return (
        model,
        AutoTokenizer.from_pretrained(SHIPPED),
        AutoImageProcessor.from_pretrained(SHIPPED),
    )


def _image(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> Image.Image:
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 8):  # some structure, so that patches differ
        image.putpixel((x, x % size[1]), (255 - color[0], color[1], 255 - color[2]))
    return image


def test_the_shipped_vlm_is_the_generators_output(tmp_path: Path) -> None:
    """The shipped tiny VLM is what ``write_tiny_vlm`` writes for seed 0, weights included
    (they are the seed's random initialisation); a change to the generator fails here until
    ``rollout-relay tiny-model --vlm worker_client/assets/tiny-vlm`` writes it again."""
    fresh = write_tiny_vlm(tmp_path / "fresh", seed=0)
    assert sorted(p.name for p in SHIPPED.iterdir()) == sorted(p.name for p in fresh.iterdir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (SHIPPED / name).read_bytes() == (fresh / name).read_bytes(), name
    for name in ("config.json", "generation_config.json", "preprocessor_config.json"):
        ours, theirs = (
            json.loads((d / name).read_text()) | {"transformers_version": None}
            for d in (SHIPPED, fresh)
        )
        assert ours == theirs, name
    shipped, generated = (
        load_file(SHIPPED / "model.safetensors"),
        load_file(fresh / "model.safetensors"),
    )
    assert shipped.keys() == generated.keys()
    assert all(torch.equal(shipped[k], generated[k]) for k in shipped)


def test_the_template_is_qwen3_vl_official_one() -> None:
    """The chat template shipped with the model is the published Qwen3-VL-8B-Instruct one,
    byte for byte (its provenance is in assets/templates/README.md)."""
    import hashlib

    text = (SHIPPED / "chat_template.jinja").read_bytes()
    assert hashlib.sha256(text).hexdigest() == (
        "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"
    )
    assert text == tiny_vlm.CHAT_TEMPLATE_FILE.read_bytes()


def test_it_loads_without_torchvision(loaded: tuple[Any, Any, Any]) -> None:
    """Model, tokenizer and image processor load offline where no torchvision is installed
    (the image processor falls back to its PIL implementation)."""
    model, tokenizer, processor = loaded
    if importlib.util.find_spec("torchvision") is None:
        assert type(processor).__name__.endswith("Pil")
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_PAD)


def test_one_placeholder_per_image_in_user_and_tool_content(loaded: tuple[Any, Any, Any]) -> None:
    """Images in a user message and in a tool's result each render as one
    ``<|vision_start|><|image_pad|><|vision_end|>``, in their places among the text."""
    _, tokenizer, _ = loaded
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
        },
        {"role": "assistant", "content": "looking"},
        {"role": "tool", "content": [{"type": "text", "text": "shot:"}, {"type": "image"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    block = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (
        f"<|im_start|>user\n{block}and{block}<|im_end|>\n"
        "<|im_start|>assistant\nlooking<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\nshot:{block}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids(IMAGE_PAD)) == 3


@pytest.mark.parametrize(
    ("width", "height", "tokens"), [(64, 48, 4), (1280, 800, 60), (640, 480, 54), (32, 32, 4)]
)
def test_the_image_processor_decides_the_token_count(
    loaded: tuple[Any, Any, Any], width: int, height: int, tokens: int
) -> None:
    """How many image tokens an image takes comes from the model's own processor (its patch,
    merge and pixel bounds), and equals the grid its pixel values are cut into."""
    _, _, processor = loaded
    merge = processor.merge_size**2
    assert processor.get_number_of_image_patches(height, width, {}) // merge == tokens
    grid = processor(images=[_image((9, 9, 9), (width, height))], return_tensors="pt")[
        "image_grid_thw"
    ]
    assert int(grid.prod()) // merge == tokens


def _inputs(tokenizer: Any, processor: Any, image: Image.Image) -> dict[str, Any]:
    pixels = processor(images=[image], return_tensors="pt")
    count = int(pixels["image_grid_thw"].prod()) // processor.merge_size**2
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    text = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids: list[int] = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        ids.extend([pad] * count if token == pad else [token])
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == pad).int(),
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
    }


def _scores(model: Any, inputs: dict[str, Any], sampled: torch.Tensor) -> torch.Tensor:
    """Teacher forcing: the logprob of each sampled token given the prompt and the image."""
    full = torch.cat([inputs["input_ids"], sampled[None]], dim=1)
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(sampled)[None]], dim=1)
    with torch.no_grad():
        logits = model(
            input_ids=full,
            mm_token_type_ids=types,
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
        ).logits[0]
    start = inputs["input_ids"].shape[1]
    steps = logits[start - 1 : start - 1 + len(sampled)].log_softmax(-1)
    return steps.gather(1, sampled[:, None])[:, 0]


def test_the_pixels_reach_what_it_samples(loaded: tuple[Any, Any, Any]) -> None:
    """Sampling with an image, then teacher forcing the same tokens with the same pixels,
    gives the same logprobs (1e-4); with another image they move by more than 0.05 nats."""
    model, tokenizer, processor = loaded
    inputs = _inputs(tokenizer, processor, _image((200, 30, 40)))
    torch.manual_seed(3)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=8,
            do_sample=True,
            output_logits=True,  # the model's own logits, before any sampling filter
            return_dict_in_generate=True,
        )
    start = inputs["input_ids"].shape[1]
    sampled = out.sequences[0, start:]
    sampled_logprobs = torch.stack(
        [step[0].log_softmax(-1)[token] for step, token in zip(out.logits, sampled, strict=True)]
    )
    same = _scores(model, inputs, sampled)
    assert torch.allclose(same, sampled_logprobs, atol=1e-4)
    other = _inputs(tokenizer, processor, _image((20, 220, 90)))
    assert (_scores(model, other, sampled) - sampled_logprobs).abs().max() > 0.05


def test_the_cli_writes_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rollout-relay tiny-model --vlm DIR`` writes a VLM the auto classes load."""
    assert main(["tiny-model", "--vlm", str(tmp_path / "vlm")]) == 0
    assert "wrote tiny model" in capsys.readouterr().out
    config = json.loads((tmp_path / "vlm" / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl"
    assert (tmp_path / "vlm" / "preprocessor_config.json").is_file()


def test_the_cli_writes_one_vllm_runs(tmp_path: Path) -> None:
    """``--head-dim 32`` gives the VLM's text model heads vLLM's CPU attention takes, with
    M-RoPE sections that add up to half of them."""
    assert main(["tiny-model", "--vlm", "--head-dim", "32", str(tmp_path / "vlm")]) == 0
    text = json.loads((tmp_path / "vlm" / "config.json").read_text())["text_config"]
    assert text["head_dim"] == 32
    assert text["rope_parameters"]["mrope_section"] == [6, 5, 5]
