"""Image prompts for engines that expand image placeholders themselves (vLLM, SGLang).

The proxy sends a vision-language model's prompt EXPANDED: each image's placeholder token
repeated as many times as the model's image processor says (what the forward sees, so what
is trained and re-scored). vLLM and SGLang take a token prompt with ONE placeholder per
image beside the images and expand it with their own processor; given the expanded ids they
would expand every copy again (vLLM) or refuse the count (SGLang), and the sample would be
garbage. So such a backend sends ``collapse_images(...)`` and, where the engine reports the
prompt ids it ran, ``check_expansion`` fails the request when they are not the ids the
proxy records (an engine whose processor settings differ from the model's files, e.g. other
``max_pixels``, expands to another count).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

from worker_client.engine import ImageSpan
from worker_client.exceptions import EngineError


def collapse_images(
    prompt_ids: Sequence[int], images: Sequence[ImageSpan], image_token_id: int
) -> list[int]:
    """``prompt_ids`` with each image's span of placeholders collapsed to one placeholder.

    Raises ``EngineError`` when the spans do not describe the prompt: out of range, empty,
    overlapping, holding other tokens than the placeholder, or a placeholder outside every
    span (the engine would take it for another image)."""
    spans = sorted(images, key=lambda span: span.start)
    out: list[int] = []
    at = 0
    for span in spans:
        if not at <= span.start < span.end <= len(prompt_ids):
            raise EngineError(
                f"image {span.sha256[:12]} spans [{span.start}, {span.end}), which is empty, "
                f"overlaps another image or leaves the {len(prompt_ids)}-token prompt"
            )
        _no_stray_placeholder(prompt_ids, at, span.start, image_token_id)
        out.extend(prompt_ids[at : span.start])
        if any(token != image_token_id for token in prompt_ids[span.start : span.end]):
            raise EngineError(
                f"image {span.sha256[:12]} spans [{span.start}, {span.end}), which holds "
                f"other tokens than the image placeholder {image_token_id}"
            )
        out.append(image_token_id)
        at = span.end
    _no_stray_placeholder(prompt_ids, at, len(prompt_ids), image_token_id)
    out.extend(prompt_ids[at:])
    return out


def _no_stray_placeholder(ids: Sequence[int], start: int, end: int, image_token_id: int) -> None:
    for index in range(start, end):
        if ids[index] == image_token_id:
            raise EngineError(
                f"the prompt has an image placeholder at {index} that no image's span covers"
            )


def check_expansion(engine: str, expected: Sequence[int], used: Sequence[int] | None) -> None:
    """Fail when the prompt ids ``engine`` ran (``used``, after its own expansion) are not
    the expanded ids the proxy sent (``expected``): the turn would record other tokens
    than the forward saw. ``used`` None: the engine did not report them."""
    if used is None:
        raise EngineError(
            f"{engine} did not report the prompt ids it ran, so its image expansion cannot "
            "be checked against the proxy's"
        )
    if len(used) == len(expected) and all(a == b for a, b in zip(used, expected, strict=True)):
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(used, expected, strict=False)) if a != b),
        min(len(used), len(expected)),
    )
    raise EngineError(
        f"{engine} expanded the prompt's images to {len(used)} prompt ids where the proxy's "
        f"expansion has {len(expected)} (first difference at position {first}); the engine's "
        "image processor settings (e.g. min/max pixels) must be the model's own "
        "preprocessor_config.json, which the proxy counts with"
    )


def decode_image(span: ImageSpan) -> Any:
    """The image's bytes as an RGB PIL image (a GIF's first frame), as the ``hf`` backend
    decodes them. Raises ``EngineError`` for bytes PIL cannot read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(span.data)) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise EngineError(f"image {span.sha256[:12]} cannot be decoded: {exc}") from None


def data_url(span: ImageSpan) -> str:
    """The image's bytes as they came, in a ``data:`` URL with the media type their format
    names (what SGLang's ``image_data`` takes, one per image)."""
    return f"data:{_media_type(span.data)};base64,{base64.b64encode(span.data).decode('ascii')}"


def _media_type(data: bytes) -> str:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return "application/octet-stream"
