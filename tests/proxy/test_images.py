"""Images taken or refused before anything is recorded: formats, strict base64, limits on
bytes, pixels and count, corrupt data, and URLs fetched only from allowed hosts, redirects
included."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from PIL import Image, ImageFile

from proxy.exceptions import ImageError
from proxy.images import (
    DECODERS,
    ImageChecker,
    ImageFetcher,
    ImageLimits,
    MediaType,
    parse_data_url,
    public_address,
)
from tests.proxy.image_host import ImageHost, encoded, image_host


def checker(**limits: int) -> ImageChecker:
    return ImageChecker(ImageLimits(**limits))


@pytest.mark.parametrize(
    ("fmt", "media_type"),
    [
        ("PNG", MediaType.PNG),
        ("JPEG", MediaType.JPEG),
        ("WEBP", MediaType.WEBP),
        ("GIF", MediaType.GIF),
    ],
)
def test_the_four_formats_are_taken_as_sent(fmt: str, media_type: MediaType) -> None:
    """PNG, JPEG, WebP and GIF are taken with their size, their media type read from the
    bytes, and the bytes kept exactly (their sha256 names the image)."""
    data = encoded((64, 48), fmt)
    image = checker().check(data)
    assert (image.media_type, image.width, image.height) == (media_type, 64, 48)
    assert image.data == data
    assert image.sha256 == hashlib.sha256(data).hexdigest()


def test_an_animated_gif_is_taken() -> None:
    """An animated GIF is an image (engines read its first frame)."""
    assert checker().check(encoded(fmt="GIF", frames=3)).media_type is MediaType.GIF


@pytest.mark.parametrize("fmt", ["BMP", "TIFF"])
def test_other_formats_are_refused(fmt: str) -> None:
    """Formats not every engine reads are refused, saying which formats are taken."""
    with pytest.raises(ImageError, match="PNG, JPEG, WebP or GIF") as caught:
        checker().check(encoded(fmt=fmt))
    assert caught.value.code == "unsupported_image_format"
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"this is text, not an image", "not an image"),
        (encoded()[: len(encoded()) // 2], "corrupt"),
        (b"", "not an image"),
    ],
    ids=["text", "truncated", "empty"],
)
async def test_bytes_that_are_no_whole_image_are_refused(data: bytes, match: str) -> None:
    """Bytes that are not an image, and an image cut short, are refused."""
    with pytest.raises(ImageError, match=match) as caught:
        await checker().take(data)
    assert caught.value.code == "invalid_image"


def test_the_limits_on_bytes_pixels_and_count() -> None:
    """An image over the byte or pixel limit, and a request over the count, are refused
    with the limit named; at the limits they are taken."""
    data = encoded((64, 48))
    assert checker(max_bytes=len(data)).check(data).width == 64
    with pytest.raises(ImageError, match=f"limit of {len(data) - 1}") as caught:
        checker(max_bytes=len(data) - 1).check(data)
    assert caught.value.code == "image_too_large"
    assert checker(max_pixels=64 * 48).check(data).height == 48
    with pytest.raises(ImageError, match="64x48 pixels") as caught:
        checker(max_pixels=64 * 48 - 1).check(data)
    assert caught.value.code == "image_too_large"
    checker(max_images=3).check_count(3)
    with pytest.raises(ImageError, match="4 images") as caught:
        checker(max_images=3).check_count(4)
    assert caught.value.code == "too_many_images"


def test_the_pixel_limit_is_read_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header that claims too many pixels is refused without decoding the image."""
    data = encoded((640, 480))
    decoded: list[bool] = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(True))
    with pytest.raises(ImageError, match="over the limit"):
        checker(max_pixels=100).check(data)
    assert decoded == []


