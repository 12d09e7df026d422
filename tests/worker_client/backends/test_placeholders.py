"""Image prompts for engines that expand placeholders themselves: each image's span of the
proxy's expanded ids collapses to one placeholder, the engine's own expansion is checked
against the proxy's, and the images travel as the bytes or pixels the agent sent.

Pure functions: no vLLM or SGLang here (tests/worker_client/backends/test_vllm.py runs the
collapse through vLLM's own prompt replacement)."""

from __future__ import annotations

import base64
import hashlib
import io

import pytest
from PIL import Image

from worker_client.backends.placeholders import (
    check_expansion,
    collapse_images,
    data_url,
    decode_image,
)
from worker_client.engine import ImageSpan
from worker_client.exceptions import EngineError

PAD = 99


def span(start: int, end: int, data: bytes = b"") -> ImageSpan:
    return ImageSpan(hashlib.sha256(data or bytes([start])).hexdigest(), data, start, end)


def image_bytes(fmt: str, size: tuple[int, int] = (8, 6), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, 128 if mode == "L" else (10, 200, 30)).save(out, format=fmt)
    return out.getvalue()


# text, <vision_start>=7, 4 pads, <vision_end>=8, text, 7, 2 pads, 8, text
EXPANDED = [1, 2, 7, PAD, PAD, PAD, PAD, 8, 3, 7, PAD, PAD, 8, 4]
SPANS = [span(3, 7), span(10, 12)]
COLLAPSED = [1, 2, 7, PAD, 8, 3, 7, PAD, 8, 4]


def test_each_span_collapses_to_one_placeholder() -> None:
    """Every image keeps one placeholder where its span was; the other ids stay verbatim."""
    assert collapse_images(EXPANDED, SPANS, PAD) == COLLAPSED


def test_spans_in_any_order_collapse_the_same() -> None:
    """The images' order in the request does not matter: their spans place them."""
    assert collapse_images(EXPANDED, list(reversed(SPANS)), PAD) == COLLAPSED


def test_adjacent_images_stay_two_placeholders() -> None:
    """Two images back to back (no tokens between) stay two placeholders, not one."""
    ids = [1, PAD, PAD, PAD, PAD, PAD, 2]
    assert collapse_images(ids, [span(1, 3), span(3, 6)], PAD) == [1, PAD, PAD, 2]


def test_a_prompt_without_images_is_unchanged() -> None:
    assert collapse_images([1, 2, 3], [], PAD) == [1, 2, 3]


@pytest.mark.parametrize(
    ("ids", "spans", "reason"),
    [
        (EXPANDED, [span(3, 7), span(6, 12)], "overlaps"),  # overlapping spans
        (EXPANDED, [span(3, 3), span(10, 12)], "empty"),  # an empty span
        (EXPANDED, [span(3, 7), span(10, 20)], "leaves"),  # past the prompt's end
        (EXPANDED, [span(2, 7), span(10, 12)], "other tokens"),  # covers <vision_start>
        (EXPANDED, [span(3, 7)], "no image's span covers"),  # a stray placeholder after
        (EXPANDED, [span(10, 12)], "no image's span covers"),  # a stray placeholder before
        (EXPANDED, [span(3, 6), span(10, 12)], "no image's span covers"),  # a span too short
    ],
)
def test_spans_that_do_not_describe_the_prompt_are_refused(
    ids: list[int], spans: list[ImageSpan], reason: str
) -> None:
    """A span the prompt does not bear out fails the request before the engine sees it: the
    engine would take a stray placeholder for another image, or drop ids."""
    with pytest.raises(EngineError, match=reason):
        collapse_images(ids, spans, PAD)


def test_the_engines_expansion_must_be_the_proxys() -> None:
    """The same ids pass; another count, another token or none reported fail loudly."""
    check_expansion("vLLM", EXPANDED, list(EXPANDED))
    longer = [*EXPANDED[:4], PAD, *EXPANDED[4:]]
    with pytest.raises(EngineError, match=r"to 15 prompt ids where the proxy's expansion has 14"):
        check_expansion("vLLM", EXPANDED, longer)
    with pytest.raises(EngineError, match="first difference at position 13"):
        check_expansion("SGLang", EXPANDED, [*EXPANDED[:-1], 5])
    with pytest.raises(EngineError, match="first difference at position 14"):
        check_expansion("SGLang", EXPANDED, [*EXPANDED, 5])
    with pytest.raises(EngineError, match="did not report the prompt ids"):
        check_expansion("SGLang", EXPANDED, None)


@pytest.mark.parametrize(
    ("fmt", "media_type"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")],
)
def test_data_url_carries_the_bytes_as_sent(fmt: str, media_type: str) -> None:
    """The data URL holds the agent's bytes unchanged, with their format's media type."""
    data = image_bytes(fmt)
    url = data_url(span(0, 1, data))
    head, _, payload = url.partition(",")
    assert head == f"data:{media_type};base64"
    assert base64.b64decode(payload, validate=True) == data


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "RGBA"), ("GIF", "P"), ("PNG", "L")])
def test_decoded_images_are_rgb(fmt: str, mode: str) -> None:
    """Images decode to RGB at their own size, whatever their mode (as the hf backend)."""
    image = decode_image(span(0, 1, image_bytes(fmt, (8, 6), mode)))
    assert (image.mode, image.size) == ("RGB", (8, 6))


def test_undecodable_bytes_are_an_engine_error() -> None:
    with pytest.raises(EngineError, match="cannot be decoded"):
        decode_image(span(0, 1, b"not an image"))
