"""Taking a request's images while its messages are converted (every agent API alike).

Conversion is synchronous and reuses what the session's history memory converted before;
this loop around it fetches the remote images conversion asks for, counts the request's
images, decodes the new ones off the event loop (conversion reads only their headers), and
makes sure the bytes of every image the messages name are at hand: taken by this request,
or recorded by an earlier turn of the session. A message the memory kept
from a request that was refused before its turn was recorded names an image whose bytes
were never kept; the memory is then forgotten and the body converted whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol, TypeVar

from proxy.chat.messages import ChatMessage, ImagePart
from proxy.exceptions import BadRequestError, ImageError
from proxy.images import (
    ImageChecker,
    ImageData,
    ImageFetcher,
    ImageIntake,
    RemoteImageNeeded,
    UndecodableImage,
)
from proxy.sessions.model import Session

__all__ = ["ImageSources", "image_at", "message_parts", "take_images"]

F = TypeVar("F")


@contextmanager
def image_at(where: str) -> Iterator[None]:
    """An image refused inside the block is named by where it is in the request
    (``messages.3.content.1: ...``), its code kept."""
    try:
        yield
    except ImageError as exc:
        raise ImageError(f"{where}: {exc.message}", code=exc.code) from None
    except RemoteImageNeeded as need:
        need.where = need.where or where  # a refused fetch names it too
        raise


# The part types whose ``text`` is a message's text, in the OpenAI-style APIs.
TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


class _Part(Protocol):
    @property
    def type(self) -> str: ...

    @property
    def text(self) -> str | None: ...


P = TypeVar("P", bound=_Part)


def text_and_images(
    content: Sequence[P], where: str, image_type: str, image: Callable[[P, str], ImagePart]
) -> tuple[str, tuple[str | ImagePart, ...]]:
    """A list content's text, and its text and images in order (``message_parts``): a part
    of ``image_type`` becomes ``image(part, its place)``, a text part its text; any other
    part is refused, named by its place under ``where``."""
    texts: list[str] = []
    parts: list[str | ImagePart] = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        if part.type == image_type:
            parts.append(image(part, at))
        elif part.type in TEXT_PARTS and part.text is not None:
            texts.append(part.text)
            parts.append(part.text)
        else:
            raise BadRequestError(
                f"{at}: only text and {image_type} parts are supported, got {part.type!r}",
                code="unsupported_content",
            )
    return "".join(texts), message_parts(parts)


def message_parts(parts: Sequence[str | ImagePart]) -> tuple[str | ImagePart, ...]:
    """A message's ``parts``: its text and images in order, or nothing for a message of
    text only (whose context key then stays what it always was)."""
    if any(isinstance(part, ImagePart) for part in parts):
        return tuple(parts)
    return ()


@dataclass(slots=True, frozen=True)
class ImageSources:
    """How a proxy takes images: its limits, and the hosts it may fetch from."""

    checker: ImageChecker
    fetcher: ImageFetcher


async def take_images(
    sources: ImageSources,
    session: Session,
    parse: Callable[[ImageIntake], tuple[F, list[ChatMessage]]],
) -> tuple[F, list[ChatMessage], dict[str, ImageData]]:
    """``parse(intake)`` run until every image it names is at hand: the request's fields,
    its internal messages, and the images it brought. Raises ``ImageError`` for an image
    refused, fetched from a host not allowed, or one too many."""
    intake = ImageIntake(sources.checker)
    limit = sources.checker.limits.max_images
    forgot = False
    while True:
        try:
            fields, messages = parse(intake)
        except RemoteImageNeeded as need:
            if limit and len(intake.fetched) >= limit:
                sources.checker.check_count(len(intake.fetched) + 1)
            with image_at(need.where) if need.where else nullcontext():
                intake.fetched[need.url] = await sources.fetcher.fetch(need.url)
            continue
        named = [image for message in messages for image in message.images]
        if not named:
            return fields, messages, {}
        sources.checker.check_count(len(named))
        held = session.images
        if all(i.sha256 in intake.images or i.sha256 in held for i in named):
            try:
                # Off the event loop; an image the session recorded was decoded then.
                await sources.checker.decode(
                    image for sha, image in intake.images.items() if sha not in held
                )
            except UndecodableImage as bad:
                if bad.sha256 in intake.refused:  # pragma: no cover - named where it is
                    raise bad.error from None
                # Converted again, the request raises the refusal where it holds the
                # image (the memory, which may have kept its message, converts it anew).
                intake.refused[bad.sha256] = bad.error
                session.history.forget()
                continue
            return fields, messages, intake.images
        if forgot:  # pragma: no cover - a whole conversion takes every image it names
            raise ImageError("an image of the request could not be read again")
        session.history.forget()
        forgot = True