async def test_an_image_seen_before_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bytes in a later turn's history are taken from memory, neither opened nor
    decoded again; other bytes are, and the memory keeps only the most recent images."""
    opened: list[int] = []
    decoded: list[int] = []
    real_open, real_load = Image.open, ImageFile.ImageFile.load

    def counting_open(*args: Any, **kwargs: Any) -> Image.Image:
        opened.append(1)
        return real_open(*args, **kwargs)

    def counting_load(self: ImageFile.ImageFile) -> Any:
        decoded.append(1)
        return real_load(self)

    first, second, third = encoded((10, 10)), encoded((11, 11)), encoded((12, 12))
    monkeypatch.setattr(Image, "open", counting_open)
    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    memory = ImageChecker(ImageLimits(), memory=2)
    for data in (first, first, second, first, third, first, second):
        await memory.take(data)
    # first, second, (first remembered), third evicts second, (first), second again:
    # each of the four opened for its header, then to decode.
    assert len(decoded) == 4
    assert len(opened) == 8


async def test_decoding_runs_off_the_event_loop_two_images_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Images are decoded in threads, never on the event loop's, and no more than
    ``DECODERS`` at once (what decoding holds in memory is bounded with them)."""
    real_load = ImageFile.ImageFile.load
    threads: set[int] = set()
    running: list[int] = [0, 0]  # now, most at once

    def watched_load(self: ImageFile.ImageFile) -> Any:
        threads.add(threading.get_ident())
        running[0] += 1
        running[1] = max(running[1], running[0])
        try:
            time.sleep(0.05)
            return real_load(self)
        finally:
            running[0] -= 1

    monkeypatch.setattr(ImageFile.ImageFile, "load", watched_load)
    taking = checker()
    images = await asyncio.gather(*(taking.take(encoded((20 + i, 20))) for i in range(6)))
    assert [i.width for i in images] == [20 + i for i in range(6)]
    assert threads
    assert threading.get_ident() not in threads
    assert running[1] <= DECODERS


async def test_a_pixel_limit_above_pillows_own_cap_is_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pillow refuses images over twice its own cap as it opens them; a limit above that
    cap takes the images it allows, and one over the limit is refused by the limit
    (``image_too_large``), never as an unreadable image in Pillow's words."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    data = encoded((64, 48))  # 3072 pixels: more than twice the cap
    assert (await checker(max_pixels=64 * 48).take(data)).width == 64
    for limit, size in ((2000, (64, 48)), (2000, (100, 100))):
        with pytest.raises(ImageError, match="over the limit of 2000 pixels") as caught:
            await checker(max_pixels=limit).take(encoded(size))
        assert caught.value.code == "image_too_large"


