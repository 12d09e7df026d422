"""A vision-language sample as its model's forward inputs.

A sample's ids hold each image as its placeholder tokens, already expanded (the image token
repeated as many times as the model's image processor gives that image), at the span its
``SampleImage`` records. ``forward_inputs(sample, image_processor, model)`` gives what the
trainer's forward needs to see exactly what the worker saw:

* ``input_ids``: ``prompt_ids + response_ids``, shape (1, L);
* ``pixel_values`` / ``image_grid_thw``: every image, in order, through the model's own image
  processor (the bytes decoded as the worker decodes them: the first frame, in RGB);
* ``mm_token_type_ids``: 1 at the image placeholders, 0 elsewhere;
* ``position_ids``: the M-RoPE positions (3, 1, L) from the model's ``get_rope_index``
  (given a model or that callable); ``verl_position_ids`` turns them into verl's layout
  (1, 4, L): the plain text positions stacked over the three M-RoPE rows.

Each image's span must hold exactly the number of tokens the processor gives the image, and
every image token of the ids must belong to an image: otherwise ``ImageSpanError``, never a
batch whose pixels fill other tokens than the worker's did.

``VisionScorer`` teacher-forces a model with these inputs (the fidelity check's scorer for
samples with images). Needs torch and Pillow.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sdk.exceptions import ImageSpanError

if TYPE_CHECKING:
    from sdk.samples import Sample


class ImageLike(Protocol):
    """An image in a token sequence: ``SampleImage``, or the worker's ``ImageSpan``."""

    @property
    def sha256(self) -> str: ...

    @property
    def data(self) -> bytes | None: ...

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


# pixel_values and image_grid_thw of one image, by sha256.
PixelCache = MutableMapping[str, tuple[Any, Any]]


def decode(image: ImageLike) -> Any:
    """The image as a PIL RGB image (a GIF's first frame), as the worker decodes it; its
    bytes checked against its sha256."""
    from PIL import Image, UnidentifiedImageError

    if image.data is None:
        raise ImageSpanError(
            f"image {image.sha256[:12]} has no bytes: fetch them first (ProxyClient.fill_images)"
        )
    if hashlib.sha256(image.data).hexdigest() != image.sha256.lower():
        raise ImageSpanError(f"image {image.sha256[:12]}: its bytes are not the image named")
    try:
        with Image.open(io.BytesIO(image.data)) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageSpanError(f"image {image.sha256[:12]} cannot be decoded: {exc}") from None


def pixels(
    image: ImageLike, image_processor: Any, cache: PixelCache | None = None
) -> tuple[Any, Any]:
    """The image's ``pixel_values`` and ``image_grid_thw`` from the model's processor."""
    if cache is not None and image.sha256 in cache:
        return cache[image.sha256]
    decoded = decode(image)  # checks the bytes are the image named: the cache trusts the name
    out = image_processor(images=[decoded], return_tensors="pt")
    result = (out["pixel_values"], out["image_grid_thw"])
    if cache is not None:
        cache[image.sha256] = result
    return result


def image_tokens(grid: Any, image_processor: Any) -> int:
    """How many placeholder tokens an image of this grid takes."""
    return int(grid.prod()) // int(image_processor.merge_size) ** 2


def rope_index_of(model: Any) -> Callable[..., Any] | None:
    """The ``get_rope_index`` of a model (its inner model's, for a ``...ForConditional
    Generation``), or ``model`` itself when it is that callable; None for None."""
    if model is None:
        return None
    inner = getattr(model, "model", None)
    for owner in (inner, model):
        found = getattr(owner, "get_rope_index", None)
        if callable(found):
            return found  # type: ignore[no-any-return]
    if callable(model) and not hasattr(model, "parameters"):
        return model  # type: ignore[no-any-return]
    raise TypeError(f"{type(model).__name__} has no get_rope_index (not an M-RoPE model)")


def check_spans(
    ids: Sequence[int], images: Sequence[ImageLike], image_token_id: int | None
) -> int | None:
    """Check that the spans are in order, inside ``ids``, and cover exactly the image tokens
    (each one holding only that token). Returns the image token (None: no image and none
    given)."""
    previous = 0
    for image in images:
        if not previous <= image.start < image.end <= len(ids):
            raise ImageSpanError(
                f"image {image.sha256[:12]}'s span [{image.start}, {image.end}) is not inside "
                f"the {len(ids)} ids after the previous image"
            )
        previous = image.end
    token = image_token_id
    if token is None and images:
        token = ids[images[0].start]
    if token is None:
        return None
    covered = {i for image in images for i in range(image.start, image.end)}
    held = {i for i, t in enumerate(ids) if t == token}
    if covered != held:
        raise ImageSpanError(
            f"the ids' {len(held)} image tokens ({token}) are not where the sample's "
            f"{len(images)} image(s) say they are ({len(covered)} tokens)"
        )
    return token


