"""Small test images for the tiny vision-language model: PNGs with some structure (a flat
image's patches all look alike to a vision tower, so two flat images of one size could not
be told apart by the logprobs they give)."""

from __future__ import annotations

import io


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    from PIL import Image

    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 8):
        image.putpixel((x, x % size[1]), (255 - color[0], color[1], 255 - color[2]))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# 64x48: 4 image tokens each with the tiny VLM's processor.
RED, GREEN = png((200, 30, 40)), png((20, 220, 90))