def test_only_the_readers_of_the_formats_taken_read_an_agents_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A BMP is refused as a format not taken, told by its signature: Pillow's BMP
    reader never parses it."""
    Image.init()
    factory, accept = Image.OPEN["BMP"]
    parsed: list[int] = []

    def spy(*args: Any) -> Any:
        parsed.append(1)
        return factory(*args)

    monkeypatch.setitem(Image.OPEN, "BMP", (spy, accept))
    with pytest.raises(ImageError, match="BMP") as caught:
        checker().check(encoded(fmt="BMP"))
    assert caught.value.code == "unsupported_image_format"
    assert parsed == []


@pytest.mark.parametrize(
    ("url", "media", "match"),
    [
        ("data:image/png;base64,!!notbase64!!", None, "base64 data is not valid"),
        ("data:image/png;base64,iVBORw0KGgo", None, "base64 data is not valid"),
        ("data:image/png,rawbytes", None, "must be base64"),
        ("image/png;base64,AAAA", None, "must look like"),
    ],
)
def test_bad_data_urls_are_refused(url: str, media: str | None, match: str) -> None:
    """A data URL that is not strict base64 (bad characters, bad padding) or not base64
    at all is refused, not decoded into other bytes."""
    with pytest.raises(ImageError, match=match):
        parse_data_url(url)


def test_a_data_url_gives_its_bytes() -> None:
    """A good data URL gives the declared type and exactly the encoded bytes."""
    data = encoded()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert parse_data_url(url) == ("image/png", data)


@pytest.fixture
async def host() -> AsyncIterator[ImageHost]:
    async with image_host(encoded()) as state:
        yield state


def fetcher(allow: list[str], *, private: bool = True, **kwargs: float) -> ImageFetcher:
    """A fetcher of ``allow``; ``private``: loopback may be fetched (the image host's)."""
    checker = ImageChecker(ImageLimits(max_bytes=50_000))
    return ImageFetcher(allow, checker, private_addresses=private, **kwargs)  # type: ignore[arg-type]


async def test_an_allowed_host_is_fetched(host: ImageHost) -> None:
    """An image URL on an allowed host is fetched and checked like inline data."""
    image = await fetcher([f"127.0.0.1:{host.port}"]).fetch(host.url("127.0.0.1", "/shot.png"))
    assert (image.width, image.height, image.media_type) == (64, 48, MediaType.PNG)
    assert host.served == ["127.0.0.1/shot.png"]


@pytest.mark.parametrize(
    "make_url",
    [
        lambda port: f"http://localhost:{port}/shot.png",
        lambda port: f"ftp://127.0.0.1:{port}/shot.png",
        lambda port: "file:///etc/passwd",
    ],
    ids=["other-host", "other-scheme", "file"],
)
async def test_nothing_is_sent_to_a_host_not_allowed(
    host: ImageHost, make_url: Callable[[int], str]
) -> None:
    """A URL on a host (or scheme) not allowed is refused without a single request."""
    with pytest.raises(ImageError, match="--image-url-allow") as caught:
        await fetcher([f"127.0.0.1:{host.port}"]).fetch(make_url(host.port))
    assert caught.value.code == "image_url_not_allowed"
    assert host.served == []


async def test_no_url_is_fetched_unless_hosts_are_allowed(host: ImageHost) -> None:
    """With no host allowed (the default) no URL is fetched."""
    with pytest.raises(ImageError, match="not fetched"):
        await fetcher([]).fetch(f"http://127.0.0.1:{host.port}/shot.png")
    assert host.served == []


async def test_a_redirect_to_a_host_not_allowed_is_not_followed(host: ImageHost) -> None:
    """A redirect is followed only to an allowed host: one to another host ends the fetch
    before that host is asked anything."""
    url = f"http://127.0.0.1:{host.port}/to/localhost/shot.png"
    with pytest.raises(ImageError, match="redirects to http://localhost") as caught:
        await fetcher([f"127.0.0.1:{host.port}"]).fetch(url)
    assert caught.value.code == "image_url_not_allowed"
    assert host.served == ["127.0.0.1/to/localhost/shot.png"]
    image = await fetcher([f"127.0.0.1:{host.port}", f"localhost:{host.port}"]).fetch(url)
    assert image.width == 64
    assert host.served[-1] == "localhost/shot.png"


async def test_a_subdomain_pattern_allows_subdomains_only() -> None:
    """A leading dot allows every subdomain of the name, not look-alike names."""
    from yarl import URL

    allowed = fetcher([".images.example.org"])
    assert allowed.allows(URL("https://cdn.images.example.org/a.png"))
    assert not allowed.allows(URL("https://evilimages.example.org/a.png"))
    assert not allowed.allows(URL("https://images.example.org.evil.net/a.png"))


@pytest.mark.parametrize(
    ("path", "match", "code"),
    [
        ("/big", "over the limit of 50000 bytes", "image_too_large"),
        ("/missing.png", "answered 404", "image_fetch_failed"),
        ("/loop", "more than 3 times", "image_fetch_failed"),
        ("/slow", "could not be fetched", "image_fetch_failed"),
    ],
)
async def test_fetch_limits(host: ImageHost, path: str, match: str, code: str) -> None:
    """A body over the byte limit, an error status, endless redirects and a slow host each
    end the fetch with a clear error."""
    with pytest.raises(ImageError, match=match) as caught:
        await fetcher([f"127.0.0.1:{host.port}"], timeout_seconds=0.5).fetch(
            f"http://127.0.0.1:{host.port}{path}?token=secret"
        )
    assert caught.value.code == code
    assert "secret" not in caught.value.message


def test_a_host_is_allowed_on_its_schemes_port_unless_its_entry_names_one() -> None:
    """``host`` allows http on 80 and https on 443 only; ``host:port`` that port only; a
    bracketed IPv6 address takes a port too."""
    from yarl import URL

    plain = fetcher(["images.example.org"])
    assert plain.allows(URL("https://images.example.org/a.png"))
    assert plain.allows(URL("http://images.example.org:80/a.png"))
    for other in ("https://images.example.org:8443/a.png", "http://images.example.org:443/a"):
        assert not plain.allows(URL(other))
    ported = fetcher(["images.example.org:8443", "[::1]:8080", ".cdn.example.net:81"])
    assert ported.allows(URL("https://images.example.org:8443/a.png"))
    assert not ported.allows(URL("https://images.example.org/a.png"))
    assert ported.allows(URL("http://[::1]:8080/a.png"))
    assert ported.allows(URL("http://a.cdn.example.net:81/a.png"))
    assert not ported.allows(URL("http://cdn.example.net:81/a.png"))


@pytest.mark.parametrize("entry", ["host:0", "host:99999", "host:http", "a/b", "[::1", "a@b"])
def test_an_allow_entry_that_is_no_host_is_refused(entry: str) -> None:
    """An ``--image-url-allow`` entry that names no host (or no port) is a setup error."""
    with pytest.raises(ValueError, match="image URL host"):
        fetcher([entry])


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("93.184.215.14", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.100.100.200", False),  # shared address space (a cloud's metadata)
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1%eth0", False),
        ("fd00:ec2::254", False),  # cloud metadata over IPv6
        ("::ffff:127.0.0.1", False),
        ("::ffff:169.254.169.254", False),
    ],
)
def test_only_public_addresses_are_fetched_from(address: str, public: bool) -> None:
    """Loopback, private, link-local, shared, multicast and unspecified addresses (IPv4
    mapped into IPv6 included) are not public."""
    assert public_address(address) is public


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("64:ff9b::7f00:1", False),  # NAT64 of 127.0.0.1
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
        ("64:ff9b:1::a9fe:a9fe", False),  # the local-use NAT64 prefix
        ("2002:a9fe:a9fe::1", False),  # 6to4 of 169.254.169.254
        ("2002:a00:1::1", False),  # 6to4 of 10.0.0.1
        ("2002:808:808::1", True),  # 6to4 of 8.8.8.8
        ("::127.0.0.1", False),  # IPv4-compatible
        ("::169.254.169.254", False),
        ("2001:0:4136:e378:8000:63bf:5601:5601", False),  # Teredo, client 169.254.169.254
    ],
)
def test_ipv6_forms_that_reach_ipv4_are_judged_by_their_ipv4(address: str, public: bool) -> None:
    """NAT64, 6to4, IPv4-compatible and Teredo addresses are refused unless the IPv4 address
    they reach is public."""
    assert public_address(address) is public