def vision_inputs(
    ids: Sequence[int],
    images: Sequence[ImageLike],
    image_processor: Any,
    model: Any = None,
    *,
    image_token_id: int | None = None,
    cache: PixelCache | None = None,
) -> dict[str, Any]:
    """``forward_inputs`` for any ids and their images (spans in ``ids``)."""
    import torch

    if image_token_id is None and model is not None:
        config = getattr(model, "config", None)
        image_token_id = getattr(config, "image_token_id", None)
    token = check_spans(ids, images, image_token_id)
    input_ids = torch.tensor([list(ids)], dtype=torch.long)
    types = torch.zeros_like(input_ids, dtype=torch.int)
    inputs: dict[str, Any] = {"input_ids": input_ids}
    values, grids = [], []
    for image in images:
        pixel_values, grid = pixels(image, image_processor, cache)
        tokens = image_tokens(grid, image_processor)
        if tokens != image.end - image.start:
            raise ImageSpanError(
                f"image {image.sha256[:12]} takes {tokens} tokens with this model's image "
                f"processor; the sample holds {image.end - image.start} for it "
                f"(span [{image.start}, {image.end})): not the processor it was sampled with"
            )
        types[0, image.start : image.end] = 1
        values.append(pixel_values)
        grids.append(grid)
    if token is not None or images:
        inputs["mm_token_type_ids"] = types
    if images:
        inputs["pixel_values"] = torch.cat(values)
        inputs["image_grid_thw"] = torch.cat(grids)
    rope_index = rope_index_of(model)
    if rope_index is not None:
        positions, _ = rope_index(
            input_ids,
            mm_token_type_ids=types,
            image_grid_thw=inputs.get("image_grid_thw"),
        )
        inputs["position_ids"] = positions
    return inputs


def forward_inputs(
    sample: Sample,
    image_processor: Any,
    model: Any = None,
    *,
    image_token_id: int | None = None,
    cache: PixelCache | None = None,
) -> dict[str, Any]:
    """The forward inputs of ``sample`` (see the module docstring): ``input_ids``,
    ``mm_token_type_ids``, ``pixel_values`` and ``image_grid_thw`` (when it has images), and
    ``position_ids`` (3, 1, L) when ``model`` (the model, or its ``get_rope_index``) is
    given. ``image_token_id`` defaults to the model's. Raises ``ImageSpanError``."""
    return vision_inputs(
        [*sample.prompt_ids, *sample.response_ids],
        sample.images,
        image_processor,
        model,
        image_token_id=image_token_id,
        cache=cache,
    )


def verl_position_ids(position_ids: Any) -> Any:
    """M-RoPE positions (3, 1, L) in verl's layout (1, 4, L): row 0 the text positions
    0..L-1, then the three M-RoPE rows (what verl's agent loop builds for Qwen2/3-VL)."""
    import torch

    rows, batch, length = position_ids.shape
    if rows != 3 or batch != 1:
        raise ValueError(
            f"expected M-RoPE positions of shape (3, 1, L), got {tuple(position_ids.shape)}"
        )
    text = torch.arange(length, dtype=position_ids.dtype).view(1, 1, length)
    return torch.cat([text, position_ids.transpose(0, 1)], dim=1)


def response_logprobs(model: Any, inputs: dict[str, Any], prompt_length: int) -> list[float]:
    """Teacher forcing: the logprob of each token after the first ``prompt_length`` given
    everything before it, in float32."""
    import torch

    device = getattr(model, "device", None)
    moved = {k: v.to(device) if device is not None else v for k, v in inputs.items()}
    ids = moved["input_ids"]
    with torch.no_grad():
        logits = model(**moved).logits[0].float()
    start = prompt_length - 1
    count = ids.shape[1] - prompt_length
    scores = torch.log_softmax(logits[start : start + count], dim=-1)
    target = ids[0, prompt_length:].unsqueeze(-1)
    return [float(x) for x in scores.gather(-1, target).squeeze(-1)]


class VisionScorer:
    """Re-scores sampled tokens with their images: ``score(prompt_ids, response_ids,
    images)`` (spans in ``prompt_ids + response_ids``, anywhere in it) or
    ``score_sample(sample)``. Decoded pixels are kept by sha256."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        self.model = model
        self.image_processor = image_processor
        self._pixels: dict[str, tuple[Any, Any]] = {}

    def __repr__(self) -> str:
        return f"<VisionScorer {type(self.model).__name__}>"

    def score(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        images: Sequence[ImageLike] = (),
    ) -> list[float]:
        if not prompt_ids:
            raise ValueError("scoring needs at least one prompt token")
        inputs = vision_inputs(
            [*prompt_ids, *response_ids],
            images,
            self.image_processor,
            self.model,
            cache=self._pixels,
        )
        return response_logprobs(self.model, inputs, len(prompt_ids))

    def score_sample(self, sample: Sample) -> list[float]:
        return self.score(sample.prompt_ids, sample.response_ids, sample.images)
