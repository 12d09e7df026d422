"""A tiny vision-language model of Qwen3-VL's architecture, generated locally, for tests and
demos of images on CPU.

``write_tiny_vlm(dir)`` writes a model that ``AutoModelForImageTextToText``,
``AutoImageProcessor`` and ``AutoTokenizer`` load offline, with no torchvision:

* the tiny text model's byte-level BPE (``tiny_model``) with Qwen3-VL's vision tokens added
  as special tokens: ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` (the
  placeholder the model's forward fills with image features) and ``<|video_pad|>``;
* Qwen3-VL-8B-Instruct's official chat template (``assets/templates``, with its provenance),
  which renders one ``<|vision_start|><|image_pad|><|vision_end|>`` per image in user and tool
  content, and hermes tool calls;
* ``preprocessor_config.json`` for Qwen2-VL's image processor (patch 16, merge 2): an image is
  resized to between 64×64 and 65,536 pixels, so a 1280×800 screenshot becomes 60 image tokens
  and a 64×48 one 4;
* a ``Qwen3VLForConditionalGeneration`` with a two-layer text model of width 64 (M-RoPE) and a
  two-block vision tower of width 32, its weights random from the seed: about 0.74M
  parameters. The image matters to what it samples: teacher forcing the same tokens with
  another image moves their logprobs by a large fraction of a nat.

The project ships one, written by ``write_tiny_vlm(SHIPPED_TINY_VLM)`` (seed 0); unlike the
text model it is not trained, so a generated one equals the shipped one on any machine.
``rollout-relay tiny-model --vlm DIR`` writes a new one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker_client.tiny_model import (
    CONTEXT_WINDOW,
    SHIPPED_TINY_MODEL,
    save_atomically,
    seeded_model,
)

ASSETS = Path(__file__).resolve().parent / "assets"
# The model the project ships (package data; about 2.2 MB).
SHIPPED_TINY_VLM = ASSETS / "tiny-vlm"
CHAT_TEMPLATE_FILE = ASSETS / "templates" / "qwen3-vl-instruct.jinja"

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = 64 * 64
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 64  # at most 64 image tokens per image


def image_processor_config() -> dict[str, Any]:
    """What ``AutoImageProcessor`` reads: Qwen2-VL's processor (Qwen3-VL uses it) with the
    tiny model's patch, merge and pixel bounds."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }


def mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's split of the ``head_dim / 2`` rotary frequencies over (time, height, width):
    [2, 3, 3] for 16, [6, 5, 5] for 32 (Qwen-VL's proportions, time taking the rest)."""
    spatial = (head_dim // 2) * 5 // 16
    if head_dim == 16:
        return [2, 3, 3]
    return [head_dim // 2 - 2 * spatial, spatial, spatial]


def tiny_vlm_tokenizer() -> Any:
    """The tiny text model's tokenizer with the vision tokens and Qwen3-VL's template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TINY_MODEL)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    return tokenizer


def write_tiny_vlm(out_dir: Path, *, seed: int = 0, head_dim: int = 16) -> Path:
    """Write the tiny VLM to ``out_dir`` (replacing it atomically) and return the path.
    ``head_dim``: its text model's attention heads' width (16 shipped; 32 for vLLM's CPU
    attention, which takes no narrower ones: another model, drawn from the same seed)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = tiny_vlm_tokenizer()
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": head_dim,
            "max_position_embeddings": CONTEXT_WINDOW,
            "rope_scaling": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": mrope_section(head_dim),
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": True,
            "eos_token_id": end,
            "pad_token_id": pad,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "out_hidden_size": 64,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    model = seeded_model(
        Qwen3VLForConditionalGeneration, config, seed=seed, eos_ids=[end, pad], pad_id=pad
    )
    processor = json.dumps(image_processor_config(), indent=2) + "\n"
    return save_atomically(out_dir, model, tokenizer, files={"preprocessor_config.json": processor})