async def test_an_allowed_name_that_resolves_to_loopback_is_not_asked(host: ImageHost) -> None:
    """By default an allowed host whose name resolves to a loopback address, or given as
    one (in any spelling), is refused without a request: the address connected to is the
    one checked."""
    port = host.port
    refusing = fetcher([f"localhost:{port}", f"127.0.0.1:{port}", f"127.1:{port}"], private=False)
    for name in ("localhost", "127.0.0.1", "127.1"):
        with pytest.raises(ImageError, match=r"not fetched|not a valid URL") as caught:
            await refusing.fetch(host.url(name, "/shot.png"))
        assert caught.value.code == "image_url_not_allowed", name
    assert host.served == []


async def test_a_port_not_allowed_is_not_asked(host: ImageHost) -> None:
    """An allowed host on a port its entry does not name is refused without a request."""
    with pytest.raises(ImageError, match="--image-url-allow") as caught:
        await fetcher(["127.0.0.1"]).fetch(host.url("127.0.0.1", "/shot.png"))
    assert caught.value.code == "image_url_not_allowed"
    assert host.served == []


def test_redirects_are_checked_like_urls_and_never_downgrade() -> None:
    """A redirect is followed only to an allowed host and port, never from https to
    http, and one to an invalid URL is refused."""
    from yarl import URL

    both = fetcher(["images.example.org", "images.example.org:8080"])
    start = URL("https://images.example.org/a.png")
    assert both.refusal(URL("https://images.example.org/b.png"), came_from=start) is None
    for target, words in (
        ("http://images.example.org/b.png", "from https to http"),
        ("https://images.example.org:9/b.png", "--image-url-allow"),
        ("http://images.example.org:8080/b.png", "from https to http"),
    ):
        assert words in (both.refusal(URL(target), came_from=start) or ""), target
    assert (
        both.refusal(
            URL("http://images.example.org:8080/b.png"),
            came_from=URL("http://images.example.org/a"),
        )
        is None
    )
    with pytest.raises(ImageError, match="redirects to an invalid URL") as caught:
        both._redirect(start, "http://[::1/x.png")
    assert caught.value.code == "image_url_not_allowed"


@pytest.mark.parametrize("url", ["http://[::1/x.png", "http://a\\@b/x.png", "https://h:99999/x"])
async def test_a_malformed_url_is_a_refusal(url: str) -> None:
    """A URL that does not parse is refused as an invalid image, not an internal error."""
    with pytest.raises(ImageError, match="not a valid URL") as caught:
        await fetcher(["127.0.0.1"]).fetch(url)
    assert caught.value.code == "invalid_image"
    assert caught.value.status == 400
