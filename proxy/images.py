"""Images as agents send them, taken or refused before anything is recorded.

An agent sends an image as base64 (a ``data:`` URL in Chat Completions and Responses, a
``base64`` source in Anthropic Messages) or, rarely, as an ``http(s)`` URL. Either way the
proxy ends up with the bytes, and keeps them exactly as sent: their sha256 names the image
in the export and in the store, and a trainer re-reads the same bytes.

What is checked, each refusal an ``ImageError`` (400) whose ``code`` says why:

* the base64 is valid (``invalid_image``);
* the bytes are one of the formats every engine reads: PNG, JPEG, WebP, GIF (its first frame
  is the image) (``unsupported_image_format``, ``invalid_image`` for bytes that are no image
  or a truncated one);
* bytes per image, pixels per image and images per request stay within ``ImageLimits``
  (``image_too_large``, ``too_many_images``); the pixel count is read from the header before
  anything is decoded, so a small file that claims to be huge costs nothing;
* a URL is fetched only when the operator allowed its host (``--image-url-allow``), within
  the byte limit and a time limit, following redirects only to allowed hosts
  (``image_url_not_allowed``, ``image_fetch_failed``): an agent in a sandbox must not be able
  to make the proxy reach inside the cluster.

The same screenshot comes back in every turn's history: ``ImageChecker`` remembers what it
learnt of each image by hash, so an image is decoded once, not every turn.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import io
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from yarl import URL

from proxy.chat.messages import ImagePart
from proxy.exceptions import ImageError

__all__ = [
    "ImageChecker",
    "ImageData",
    "ImageFetcher",
    "ImageIntake",
    "ImageLimits",
    "MediaType",
    "RemoteImageNeeded",
    "parse_data_url",
]


class MediaType(enum.StrEnum):
    """The image formats taken, by the media type they are recorded and served with."""

    PNG = "image/png"
    JPEG = "image/jpeg"
    WEBP = "image/webp"
    GIF = "image/gif"


# Pillow's format names for the formats taken.
_FORMATS = {
    "PNG": MediaType.PNG,
    "JPEG": MediaType.JPEG,
    "WEBP": MediaType.WEBP,
    "GIF": MediaType.GIF,
}


@dataclass(slots=True, frozen=True)
class ImageLimits:
    """What one request may carry (each limit as a flag of ``rollout-relay proxy``). The
    defaults follow what the agent APIs themselves take: 20 MiB and 8000×8000 pixels an
    image, 100 images a request."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 8000 * 8000
    max_images: int = 100


@dataclass(slots=True, frozen=True)
class ImageData:
    """An image taken: its bytes as the agent sent them, their sha256 (hex), the media type
    of what the bytes are (whatever the agent declared), and its size in pixels."""

    sha256: str
    media_type: MediaType
    width: int
    height: int
    data: bytes

    def __repr__(self) -> str:
        return (
            f"<ImageData {self.sha256[:12]} {self.media_type.value} "
            f"{self.width}x{self.height} {len(self.data)} B>"
        )


def parse_data_url(url: str) -> tuple[str, bytes]:
    """The declared media type and the bytes of a ``data:`` URL (RFC 2397); only base64
    data is an image."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:"):
        raise ImageError("an image data URL must look like data:image/png;base64,...")
    params = header[len("data:") :].split(";")
    if "base64" not in params[1:]:
        raise ImageError("an image data URL must be base64 (data:<type>;base64,<data>)")
    return params[0].strip().lower(), decode_base64(payload)


def decode_base64(payload: str) -> bytes:
    """Strict base64 (RFC 4648): anything but the alphabet and padding is refused, so that
    corrupt data is not silently turned into other bytes."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the image's base64 data is not valid: {exc}") from None


class ImageChecker:
    """Checks images against the limits, remembering (by hash, ``memory`` images at most)
    the format and size of each image it took, so that a screenshot repeated in every
    turn's history is decoded once."""

    def __init__(self, limits: ImageLimits, memory: int = 4096) -> None:
        self.limits = limits
        self.memory = memory
        self._known: OrderedDict[str, tuple[MediaType, int, int]] = OrderedDict()

    def __repr__(self) -> str:
        return f"<ImageChecker {len(self._known)} known>"

    def check_count(self, count: int) -> None:
        if self.limits.max_images and count > self.limits.max_images:
            raise ImageError(
                f"the request has {count} images; at most {self.limits.max_images} are taken",
                code="too_many_images",
            )

    def check(self, data: bytes) -> ImageData:
        """The image ``data`` is, or an ``ImageError`` saying why it is not taken."""
        if self.limits.max_bytes and len(data) > self.limits.max_bytes:
            raise ImageError(
                f"an image of {len(data)} bytes is over the limit of {self.limits.max_bytes}",
                code="image_too_large",
            )
        digest = hashlib.sha256(data).hexdigest()
        known = self._known.get(digest)
        if known is None:
            known = self._inspect(data)
            self._known[digest] = known
            while len(self._known) > self.memory:
                self._known.popitem(last=False)
        else:
            self._known.move_to_end(digest)
        media_type, width, height = known
        return ImageData(digest, media_type, width, height, data)

    def _inspect(self, data: bytes) -> tuple[MediaType, int, int]:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as image:
                media_type = _FORMATS.get(image.format or "")
                if media_type is None:
                    raise ImageError(
                        f"images in {image.format} are not taken; send PNG, JPEG, WebP or GIF",
                        code="unsupported_image_format",
                    )
                width, height = image.size
                if self.limits.max_pixels and width * height > self.limits.max_pixels:
                    raise ImageError(
                        f"an image of {width}x{height} pixels is over the limit of "
                        f"{self.limits.max_pixels} pixels",
                        code="image_too_large",
                    )
                image.load()  # the whole image decodes: not truncated, not corrupt
        except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
            raise ImageError(f"the image data is not an image that can be read: {exc}") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageError(f"the image data is corrupt: {exc}") from None
        return media_type, width, height


