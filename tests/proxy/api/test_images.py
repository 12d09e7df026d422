"""Images in the three agent APIs: each image part becomes an ``ImagePart`` in its place
(named by the sha256 of its bytes, with its size) among the message's text, in user and
tool messages; images are refused where no template renders them; a history seen before is
not converted again; and through the real app every refused image is a 400 in the caller's
API format that records nothing and, for a URL not allowed, sends nothing."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from PIL import Image

from proxy.api.anthropic.models import parse_messages_request
from proxy.api.errors import parse_json
from proxy.api.images import ImageSources, take_images
from proxy.api.openai.models import parse_chat_completion
from proxy.api.responses.models import ResponsesRequest
from proxy.appkeys import SESSIONS
from proxy.chat.messages import ChatMessage, ImagePart, extend_key
from proxy.config import ProxyConfig
from proxy.exceptions import BadRequestError, ImageError
from proxy.images import ImageChecker, ImageFetcher, ImageIntake, ImageLimits
from proxy.sessions.model import Session, TrialId
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.proxy.image_host import ImageHost, encoded, image_host

SHOT = encoded((64, 48))
OTHER = encoded((32, 16))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def part(data: bytes) -> ImagePart:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return ImagePart(hashlib.sha256(data).hexdigest(), "image/png", width, height)


# ------------------------------------------------------------------------ the three APIs

Parse = Callable[[bytes, Session, ImageIntake], tuple[Any, list[ChatMessage]]]


@dataclass(frozen=True)
class Api:
    """How one agent API writes a conversation, an image and a tool result."""

    name: str
    path: str  # after the trial's /v1
    text: Callable[[str], dict[str, Any]]
    image_url: Callable[[str], dict[str, Any]]  # an image given by (data: or http) URL
    body: Callable[[list[dict[str, Any]]], dict[str, Any]]  # a request of its messages
    user: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]  # a user message's items
    # A call of tool "shot", its result made of these parts, then a user message of text.
    tool_turn: Callable[[list[dict[str, Any]], str], list[dict[str, Any]]]
    parse: Parse
    error: Callable[[dict[str, Any]], dict[str, Any]]  # the error object of an error body


def _openai_tool_turn(parts: list[dict[str, Any]], after: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": parts},
        {"role": "user", "content": after},
    ]


def _anthropic_tool_turn(parts: list[dict[str, Any]], after: str) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "shot"}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": parts},
                {"type": "text", "text": after},
            ],
        },
    ]


def _responses_tool_turn(parts: list[dict[str, Any]], after: str) -> list[dict[str, Any]]:
    return [
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": parts},
        {"role": "user", "content": [{"type": "input_text", "text": after}]},
    ]


def _anthropic_image(url: str) -> dict[str, Any]:
    if url.startswith("data:"):  # Anthropic's own form of inline data
        media_type, _, data = url.removeprefix("data:").partition(";base64,")
        source = {"type": "base64", "media_type": media_type, "data": data}
        return {"type": "image", "source": source}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _responses_parse(body: bytes, session: Session, intake: ImageIntake) -> Any:
    parsed = parse_json(ResponsesRequest, body)
    return parsed, parsed.internal_messages(intake)


OPENAI = Api(
    name="openai.chat",
    path="/chat/completions",
    text=lambda text: {"type": "text", "text": text},
    image_url=lambda url: {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
    body=lambda messages: {"model": "m", "max_tokens": 4, "messages": messages},
    user=lambda parts: [{"role": "user", "content": parts}],
    tool_turn=_openai_tool_turn,
    parse=lambda body, session, intake: parse_chat_completion(body, session.history, intake),
    error=lambda body: body["error"],
)
ANTHROPIC = Api(
    name="anthropic.messages",
    path="/messages",
    text=lambda text: {"type": "text", "text": text},
    image_url=_anthropic_image,
    body=lambda messages: {"model": "m", "max_tokens": 4, "messages": messages},
    user=lambda parts: [{"role": "user", "content": parts}],
    tool_turn=_anthropic_tool_turn,
    parse=lambda body, session, intake: parse_messages_request(
        body, session.history, lambda text, signature: True, intake
    ),
    error=lambda body: body["error"] if body.get("type") == "error" else {},
)
RESPONSES = Api(
    name="openai.responses",
    path="/responses",
    text=lambda text: {"type": "input_text", "text": text},
    image_url=lambda url: {"type": "input_image", "image_url": url, "detail": "auto"},
    body=lambda items: {"model": "m", "input": items},
    user=lambda parts: [{"role": "user", "content": parts}],
    tool_turn=_responses_tool_turn,
    parse=_responses_parse,
    error=lambda body: body["error"],
)
APIS = [pytest.param(api, id=api.name) for api in (OPENAI, ANTHROPIC, RESPONSES)]


def _sources(allow: tuple[str, ...] = (), **limits: int) -> ImageSources:
    checker = ImageChecker(ImageLimits(**limits))
    # The image hosts of these tests listen on loopback.
    fetcher = ImageFetcher(allow, checker, timeout_seconds=5.0, private_addresses=True)
    return ImageSources(checker, fetcher)


def _session() -> Session:
    return Session(TrialId("trial"), "key")


async def _take(
    api: Api, messages: list[dict[str, Any]], session: Session | None = None, **kwargs: Any
) -> tuple[list[ChatMessage], dict[str, Any]]:
    body = json.dumps(api.body(messages)).encode()
    session = session or _session()
    _, converted, images = await take_images(
        _sources(**kwargs), session, lambda intake: api.parse(body, session, intake)
    )
    return converted, dict(images)


# ---------------------------------------------------------------------- conversion


@pytest.mark.parametrize("api", APIS)
async def test_images_take_their_places_among_the_text(api: Api) -> None:
    """A user message's text and images keep their order in ``parts``; ``content`` is its
    text alone; the images come back by sha256 with their bytes, the one sent twice once."""
    messages = api.user(
        [
            api.text("look: "),
            api.image_url(data_url(SHOT)),
            api.text("and "),
            api.image_url(data_url(OTHER)),
            api.image_url(data_url(SHOT)),
        ]
    )
    converted, images = await _take(api, messages)
    (user,) = converted
    sep = "\n\n" if api is ANTHROPIC else ""  # Anthropic joins text blocks with a blank line
    assert user.role == "user"
    assert user.content == f"look: {sep}and "
    assert user.parts == ("look: ", part(SHOT), "and ", part(OTHER), part(SHOT))
    assert (part(SHOT).width, part(SHOT).height) == (64, 48)
    assert {sha: image.data for sha, image in images.items()} == {
        part(SHOT).sha256: SHOT,
        part(OTHER).sha256: OTHER,
    }


@pytest.mark.parametrize("api", APIS)
async def test_a_tool_result_holds_its_images_and_the_order_of_messages_is_kept(api: Api) -> None:
    """A tool result's images are in its tool message (Claude Code's Read of a screenshot,
    a function_call_output list); the user text after it stays a user message after it."""
    messages = [
        *api.user([api.text("take a screenshot")]),
        *api.tool_turn([api.text("shot:"), api.image_url(data_url(SHOT))], "what now?"),
    ]
    converted, images = await _take(api, messages)
    assert [m.role for m in converted] == ["user", "assistant", "tool", "user"]
    tool = converted[2]
    assert (tool.tool_call_id, tool.content, tool.parts) == ("c1", "shot:", ("shot:", part(SHOT)))
    assert converted[3] == ChatMessage("user", "what now?")
    assert list(images) == [part(SHOT).sha256]


async def test_codex_view_image_is_a_user_image_after_the_tool_output() -> None:
    """Codex's view_image: the tool output is text, the image a user message after it."""
    items = [
        *RESPONSES.user([RESPONSES.text("open it")]),
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "attached the image"},
        {"role": "user", "content": [RESPONSES.image_url(data_url(SHOT))]},
    ]
    converted, images = await _take(RESPONSES, items)
    assert [m.role for m in converted] == ["user", "assistant", "tool", "user"]
    assert converted[2] == ChatMessage("tool", "attached the image", tool_call_id="c1")
    assert converted[3].parts == (part(SHOT),)
    assert converted[3].content == ""
    assert list(images) == [part(SHOT).sha256]


