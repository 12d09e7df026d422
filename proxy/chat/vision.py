"""How a vision-language model's prompt holds its images, token for token.

A Qwen-VL template writes one ``<|vision_start|><|image_pad|><|vision_end|>`` per image; the
model's forward needs the pad token once per image token, which is as many as the image's
patches after the image processor resized it, divided by the merge size squared. The proxy
records the expanded ids (what the forward saw: what is trained and re-scored), so it
expands each pad right after tokenizing, with the count the model's own image processor
gives for the image's size, never a count worked out by hand.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.chat.messages import ImagePart
from proxy.exceptions import ImageError, TemplateError

# An image's span in a prompt: the half-open range of its placeholder tokens.
Span = tuple[int, int]


class VisionTokens:
    """The placeholder token of one model and how many of it each image takes."""

    def __init__(self, image_processor: Any, pad_id: int) -> None:
        self.image_processor = image_processor
        self.pad_id = pad_id
        self._merge = int(getattr(image_processor, "merge_size", 1)) ** 2
        self._counts: dict[tuple[int, int], int] = {}

    def __repr__(self) -> str:
        return f"<VisionTokens pad={self.pad_id} {type(self.image_processor).__name__}>"

    @classmethod
    def from_directory(
        cls, path: str | Path, tokenizer: Any, *, pad_id: int | None = None
    ) -> VisionTokens | None:
        """The model's image processor and placeholder, when ``path`` holds a
        vision-language model's files (``preprocessor_config.json``, and the placeholder's
        id: ``pad_id`` as the worker announced it, else from ``config.json``); None for a
        text model."""
        root = Path(path)
        if not (root / "preprocessor_config.json").is_file():
            return None
        from transformers import AutoImageProcessor

        if pad_id is None:
            pad_id = _pad_id(root, tokenizer)
        processor = AutoImageProcessor.from_pretrained(str(root), local_files_only=True)  # type: ignore[no-untyped-call]
        return cls(processor, pad_id)

    def count(self, image: ImagePart) -> int:
        """How many placeholder tokens ``image`` takes (kept per size: every turn's history
        repeats its screenshots)."""
        size = (image.width, image.height)
        known = self._counts.get(size)
        if known is None:
            try:
                patches = self.image_processor.get_number_of_image_patches(
                    image.height, image.width, {}
                )
            except ValueError as exc:  # e.g. Qwen-VL refuses an aspect ratio over 200
                raise ImageError(
                    f"this model cannot take an image of {image.width}x{image.height} "
                    f"pixels: {exc}",
                    code="image_unsupported_size",
                ) from None
            known = self._counts[size] = int(patches) // self._merge
        return known

    def expand(
        self, ids: Sequence[int], images: Sequence[ImagePart]
    ) -> tuple[list[int], list[Span]]:
        """``ids`` with the ``k``-th placeholder repeated for the ``k``-th image, and each
        image's span in the result. The template must have placed every image once."""
        out: list[int] = []
        spans: list[Span] = []
        pad, at = self.pad_id, 0
        while True:
            try:
                found = ids.index(pad, at)  # searched in C: a prompt is long, its images few
            except ValueError:
                break
            if len(spans) == len(images):
                raise TemplateError(
                    f"the chat template placed more images than the {len(images)} sent"
                )
            out.extend(ids[at:found])
            start = len(out)
            out.extend([pad] * self.count(images[len(spans)]))
            spans.append((start, len(out)))
            at = found + 1
        out.extend(ids[at:])
        if len(spans) != len(images):
            raise TemplateError(
                f"the chat template placed {len(spans)} of the {len(images)} images sent "
                "(this model's template shows images only where it renders them: not in a "
                "system message)"
            )
        return out, spans


def _pad_id(root: Path, tokenizer: Any) -> int:
    """The placeholder the forward fills with image features: the model's configuration
    names it (``image_token_id``); else the tokenizer's own ``image_token``."""
    config_file = root / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if isinstance(config.get("image_token_id"), int):
            return int(config["image_token_id"])
    token = getattr(tokenizer, "image_token", None)
    if isinstance(token, str):
        found = tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and found >= 0:
            return found
    raise TemplateError(f"{root} has an image processor but names no image token")
