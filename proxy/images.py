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
  anything is decoded, so a small file that claims to be huge costs nothing; an image
  within the limits is then decoded whole off the event loop, a bounded number at once;
* a URL is fetched only when the operator allowed its host (``--image-url-allow``), within
  the byte limit and a time limit, following redirects only to allowed hosts
  (``image_url_not_allowed``, ``image_fetch_failed``): an agent in a sandbox must not be able
  to make the proxy reach inside the cluster.

The same screenshot comes back in every turn's history: ``ImageChecker`` remembers what it
learnt of each image by hash, so an image is decoded once, not every turn.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import enum
import hashlib
import io
import ipaddress
import socket
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from proxy.chat.messages import ImagePart
from proxy.exceptions import ImageError

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

__all__ = [
    "AllowedHost",
    "ImageChecker",
    "ImageData",
    "ImageFetcher",
    "ImageIntake",
    "ImageLimits",
    "MediaType",
    "RemoteImageNeeded",
    "UndecodableImage",
    "parse_data_url",
    "public_address",
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


class UndecodableImage(Exception):
    """Raised by ``ImageChecker.decode`` for an image whose header was taken but whose data
    does not decode (truncated, corrupt): ``error`` is its refusal, for the caller to name
    by where the request holds the image."""

    def __init__(self, sha256: str, error: ImageError) -> None:
        super().__init__(error.message)
        self.sha256 = sha256
        self.error = error


class ImageChecker:
    """Checks images against the limits, remembering (by hash, ``memory`` images at most)
    the format and size of each image it decoded whole, so that a screenshot repeated in
    every turn's history is decoded once.

    Taking an image has two steps: ``check`` reads its header (format, size) and applies
    the limits, cheaply, on the event loop; ``decode`` then decodes the images not decoded
    before, off the event loop (see ``DECODERS``), to refuse truncated or corrupt ones."""

    def __init__(self, limits: ImageLimits, memory: int = 4096) -> None:
        self.limits = limits
        self.memory = memory
        self._known: OrderedDict[str, tuple[MediaType, int, int]] = OrderedDict()
        # Decodes under way, by sha256: a request that brings an image being decoded for
        # another waits for that decode.
        self._decoding: dict[str, asyncio.Future[None]] = {}

    def __repr__(self) -> str:
        return f"<ImageChecker {len(self._known)} known>"

    def check_count(self, count: int) -> None:
        if self.limits.max_images and count > self.limits.max_images:
            raise ImageError(
                f"the request has {count} images; at most {self.limits.max_images} are taken",
                code="too_many_images",
            )

    def check(self, data: bytes) -> ImageData:
        """What ``data`` is by its header, or an ``ImageError`` saying why it is not taken.
        Nothing is decoded: whether the whole image decodes is for ``decode`` to say (an
        image decoded before is known whole)."""
        if self.limits.max_bytes and len(data) > self.limits.max_bytes:
            raise ImageError(
                f"an image of {len(data)} bytes is over the limit of {self.limits.max_bytes}",
                code="image_too_large",
            )
        digest = hashlib.sha256(data).hexdigest()
        known = self._known.get(digest)
        if known is None:
            known = _header(data, self.limits.max_pixels)
        else:
            self._known.move_to_end(digest)
        media_type, width, height = known
        return ImageData(digest, media_type, width, height, data)

    async def take(self, data: bytes) -> ImageData:
        """``check`` and ``decode`` one image."""
        image = self.check(data)
        try:
            await self.decode([image])
        except UndecodableImage as bad:
            raise bad.error from None
        return image

    async def decode(self, images: Iterable[ImageData]) -> None:
        """Decode, off the event loop, each of ``images`` not decoded before; raises
        ``UndecodableImage`` for one that does not decode whole."""
        pending = {i.sha256: i for i in images if i.sha256 not in self._known}
        if not pending:
            return
        results = await asyncio.gather(
            *(self._decode(image) for image in pending.values()), return_exceptions=True
        )
        for image, result in zip(pending.values(), results, strict=True):
            if isinstance(result, ImageError):
                raise UndecodableImage(image.sha256, result)
            if isinstance(result, BaseException):
                raise result
            self._known[image.sha256] = (image.media_type, image.width, image.height)
            while len(self._known) > self.memory:
                self._known.popitem(last=False)

    async def _decode(self, image: ImageData) -> None:
        running = self._decoding.get(image.sha256)
        if running is None:
            running = asyncio.get_running_loop().run_in_executor(
                _decoders(), _decode_whole, image.data
            )
            self._decoding[image.sha256] = running
            running.add_done_callback(lambda _: self._decoding.pop(image.sha256, None))
        # A request that leaves does not stop a decode another request may be waiting for.
        await asyncio.shield(running)


# At most this many images decode at once, each in a thread of its own, off the event loop
# (Pillow's decoders release the GIL): a decode holds the whole image, up to
# --max-image-pixels x 4 bytes (256 MB at the default limit), so this bounds the memory
# decoding takes as well as the cores. The header check before it costs next to nothing.
DECODERS = 2
_decoder_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _decoders() -> concurrent.futures.ThreadPoolExecutor:
    global _decoder_pool
    if _decoder_pool is None:
        _decoder_pool = concurrent.futures.ThreadPoolExecutor(
            DECODERS, thread_name_prefix="image-decode"
        )
    return _decoder_pool


def _open(data: bytes) -> PILImage:
    """``data`` opened (only its header is read) as one of the formats taken, by Pillow's
    readers of those formats alone: no other reader looks at an agent's bytes."""
    from PIL import Image

    return Image.open(io.BytesIO(data), formats=list(_FORMATS))


def _header(data: bytes, max_pixels: int) -> tuple[MediaType, int, int]:
    """The format and size ``data``'s header gives, within ``max_pixels``."""
    from PIL import Image, UnidentifiedImageError

    _keep_pillow_cap_at_least(max_pixels)
    try:
        with _open(data) as image:
            media_type = _FORMATS.get(image.format or "")
            width, height = image.size
            if media_type is None:  # a reader of a format taken read it as another
                raise ImageError(
                    f"images in {image.format} are not taken; send PNG, JPEG, WebP or GIF",
                    code="unsupported_image_format",
                )
    except UnidentifiedImageError:
        other = _other_format(data)
        if other is not None:
            raise ImageError(
                f"images in {other} are not taken; send PNG, JPEG, WebP or GIF",
                code="unsupported_image_format",
            ) from None
        raise ImageError("the image data is not an image that can be read") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own cap, never below the limit: the header claims far more pixels.
        raise ImageError(
            f"an image of more than {Image.MAX_IMAGE_PIXELS} pixels is over the limit of "
            f"{max_pixels or Image.MAX_IMAGE_PIXELS} pixels",
            code="image_too_large",
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the image data is corrupt: {exc}") from None
    if max_pixels and width * height > max_pixels:
        raise ImageError(
            f"an image of {width}x{height} pixels is over the limit of {max_pixels} pixels",
            code="image_too_large",
        )
    return media_type, width, height


def _decode_whole(data: bytes) -> None:
    """Decode ``data`` whole (its first frame), or raise an ``ImageError``: not truncated,
    not corrupt. Runs in a decoder thread, after ``_header`` took the image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with _open(data) as image:
            image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image data is not an image that can be read: {exc}") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the image data is corrupt: {exc}") from None


def _keep_pillow_cap_at_least(max_pixels: int) -> None:
    """Pillow refuses, as it opens them, images of more than twice its own cap
    (``Image.MAX_IMAGE_PIXELS``, ~89 million; a ``DecompressionBombError`` in its words). The
    cap is raised to the proxy's limit where the limit is higher, so that Pillow never
    refuses an image the limit takes: the limit decides, and says so. It is never lowered
    (it is the whole process's)."""
    from PIL import Image

    cap = Image.MAX_IMAGE_PIXELS
    if max_pixels and cap is not None and cap < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels


def _other_format(data: bytes) -> str | None:
    """The image format not taken whose signature ``data`` starts with (BMP, TIFF, ...),
    told by Pillow's signature checks alone: the bytes are not parsed."""
    from PIL import Image

    Image.init()
    prefix = data[:16]
    for name in Image.ID:
        accept = Image.OPEN[name][1]
        if name in _FORMATS or accept is None:
            continue
        try:
            if accept(prefix):
                return name
        except Exception:  # a signature check that cannot read a prefix this short
            continue
    return None


# The port a URL of each scheme reaches when the allowed host names none.
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(slots=True, frozen=True)
class AllowedHost:
    """One entry of ``--image-url-allow``: a host name (or, starting with a dot, every
    subdomain of one) and the port allowed on it (None: the scheme's own, 80 or 443)."""

    name: str
    port: int | None = None

    @classmethod
    def parse(cls, entry: str) -> AllowedHost:
        """``host``, ``.example.org``, ``host:8080``, ``[::1]:8080``; raises ValueError."""
        text = entry.strip().lower()
        name, port = text, None
        if text.startswith("["):
            name, bracket, rest = text[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"image URL host {entry!r}: expected [address]:port")
            port = rest[1:] or None
        elif text.count(":") == 1:
            name, _, port = text.partition(":")
        if not name or any(c in name for c in "/@?#\\ "):
            raise ValueError(f"image URL host {entry!r} is not a host name")
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"image URL host {entry!r}: the port must be 1 to 65535")
        return cls(name, int(port) if port is not None else None)

    def matches(self, url: URL) -> bool:
        host = (url.host or "").lower()
        if self.name.startswith("."):
            named = host.endswith(self.name) and len(host) > len(self.name)
        else:
            named = host == self.name
        wanted = self.port if self.port is not None else _DEFAULT_PORTS.get(url.scheme)
        return named and url.port == wanted


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix, RFC 6052
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # local use, RFC 8215
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated, RFC 4291


def _spelled_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address is only another spelling of: IPv4-mapped,
    NAT64 (well-known prefix) or IPv4-compatible."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or ip in _IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _tunnelled_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address a tunnelled IPv6 address reaches: 6to4's, or Teredo's client
    (``ipaddress`` undoes its XOR)."""
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def public_address(address: str) -> bool:
    """Whether ``address`` (an IP address) is on the public internet: not loopback,
    private, link-local (where cloud metadata services answer, 169.254.169.254), shared,
    reserved, multicast or unspecified. An IPv6 spelling of an IPv4 address (IPv4-mapped,
    NAT64, IPv4-compatible) is judged as that address; a tunnelled one (6to4, Teredo) is
    public only if the IPv4 address it reaches is too; the local-use NAT64 prefix never
    is. ``ipaddress``'s registry of special-purpose ranges decides."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])  # an IPv6 zone is no part
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        tunnelled = _tunnelled_ipv4(ip)
        if tunnelled is not None and not public_address(str(tunnelled)):
            return False
        spelled = _spelled_ipv4(ip)
        if spelled is not None:
            ip = spelled
    return ip.is_global and not ip.is_multicast


class _AddressRefused(OSError):
    """A host name resolved to no public address (raised inside aiohttp's connector)."""


class _PublicResolver(AbstractResolver):
    """aiohttp's resolver, keeping only the public addresses a name resolves to: the
    connection is made to an address checked here, never to one looked up again."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        public = [entry for entry in found if public_address(entry["host"])]
        if not public:
            raise _AddressRefused(f"{host} resolves to no public address")
        return public

    async def close(self) -> None:
        await self._inner.close()


class ImageFetcher:
    """Fetches ``http(s)`` image URLs from the hosts the operator allowed, and from no
    other: a host is allowed by its exact name, or by a leading-dot suffix (``.example.org``
    allows every subdomain), on the port its scheme uses (80, 443) unless the entry names
    one (``host:8080``). The address connected to is public (its name is resolved and
    checked, and the connection made to the address checked), unless
    ``private_addresses`` (tests on loopback; a host on the operator's own network).
    Redirects are followed by hand, each hop checked alike, and never from https to
    http."""

    def __init__(
        self,
        allow: Iterable[str],
        checker: ImageChecker,
        *,
        timeout_seconds: float = 10.0,
        max_redirects: int = 3,
        private_addresses: bool = False,
    ) -> None:
        self.allow = tuple(AllowedHost.parse(entry) for entry in allow if entry.strip())
        self.checker = checker
        self.timeout_seconds = timeout_seconds
        self.max_redirects = max_redirects
        self.private_addresses = private_addresses

    def __repr__(self) -> str:
        shown = [f"{a.name}:{a.port}" if a.port else a.name for a in self.allow]
        return f"<ImageFetcher allow={shown}>"

    def allows(self, url: URL) -> bool:
        return self.refusal(url) is None

    def refusal(self, url: URL, came_from: URL | None = None) -> str | None:
        """Why ``url`` (reached by a redirect from ``came_from``) is not fetched, or None:
        decided before anything is sent."""
        host = url.host or ""
        if (
            url.scheme not in _DEFAULT_PORTS
            or not host
            or not any(entry.matches(url) for entry in self.allow)
        ):
            return (
                "the proxy fetches images only from the hosts and ports its operator "
                "allowed (--image-url-allow); send the image as base64"
            )
        if came_from is not None and came_from.scheme == "https" and url.scheme != "https":
            return "a redirect from https to http is not followed"
        if not self.private_addresses and _is_address(host) and not public_address(host):
            return "the proxy fetches images from public addresses only"
        return None

    async def fetch(self, text: str) -> ImageData:
        """The image at ``text``, or an ``ImageError``; nothing is sent to a host that is
        not allowed."""
        try:
            url = URL(text)
        except ValueError as exc:
            raise ImageError(f"the image URL is not a valid URL: {exc}") from None
        refusal = self.refusal(url)
        if refusal is not None:
            raise ImageError(
                f"image URL {_shown(url)} is not fetched: {refusal}", code="image_url_not_allowed"
            )
        timeout = aiohttp.ClientTimeout(total=self.timeout_seconds)
        limit = self.checker.limits.max_bytes
        resolver = None if self.private_addresses else _PublicResolver()
        connector = aiohttp.TCPConnector(resolver=resolver)
        try:
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                for _ in range(self.max_redirects + 1):
                    async with session.get(url, allow_redirects=False) as response:
                        if response.status in (301, 302, 303, 307, 308):
                            url = self._redirect(url, response.headers.get("Location", ""))
                            continue
                        if response.status != 200:
                            raise ImageError(
                                f"image URL {_shown(url)} answered {response.status}",
                                code="image_fetch_failed",
                            )
                        data = await _read(response, url, limit)
                        return await self.checker.take(data)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, _AddressRefused):
                raise ImageError(
                    f"image URL {_shown(url)} is not fetched: its host resolves to no public "
                    "address, and the proxy fetches images from public addresses only",
                    code="image_url_not_allowed",
                ) from None
            raise _fetch_failed(url, exc) from None
        except aiohttp.InvalidURL:
            raise ImageError(
                f"image URL {_shown(url)} is not a valid URL", code="image_url_not_allowed"
            ) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _fetch_failed(url, exc) from None
        raise ImageError(
            f"image URL {_shown(url)} redirects more than {self.max_redirects} times",
            code="image_fetch_failed",
        )

    def _redirect(self, url: URL, location: str) -> URL:
        """Where a redirect from ``url`` leads, if it may be followed."""
        try:
            target = url.join(URL(location))
        except ValueError:
            raise ImageError(
                f"image URL {_shown(url)} redirects to an invalid URL",
                code="image_url_not_allowed",
            ) from None
        refusal = self.refusal(target, came_from=url)
        if refusal is not None:
            raise ImageError(
                f"image URL {_shown(url)} redirects to {_shown(target)}, which is not "
                f"fetched: {refusal}",
                code="image_url_not_allowed",
            )
        return target


def _fetch_failed(url: URL, exc: BaseException) -> ImageError:
    return ImageError(
        f"image URL {_shown(url)} could not be fetched: {type(exc).__name__}",
        code="image_fetch_failed",
    )


def _is_address(host: str) -> bool:
    """Whether ``host`` is an IP address rather than a name (aiohttp connects to one
    without resolving it)."""
    try:
        ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    return True


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
    their headers checked (the caller decodes them, ``ImageChecker.decode``). ``fetched``
    holds the request's remote images already fetched (and decoded), by URL."""

    def __init__(self, checker: ImageChecker) -> None:
        self.checker = checker
        self.images: dict[str, ImageData] = {}
        self.fetched: dict[str, ImageData] = {}
        # Images whose header was taken but whose data did not decode, by sha256: raised
        # where the request holds them when its messages are converted again.
        self.refused: dict[str, ImageError] = {}

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
        image = self.checker.check(data)
        refused = self.refused.get(image.sha256)
        if refused is not None:
            raise refused
        return self._took(image)

    def _took(self, image: ImageData) -> ImagePart:
        self.images[image.sha256] = image
        return ImagePart(image.sha256, image.media_type.value, image.width, image.height)