async def test_an_image_url_given_as_a_bare_string_is_taken() -> None:
    """Chat Completions: ``image_url`` may be the URL alone."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": data_url(SHOT)}]}]
    converted, _ = await _take(OPENAI, messages)
    assert converted[0].parts == (part(SHOT),)


@pytest.mark.parametrize("api", APIS)
async def test_a_text_only_message_keeps_its_key(api: Api) -> None:
    """A message of text parts only has no ``parts``: its context key is what it was."""
    converted, images = await _take(api, api.user([api.text("a"), api.text("b")]))
    sep = "\n\n" if api is ANTHROPIC else ""
    assert converted == [ChatMessage("user", f"a{sep}b")]
    assert extend_key(b"", converted[0]) == extend_key(b"", ChatMessage("user", f"a{sep}b"))
    assert images == {}


def _in_role(api: Api, role: str, image: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """A request with ``image`` in a message of ``role``, and the place the error names."""
    if api is ANTHROPIC:
        return [{"role": role, "content": [image]}], "messages.0.content.0"
    if api is RESPONSES:
        return [{"role": role, "content": [image]}], "input.0.content.0"
    return [{"role": role, "content": [image]}], "messages.0"


@pytest.mark.parametrize(
    ("api", "role"),
    [
        pytest.param(api, role, id=f"{api.name}-{role}")
        for api in (OPENAI, ANTHROPIC, RESPONSES)
        for role in ("system", "developer", "assistant")
        if not (api is ANTHROPIC and role == "developer")  # Anthropic has no developer role
    ],
)
async def test_an_image_where_no_template_renders_one_is_refused(api: Api, role: str) -> None:
    """An image in a system, developer or assistant message is a 400 naming the message."""
    messages, where = _in_role(api, role, api.image_url(data_url(SHOT)))
    with pytest.raises(BadRequestError) as caught:
        await _take(api, messages)
    assert caught.value.code == "invalid_message"
    assert caught.value.message.startswith(f"{where}:")
    assert "image" in caught.value.message


async def test_an_image_in_the_anthropic_system_prompt_is_refused() -> None:
    body = ANTHROPIC.body(ANTHROPIC.user([ANTHROPIC.text("hi")]))
    body["system"] = [{"type": "text", "text": "sys"}, _anthropic_image(data_url(SHOT))]
    session = _session()
    with pytest.raises(BadRequestError, match=r"^system\.1: images") as caught:
        await take_images(
            _sources(),
            session,
            lambda intake: ANTHROPIC.parse(json.dumps(body).encode(), session, intake),
        )
    assert caught.value.code == "invalid_message"


@pytest.mark.parametrize(
    ("api", "image", "code", "match"),
    [
        (RESPONSES, {"type": "input_image", "file_id": "file-1"}, "unsupported_content", "file_id"),
        (RESPONSES, {"type": "input_image"}, "invalid_request", "needs image_url"),
        (OPENAI, {"type": "image_url"}, "invalid_request", "needs image_url.url"),
        (ANTHROPIC, {"type": "image"}, "invalid_request", "needs a source"),
        (
            ANTHROPIC,
            {"type": "image", "source": {"type": "file", "file_id": "f"}},
            "unsupported_content",
            "'file' are not supported",
        ),
        (ANTHROPIC, {"type": "image", "source": {"type": "base64"}}, "invalid_request", "data"),
        (OPENAI, {"type": "input_audio"}, "unsupported_content", "input_audio"),
        (RESPONSES, {"type": "input_file"}, "unsupported_content", "input_file"),
    ],
    ids=lambda v: v.name if isinstance(v, Api) else None,
)
async def test_images_the_proxy_cannot_read_are_refused(
    api: Api, image: dict[str, Any], code: str, match: str
) -> None:
    """An image with no data, by a file id (files are not stored), or another part type."""
    with pytest.raises(BadRequestError, match=match) as caught:
        await _take(api, api.user([api.text("x"), image]))
    assert caught.value.code == code


@pytest.mark.parametrize(
    "api", [pytest.param(OPENAI, id="openai"), pytest.param(ANTHROPIC, id="anthropic")]
)
async def test_a_screenshot_in_a_remembered_history_is_not_converted_again(api: Api) -> None:
    """Once a turn holding a screenshot is recorded, the next request's history (the same
    screenshot, one message more) takes it from the memory: nothing is decoded or brought
    again. A session that never recorded it (the earlier request was refused) converts the
    history again and brings the image."""
    first = api.user([api.text("look"), api.image_url(data_url(SHOT))])
    reply = {"role": "assistant", "content": "a chart"}
    second = [*first, reply, *api.user([api.text("and now?")])]
    session = _session()
    _, images = await _take(api, first, session)
    session.images.update(images)  # what recording the turn does
    converted, again = await _take(api, second, session)
    assert again == {}
    assert converted[0].parts == ("look", part(SHOT))
    unrecorded = _session()
    await _take(api, first, unrecorded)
    converted, brought = await _take(api, second, unrecorded)
    assert list(brought) == [part(SHOT).sha256]
    assert converted[0].parts == ("look", part(SHOT))


# ------------------------------------------------------------------ the event loop


@pytest.fixture(scope="module")
def heavy() -> list[bytes]:
    """Three small PNGs that decode to 4000x4000 pixels each (within the default limits)."""
    return [encoded((4000, 4000)) for _ in range(3)]


async def test_heavy_images_are_decoded_while_the_event_loop_goes_on(heavy: list[bytes]) -> None:
    """A request whose images take long to decode does not stop the event loop: a
    heartbeat beside it never waits as long as one of the images takes to decode alone
    (decoded on the loop, the three of them would stop it about three times as long)."""
    started = time.perf_counter()
    with Image.open(io.BytesIO(heavy[0])) as image:
        image.load()
    alone = time.perf_counter() - started
    distinct = [data + bytes([i]) for i, data in enumerate(heavy)]  # three sha256s
    gaps: list[float] = []

    async def heartbeat() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beating = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.02)
    try:
        _, images = await _take(
            OPENAI, OPENAI.user([OPENAI.image_url(data_url(d)) for d in distinct])
        )
        await asyncio.sleep(0.02)  # the heartbeat sees the gap the request left, if any
    finally:
        beating.cancel()
    assert len(images) == 3
    assert max(gaps) < alone, (max(gaps), alone)


# --------------------------------------------------------------- the real app, refusals


@pytest.fixture
async def host() -> AsyncIterator[ImageHost]:
    async with image_host(SHOT) as state:
        yield state


@pytest.mark.parametrize("api", APIS)
async def test_an_allowed_url_is_fetched_and_a_host_not_allowed_is_never_asked(
    api: Api, host: ImageHost
) -> None:
    """An http URL on an allowed host is fetched once and taken like inline data; the
    same URL on a host not allowed is refused without a request."""
    url = host.url("127.0.0.1", "/shot.png")
    messages = api.user([api.text("see"), api.image_url(url), api.image_url(url)])
    converted, images = await _take(api, messages, allow=(f"127.0.0.1:{host.port}",))
    assert converted[0].parts == ("see", part(SHOT), part(SHOT))
    assert images[part(SHOT).sha256].data == SHOT
    assert host.served == ["127.0.0.1/shot.png"]
    with pytest.raises(ImageError, match="--image-url-allow") as caught:
        await _take(api, api.user([api.image_url(host.url("localhost", "/shot.png"))]))
    assert caught.value.code == "image_url_not_allowed"
    assert host.served == ["127.0.0.1/shot.png"]


# What the proxy under test takes: small limits, one allowed host (127.0.0.1).
LIMITS = {"max_image_bytes": 10_000, "max_image_pixels": 100 * 100, "max_images": 3}


@pytest.fixture(scope="module")
async def app_host() -> AsyncIterator[ImageHost]:
    """The image host of the proxy under test (its port is in the proxy's settings)."""
    async with image_host(SHOT) as state:
        yield state


@pytest.fixture(scope="module")
async def proxy(
    tmp_path_factory: pytest.TempPathFactory, app_host: ImageHost
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=0.5,
        image_url_allow=(f"127.0.0.1:{app_host.port}",),
        image_url_private_addresses=True,
        image_fetch_seconds=5.0,
        cache_dir=Path(tmp_path_factory.mktemp("proxy-cache")),
        **LIMITS,  # type: ignore[arg-type]
    )
    running = await start_proxy(config)
    yield running
    await running.stop()


def _refusals(host: ImageHost) -> list[tuple[str, str, str, str]]:
    """(name, image URL, code, words of the message) of every refusal of an image."""
    big = encoded((90, 90), noise=True)
    assert len(big) > LIMITS["max_image_bytes"]
    return [
        ("bad base64", "data:image/png;base64,!!not base64!!", "invalid_image", "base64"),
        ("not an image", data_url(b"just some text", "image/png"), "invalid_image", "not an image"),
        ("truncated", data_url(SHOT[: len(SHOT) // 2]), "invalid_image", "corrupt"),
        ("bmp", data_url(encoded(fmt="BMP"), "image/bmp"), "unsupported_image_format", "BMP"),
        ("over max bytes", data_url(big), "image_too_large", "bytes"),
        ("over max pixels", data_url(encoded((200, 60))), "image_too_large", "200x60 pixels"),
        (
            "host not allowed",
            host.url("localhost", "/shot.png"),
            "image_url_not_allowed",
            "--image-url-allow",
        ),
        (
            "redirect to a host not allowed",
            host.url("127.0.0.1", "/to/localhost/shot.png"),
            "image_url_not_allowed",
            "redirects to http://localhost",
        ),
        (
            "port not allowed",
            f"http://127.0.0.1:{host.port + 1}/shot.png",
            "image_url_not_allowed",
            "--image-url-allow",
        ),
        ("malformed host", "http://[::1/x.png", "invalid_image", "not a valid URL"),
        ("backslash in host", "http://a\\@b/x.png", "invalid_image", "not a valid URL"),
    ]


@pytest.mark.parametrize("api", APIS)
async def test_refused_images_are_400_in_the_callers_format_and_record_nothing(
    api: Api, proxy: RunningProxy, app_host: ImageHost
) -> None:
    """Through the real app, every image refusal (in a user message and in a tool
    result), and one image too many, is a 400 in the API's error shape with its code,
    naming where the image is; the session records nothing and holds no image; a host not
    allowed gets no request, a redirect's target not allowed none either."""
    async with ProxyClient(proxy.url) as client, aiohttp.ClientSession() as http:
        trial = await client.create_session()
        base = trial.anthropic_base_url + "/v1" if api is ANTHROPIC else trial.base_url
        before = await client.get_session(trial.trial_id)
        app_host.served.clear()
        cases = [(name, url, code, words, False) for name, url, code, words in _refusals(app_host)]
        cases += [(f"{n} in a tool result", u, c, w, True) for n, u, c, w, _ in cases]
        shots = [api.image_url(data_url(SHOT))] * (LIMITS["max_images"] + 1)
        for name, url, code, words, in_tool in [
            *cases,
            ("too many", "", "too_many_images", "4 images", False),
        ]:
            if name == "too many":
                messages = api.user([api.text("x"), *shots])
            elif in_tool:
                start = api.user([api.text("go")])
                messages = [*start, *api.tool_turn([api.text("r"), api.image_url(url)], "?")]
            else:
                messages = api.user([api.text("x"), api.image_url(url)])
            async with http.post(f"{base}{api.path}", json=api.body(messages)) as response:
                body = await response.json()
            assert response.status == 400, (name, body)
            if api is ANTHROPIC:
                assert body["type"] == "error", name
            error = api.error(body)
            assert error["type"] == "invalid_request_error", name
            if api is not ANTHROPIC:
                assert error["code"] == code, (name, error)
            assert words in error["message"], (name, error)
            if name != "too many":  # the place of the image refused comes first
                assert re.match(r"(messages|input)\.\d+\.(content|output)\.", error["message"])
        after = await client.get_session(trial.trial_id)
        assert after["turns"] == before["turns"] == 0
        assert proxy.app[SESSIONS].get(trial.trial_id).images == {}
    # The redirect was asked twice (user message, tool result), its target never.
    assert app_host.served == ["127.0.0.1/to/localhost/shot.png"] * 2
