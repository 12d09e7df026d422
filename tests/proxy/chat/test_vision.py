"""Images in a prompt, token for token: each placeholder the template writes is expanded to
the count the model's own image processor gives the image, exactly as the engine's forward
needs it, and a template that drops an image is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoImageProcessor, AutoTokenizer

from proxy.chat.messages import ChatMessage, ImagePart
from proxy.chat.renderer import ChatRenderer
from proxy.chat.vision import VisionTokens
from proxy.exceptions import ImageError, TemplateError
from worker_client.tiny_vlm import IMAGE_PAD, SHIPPED_TINY_VLM


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_directory(SHIPPED_TINY_VLM)


@pytest.fixture(scope="module")
def vision(renderer: ChatRenderer) -> VisionTokens:
    found = VisionTokens.from_directory(SHIPPED_TINY_VLM, renderer.tokenizer)
    assert found is not None
    return found


def picture(width: int, height: int, sha: str = "a") -> ImagePart:
    return ImagePart(sha256=sha * 64, media_type="image/png", width=width, height=height)


def test_a_text_model_has_no_vision(tiny_model_dir: Path) -> None:
    """A directory without an image processor is a text model."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert VisionTokens.from_directory(tiny_model_dir, tokenizer) is None


def test_the_placeholder_is_the_models_image_token(
    vision: VisionTokens, renderer: ChatRenderer
) -> None:
    """The placeholder is the id the model's configuration names, the template's pad."""
    assert vision.pad_id == renderer.tokenizer.convert_tokens_to_ids(IMAGE_PAD)


@pytest.mark.parametrize(("width", "height"), [(64, 48), (1280, 800), (640, 480), (30, 3000)])
def test_counts_are_the_processors(vision: VisionTokens, width: int, height: int) -> None:
    """Each image's count is what the model's processor gives its size, the grid its pixel
    values are cut into."""
    from PIL import Image

    processor = AutoImageProcessor.from_pretrained(SHIPPED_TINY_VLM)
    grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")[
        "image_grid_thw"
    ]
    assert vision.count(picture(width, height)) == int(grid.prod()) // processor.merge_size**2


def test_a_size_the_processor_refuses_is_a_clear_error(vision: VisionTokens) -> None:
    """An image the model's processor cannot take (Qwen-VL: an aspect ratio over 200) is a
    400 saying so, not a failure of the proxy."""
    with pytest.raises(ImageError, match="10x3000") as caught:
        vision.count(picture(10, 3000))
    assert caught.value.status == 400


def test_a_rendered_prompt_expands_each_image_in_its_place(
    vision: VisionTokens, renderer: ChatRenderer
) -> None:
    """Two images in a user message and one in a tool result: each placeholder becomes its
    image's count of pads, the spans say where, and the text around them is unchanged."""
    small, large, tool = picture(64, 48, "a"), picture(1280, 800, "b"), picture(640, 480, "c")
    messages = [
        ChatMessage(role="user", content="oneandtwo", parts=("one", small, "and", large, "two")),
        ChatMessage(role="assistant", content="ok"),
        ChatMessage(role="tool", content="shot", tool_call_id="c", parts=("shot", tool)),
    ]
    ids = renderer.render_conversation(messages, [])
    expanded, spans = vision.expand(ids, [small, large, tool])
    assert [end - start for start, end in spans] == [4, 60, 54]
    assert all(expanded[i] == vision.pad_id for s, e in spans for i in range(s, e))
    assert expanded.count(vision.pad_id) == 4 + 60 + 54
    without = [t for t in expanded if t != vision.pad_id]
    assert without == [t for t in ids if t != vision.pad_id]
    assert spans[0][0] == ids.index(vision.pad_id)


def test_a_template_that_drops_an_image_is_refused(
    vision: VisionTokens, renderer: ChatRenderer
) -> None:
    """Qwen3-VL's template renders no image of a system message: the images sent and the
    placeholders written differ, and the request is refused rather than sampled without
    the image."""
    dropped = picture(64, 48)
    messages = [
        ChatMessage(role="system", content="see", parts=("see", dropped)),
        ChatMessage(role="user", content="hi"),
    ]
    ids = renderer.render_conversation(messages, [])
    with pytest.raises(TemplateError, match="placed 0 of the 1 images"):
        vision.expand(ids, [dropped])
    with pytest.raises(TemplateError, match="more images than the 0 sent"):
        vision.expand([*ids, vision.pad_id], [])