class ImageFetcher:
    """Fetches ``http(s)`` image URLs from the hosts the operator allowed, and from no
    other: a host is allowed by its exact name, or by a leading-dot suffix (``.example.org``
    allows every subdomain). Redirects are followed by hand, each hop's host checked."""

    def __init__(
        self,
        allow: Iterable[str],
        checker: ImageChecker,
        *,
        timeout_seconds: float = 10.0,
        max_redirects: int = 3,
    ) -> None:
        self.allow = frozenset(host.strip().lower() for host in allow if host.strip())
        self.checker = checker
        self.timeout_seconds = timeout_seconds
        self.max_redirects = max_redirects

    def __repr__(self) -> str:
        return f"<ImageFetcher allow={sorted(self.allow)}>"

    def allows(self, url: URL) -> bool:
        host = (url.host or "").lower()
        if url.scheme not in ("http", "https") or not host:
            return False
        return host in self.allow or any(
            pattern.startswith(".") and host.endswith(pattern) for pattern in self.allow
        )

    async def fetch(self, text: str) -> ImageData:
        """The image at ``text``, or an ``ImageError``; nothing is sent to a host that is
        not allowed."""
        url = URL(text)
        if not self.allows(url):
            raise ImageError(
                f"image URL {_shown(url)} is not fetched: the proxy fetches images only from "
                "hosts its operator allowed (--image-url-allow); send the image as base64",
                code="image_url_not_allowed",
            )
        timeout = aiohttp.ClientTimeout(total=self.timeout_seconds)
        limit = self.checker.limits.max_bytes
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for _ in range(self.max_redirects + 1):
                    async with session.get(url, allow_redirects=False) as response:
                        if response.status in (301, 302, 303, 307, 308):
                            target = url.join(URL(response.headers.get("Location", "")))
                            if not self.allows(target):
                                raise ImageError(
                                    f"image URL {_shown(url)} redirects to {_shown(target)}, "
                                    "a host the proxy may not fetch from",
                                    code="image_url_not_allowed",
                                )
                            url = target
                            continue
                        if response.status != 200:
                            raise ImageError(
                                f"image URL {_shown(url)} answered {response.status}",
                                code="image_fetch_failed",
                            )
                        return self.checker.check(await _read(response, url, limit))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ImageError(
                f"image URL {_shown(url)} could not be fetched: {type(exc).__name__}",
                code="image_fetch_failed",
            ) from None
        raise ImageError(
            f"image URL {_shown(url)} redirects more than {self.max_redirects} times",
            code="image_fetch_failed",
        )


async def _read(response: aiohttp.ClientResponse, url: URL, limit: int) -> bytes:
    """The body, refused as soon as it passes ``limit`` bytes (0: no limit)."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if limit and len(body) > limit:
            raise ImageError(
                f"the image at {_shown(url)} is over the limit of {limit} bytes",
                code="image_too_large",
            )
    return bytes(body)


def _shown(url: URL) -> str:
    """A URL as errors show it: no credentials, no query (they may carry tokens)."""
    bare = url.with_query(None).with_fragment(None)
    return str(bare.with_user(None) if bare.host else bare)


class RemoteImageNeeded(Exception):
    """Raised while a request's messages are converted, for an ``http(s)`` image URL not
    fetched yet: conversion is synchronous, so the caller fetches it (``ImageFetcher``)
    and converts again with the image at hand."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url
        self.where: str | None = None  # where the request holds it, for a refusal to name


class ImageIntake:
    """One request's images, taken as its messages are converted: each image part becomes
    an ``ImagePart`` (the message's reference, by hash) and its bytes land in ``images``,
    checked. ``fetched`` holds the request's remote images already fetched, by URL."""

    def __init__(self, checker: ImageChecker) -> None:
        self.checker = checker
        self.images: dict[str, ImageData] = {}
        self.fetched: dict[str, ImageData] = {}

    def __repr__(self) -> str:
        return f"<ImageIntake {len(self.images)} images>"

    def url(self, url: str) -> ImagePart:
        """An image given by URL: a ``data:`` URL, or an ``http(s)`` URL (fetched by the
        caller, see ``RemoteImageNeeded``)."""
        text = url.strip()
        scheme = text.partition(":")[0].lower()
        if scheme == "data":
            return self.bytes(parse_data_url(text)[1])
        if scheme in ("http", "https"):
            fetched = self.fetched.get(text)
            if fetched is None:
                raise RemoteImageNeeded(text)
            return self._took(fetched)
        raise ImageError(
            f"an image URL must be a data: URL (or an http(s) URL the operator allowed), "
            f"not {scheme or 'empty'!r}"
        )

    def base64(self, payload: str) -> ImagePart:
        """An image given as base64 text (Anthropic's ``base64`` source)."""
        return self.bytes(decode_base64(payload))

    def bytes(self, data: bytes) -> ImagePart:
        return self._took(self.checker.check(data))

    def _took(self, image: ImageData) -> ImagePart:
        self.images[image.sha256] = image
        return ImagePart(image.sha256, image.media_type.value, image.width, image.height)
