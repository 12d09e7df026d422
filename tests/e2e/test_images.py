"""Images through the real proxy, relay and ``hf`` worker on the tiny vision-language model,
with the official openai and anthropic clients, in all three agent APIs, streamed and not.

What is checked each time: the recorded prompt holds each image's placeholder expanded to
the processor's count, in its place; the export names the images in order with their
hashes and spans; a later turn that carries the same history continues the chain, an edited
image branches; and teacher forcing with the recorded pixels reproduces every sampled
logprob, while another image does not.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI, BadRequestError

from proxy.appkeys import SESSIONS
from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient, TrialSession
from tests.e2e.conftest import IN_PROCESS_STREAMS, TIMEOUT_FACTOR
from tests.images import GREEN, RED, png
from tests.proxy.image_host import image_host
from worker_client.backends.hf import HFEngine
from worker_client.engine import ImageSpan
from worker_client.tiny_vlm import SHIPPED_TINY_VLM

pytestmark = pytest.mark.e2e

# The tiny VLM's <|image_pad|>, the placeholder its forward fills with image features.
PAD = json.loads((SHIPPED_TINY_VLM / "config.json").read_text())["image_token_id"]


SCREENSHOT = png((10, 10, 240), (1280, 800))  # 60 image tokens with the tiny VLM's processor


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def sha(image: bytes) -> str:
    return hashlib.sha256(image).hexdigest()


@pytest.fixture(scope="session")
async def vlm_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=8,
        cache_dir=tmp_path_factory.mktemp("vlm-proxy-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
        max_image_bytes=400_000,
        max_image_pixels=1_500_000,  # a 1280x800 screenshot is in, 1600x1200 is not
        max_images=6,
    )
    running = await start_proxy(config)
    start_hf_worker(running, SHIPPED_TINY_VLM, worker_id="test-vlm")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


@pytest.fixture
async def vlm_client(vlm_stack: RunningProxy) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(vlm_stack.url) as client:
        yield client


@pytest.fixture(scope="session")
def vlm_engine() -> HFEngine:
    return HFEngine.load(SHIPPED_TINY_VLM)


_OPEN: list[AsyncOpenAI | AsyncAnthropic] = []  # the test's clients, closed after it


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _OPEN:
        await _OPEN.pop().close()


def _openai(trial: TrialSession) -> AsyncOpenAI:
    client = AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
    _OPEN.append(client)
    return client


def _anthropic(trial: TrialSession) -> AsyncAnthropic:
    client = AsyncAnthropic(base_url=trial.anthropic_base_url, api_key=trial.api_key, max_retries=0)
    _OPEN.append(client)
    return client


def chat_user(*parts: bytes | str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": p}
            if isinstance(p, str)
            else {"type": "image_url", "image_url": {"url": data_url(p)}}
            for p in parts
        ],
    }


async def chat(trial: TrialSession, messages: list[dict[str, Any]], *, stream: bool) -> str:
    """One chat turn; the reply's text."""
    client = _openai(trial)
    if not stream:
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""
    text = ""
    async for chunk in await client.chat.completions.create(
        model="m",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


async def new_trial(client: ProxyClient) -> TrialSession:
    """A trial whose every turn samples from the same seed: replies are reproducible."""
    return await client.create_session(sampling={"temperature": 1.0, "top_p": 1.0, "seed": 7})


async def image_bytes(running: RunningProxy, trial: str, digest: str) -> tuple[int, str, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{running.url}/sessions/{trial}/images/{digest}") as response,
    ):
        return response.status, response.content_type, await response.read()


def check_placed(trajectory: dict[str, Any], images: list[bytes]) -> None:
    """The export names ``images`` in order; each span holds the placeholder and nothing
    else does."""
    ids = trajectory["prompt_ids"] + trajectory["response_ids"]
    named = trajectory["multi_modal_data"]["images"]
    assert [i["sha256"] for i in named] == [sha(i) for i in images]
    covered = []
    for entry in named:
        start, end = entry["span"]
        assert entry["mime"] == "image/png"
        assert end > start
        assert set(ids[start:end]) == {PAD}
        covered.extend(range(start, end))
    assert covered == [i for i, token in enumerate(ids) if token == PAD]


def rescored(
    engine: HFEngine, trajectory: dict[str, Any], pixels: dict[str, bytes]
) -> list[tuple[float, float]]:
    """(recorded, teacher-forced) logprob of every sampled token, re-scored with the image
    ``pixels`` gives each recorded hash."""
    spans = [
        ImageSpan(sha(pixels[i["sha256"]]), pixels[i["sha256"]], i["span"][0], i["span"][1])
        for i in trajectory["multi_modal_data"]["images"]
    ]
    scores = engine.score(trajectory["prompt_ids"], trajectory["response_ids"], spans)
    return [
        (recorded, score)
        for recorded, score, mask in zip(
            trajectory["response_logprobs"], scores, trajectory["response_mask"], strict=True
        )
        if mask
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_one_image_then_a_second_turn_continues_the_chain(
    vlm_stack: RunningProxy, vlm_client: ProxyClient, vlm_engine: HFEngine, stream: bool
) -> None:
    trial = await new_trial(vlm_client)
    first = [chat_user("What is in this picture?", RED)]
    reply = await chat(trial, first, stream=stream)
    second = [*first, {"role": "assistant", "content": reply}, chat_user(GREEN, "and this one?")]
    await chat(trial, second, stream=stream)
    export = await vlm_client.trajectories(trial.trial_id)
    (trajectory,) = export["trajectories"]
    assert [t["branch_reason"] for t in trajectory["turns"]] == ["new_session", "continued"]
    check_placed(trajectory, [RED, GREEN])
    assert [i["span"][1] - i["span"][0] for i in trajectory["multi_modal_data"]["images"]] == [
        4,
        4,
    ]
    for image in (RED, GREEN):  # stored once each, served as sent
        assert await image_bytes(vlm_stack, trial.trial_id, sha(image)) == (200, "image/png", image)

    pairs = rescored(vlm_engine, trajectory, {sha(RED): RED, sha(GREEN): GREEN})
    assert len(pairs) >= 2
    assert max(abs(a - b) for a, b in pairs) <= 1e-4
    swapped = rescored(vlm_engine, trajectory, {sha(RED): GREEN, sha(GREEN): RED})
    assert max(abs(a - b) for a, b in swapped) > 1e-3  # the pixels matter: the test can fail


async def test_chat_several_images_in_one_message_keep_their_order(
    vlm_client: ProxyClient,
) -> None:
    trial = await new_trial(vlm_client)
    await chat(trial, [chat_user("compare", RED, "with", SCREENSHOT, GREEN)], stream=True)
    (trajectory,) = (await vlm_client.trajectories(trial.trial_id))["trajectories"]
    check_placed(trajectory, [RED, SCREENSHOT, GREEN])
    spans = [i["span"] for i in trajectory["multi_modal_data"]["images"]]
    assert [end - start for start, end in spans] == [4, 60, 4]
    assert trajectory["multi_modal_data"]["images"][1]["width"] == 1280


async def test_an_edited_image_branches(vlm_client: ProxyClient) -> None:
    trial = await new_trial(vlm_client)
    first = [chat_user("look", RED)]
    reply = await chat(trial, first, stream=False)
    await chat(
        trial, [*first, {"role": "assistant", "content": reply}, chat_user("again")], stream=False
    )
    edited = [chat_user("look", GREEN), {"role": "assistant", "content": reply}, chat_user("again")]
    await chat(trial, edited, stream=False)
    export = await vlm_client.trajectories(trial.trial_id)
    reasons = sorted(t["turns"][-1]["branch_reason"] for t in export["trajectories"])
    assert reasons == ["continued", "new_branch"]
    firsts = sorted(t["multi_modal_data"]["images"][0]["sha256"] for t in export["trajectories"])
    assert firsts == sorted([sha(RED), sha(GREEN)])


async def test_chat_image_in_a_tool_result(vlm_client: ProxyClient) -> None:
    trial = await new_trial(vlm_client)
    messages = [
        {"role": "user", "content": "take a screenshot"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "screenshot", "arguments": "{}"},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [
                {"type": "text", "text": "here it is"},
                {"type": "image_url", "image_url": {"url": data_url(RED)}},
            ],
        },
    ]
    await chat(trial, messages, stream=False)
    (trajectory,) = (await vlm_client.trajectories(trial.trial_id))["trajectories"]
    check_placed(trajectory, [RED])


def anthropic_image(image: bytes) -> dict[str, Any]:
    return {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(image).decode(),
        },
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_image_and_tool_result_image(
    vlm_client: ProxyClient, vlm_engine: HFEngine, stream: bool
) -> None:
    trial = await new_trial(vlm_client)
    client = _anthropic(trial)
    first: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is this"}, anthropic_image(RED)],
        }
    ]
    if stream:
        async with client.messages.stream(model="m", max_tokens=8, messages=first) as events:  # type: ignore[arg-type]
            message = await events.get_final_message()
    else:
        message = await client.messages.create(model="m", max_tokens=8, messages=first)  # type: ignore[arg-type]
    echoed = [b.model_dump(mode="json", exclude_none=True) for b in message.content]
    second = [
        *first,
        {
            "role": "assistant",
            "content": [
                *echoed,
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.png"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [anthropic_image(GREEN)],
                }
            ],
        },
    ]
    await client.messages.create(model="m", max_tokens=8, messages=second)  # type: ignore[arg-type]
    export = await vlm_client.trajectories(trial.trial_id)
    trajectories = export["trajectories"]
    # The second request's assistant message adds a tool call the model did not make: a
    # rewritten history, a new root that holds both images.
    longest = max(trajectories, key=lambda t: len(t["multi_modal_data"]["images"]))
    assert longest["turns"][-1]["branch_reason"] == "new_branch"
    images = [i["sha256"] for i in longest["multi_modal_data"]["images"]]
    assert images == [sha(RED), sha(GREEN)]
    check_placed(longest, [RED, GREEN])
    pairs = rescored(vlm_engine, longest, {sha(RED): RED, sha(GREEN): GREEN})
    assert max(abs(a - b) for a, b in pairs) <= 1e-4


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_input_image_and_function_output_image(
    vlm_client: ProxyClient, stream: bool
) -> None:
    trial = await new_trial(vlm_client)
    client = _openai(trial)
    items: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "describe"},
                {"type": "input_image", "image_url": data_url(RED), "detail": "auto"},
            ],
        }
    ]
    if stream:
        async for _ in await client.responses.create(
            model="m",
            input=items,  # type: ignore[arg-type]
            max_output_tokens=8,
            stream=True,
        ):
            pass
    else:
        await client.responses.create(model="m", input=items, max_output_tokens=8)  # type: ignore[arg-type]
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "look at the file"}]},
        {"type": "function_call", "call_id": "call_9", "name": "view_image", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "call_9",
            "output": [{"type": "input_image", "image_url": data_url(GREEN)}],
        },
    ]
    await client.responses.create(model="m", input=items, max_output_tokens=8)  # type: ignore[arg-type]
    export = await vlm_client.trajectories(trial.trial_id)
    found = sorted(
        i["sha256"] for t in export["trajectories"] for i in t["multi_modal_data"]["images"]
    )
    assert found == sorted([sha(RED), sha(GREEN)])
    for trajectory in export["trajectories"]:
        check_placed(
            trajectory,
            [RED] if trajectory["multi_modal_data"]["images"][0]["sha256"] == sha(RED) else [GREEN],
        )


async def _turns(running: RunningProxy, trial: str) -> tuple[int, int]:
    session = running.app[SESSIONS].get(trial)
    return len(session.nodes), len(session.images)


BMP = base64.b64decode(
    "Qk06AAAAAAAAADYAAAAoAAAAAQAAAAEAAAABABgAAAAAAAQAAAATCwAAEwsAAAAAAAAAAAAAAAD/AA=="
)


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("data:image/png;base64,not*base64", "invalid_image"),
        (
            "data:image/png;base64," + base64.b64encode(b"plain text, no image").decode(),
            "invalid_image",
        ),
        (
            "data:image/png;base64," + base64.b64encode(RED[: len(RED) // 2]).decode(),
            "invalid_image",
        ),
        ("data:image/bmp;base64," + base64.b64encode(BMP).decode(), "unsupported_image_format"),
        (data_url(png((1, 2, 3), (1600, 1200))), "image_too_large"),
    ],
)
async def test_bad_images_are_refused_and_nothing_is_recorded(
    vlm_stack: RunningProxy, vlm_client: ProxyClient, url: str, code: str
) -> None:
    trial = await new_trial(vlm_client)
    await chat(trial, [chat_user("fine", RED)], stream=False)
    before = await _turns(vlm_stack, trial.trial_id)
    bad = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
    with pytest.raises(BadRequestError) as caught:
        await chat(
            trial,
            [chat_user("fine", RED), {"role": "assistant", "content": "x"}, bad],
            stream=False,
        )
    assert caught.value.code == code, caught.value.body
    assert await _turns(vlm_stack, trial.trial_id) == before
    # The same refusal in Anthropic's format.
    anthropic_bad = {"role": "user", "content": [anthropic_image(RED), anthropic_image(RED)] * 4}
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{trial.anthropic_base_url}/v1/messages",
            json={"model": "m", "max_tokens": 8, "messages": [anthropic_bad]},
            headers={"x-api-key": trial.api_key, "anthropic-version": "2023-06-01"},
        ) as response,
    ):
        body = await response.json()
    assert response.status == 400
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "8 images" in body["error"]["message"]  # too many: at most 6 in this stack
    assert await _turns(vlm_stack, trial.trial_id) == before


async def test_a_remote_url_is_not_fetched_unless_allowed(
    vlm_stack: RunningProxy, vlm_client: ProxyClient
) -> None:
    async with image_host(RED) as host:
        trial = await new_trial(vlm_client)
        remote = {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": host.url("127.0.0.1", "/shot.png")}}
            ],
        }
        with pytest.raises(BadRequestError) as caught:
            await chat(trial, [remote], stream=False)
        assert caught.value.code == "image_url_not_allowed"
        assert host.served == []
        assert await _turns(vlm_stack, trial.trial_id) == (0, 0)


async def test_a_text_model_refuses_images_in_the_callers_format(proxy_client: ProxyClient) -> None:
    """The tiny text model (the shared ``stack``) has no vision encoder."""
    trial = await proxy_client.create_session()
    with pytest.raises(BadRequestError) as caught:
        await chat(trial, [chat_user("see", RED)], stream=False)
    assert caught.value.code == "images_unsupported"
    models = await _openai(trial).models.list()
    assert [m.model_extra["vision"] for m in models.data if m.model_extra] == [False]
    summary = await proxy_client.get_session(trial.trial_id)
    assert summary["turns"] == 0


async def test_models_say_the_vlm_takes_images(vlm_client: ProxyClient) -> None:
    trial = await new_trial(vlm_client)
    models = await _openai(trial).models.list()
    assert [m.model_extra["vision"] for m in models.data if m.model_extra] == [True]


async def test_an_unknown_image_is_not_found(
    vlm_stack: RunningProxy, vlm_client: ProxyClient
) -> None:
    trial = await new_trial(vlm_client)
    status, _, _ = await image_bytes(vlm_stack, trial.trial_id, sha(RED))
    assert status == 404


async def test_the_viewer_shows_images_in_place(
    vlm_stack: RunningProxy, vlm_client: ProxyClient
) -> None:
    """The viewer's trajectory data places each image on its span, and its thumbnail URL
    serves the bytes (with the page's own access, not the admin bearer)."""
    trial = await new_trial(vlm_client)
    await chat(trial, [chat_user("look", RED, "and", GREEN)], stream=False)
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"{vlm_stack.url}/ui/api/sessions/{trial.trial_id}/trajectories/0"
        ) as r:
            data = await r.json()
        (export,) = (await vlm_client.trajectories(trial.trial_id))["trajectories"]
        spans = [i["span"] for i in export["multi_modal_data"]["images"]]
        assert [[i["start"], i["end"]] for i in data["images"]] == spans
        for image, sent in zip(data["images"], (RED, GREEN), strict=True):
            async with http.get(vlm_stack.url + image["url"]) as r:
                assert r.content_type == "image/png"
                assert await r.read() == sent


async def test_anthropic_count_tokens_counts_each_image_as_it_is_expanded(
    vlm_client: ProxyClient,
) -> None:
    """count_tokens gives a new branch's prompt length with each image's real token count:
    exactly the first turn's recorded prompt."""
    trial = await new_trial(vlm_client)
    client = _anthropic(trial)
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, anthropic_image(SCREENSHOT)]}
    ]
    counted = await client.messages.count_tokens(model="m", messages=messages)
    await client.messages.create(model="m", max_tokens=8, messages=messages)
    (trajectory,) = (await vlm_client.trajectories(trial.trial_id))["trajectories"]
    assert counted.input_tokens == len(trajectory["prompt_ids"])
    assert (
        trajectory["multi_modal_data"]["images"][0]["span"][1]
        - trajectory["multi_modal_data"]["images"][0]["span"][0]
        == 60
    )


async def test_the_sdk_trains_on_what_the_worker_saw(
    vlm_client: ProxyClient, vlm_engine: HFEngine
) -> None:
    """The trainer's path: samples built from the real export, their image bytes fetched
    from the proxy (once per image), turned into the model's forward inputs, re-score
    every sampled token within 1e-4; with the images swapped they do not."""
    from sdk.fidelity import check_samples
    from sdk.images import VisionScorer, forward_inputs
    from sdk.samples import build_samples

    trial = await new_trial(vlm_client)
    first = [chat_user("first", RED)]
    reply = await chat(trial, first, stream=True)
    await chat(
        trial, [*first, {"role": "assistant", "content": reply}, chat_user(GREEN)], stream=True
    )
    (sample,) = build_samples(await vlm_client.trajectories(trial.trial_id))
    await vlm_client.fill_images(trial.trial_id, [sample])
    assert [(i.sha256, i.data) for i in sample.images] == [(sha(RED), RED), (sha(GREEN), GREEN)]
    model, processor = vlm_engine.model, vlm_engine.image_processor
    inputs = forward_inputs(sample, processor, model)
    assert int(inputs["mm_token_type_ids"].sum()) == 8  # two images of 4 tokens
    report = check_samples([sample], VisionScorer(model, processor).score)
    assert report.images == 2
    assert report.ok(), report
    for image, other in zip(sample.images, (GREEN, RED), strict=True):
        image.sha256, image.data = sha(other), other  # the same places, other pixels
    assert not check_samples([sample], VisionScorer(model, processor).score).ok()


# ------------------------------------------------------------- every API, streamed and not


async def _say(api: str, trial: TrialSession, history: list[dict[str, Any]], stream: bool) -> str:
    """One turn of ``history`` (already in ``api``'s shape); the reply's text."""
    if api == "chat":
        return await chat(trial, history, stream=stream)
    if api == "anthropic":
        client = _anthropic(trial)
        if stream:
            async with client.messages.stream(model="m", max_tokens=8, messages=history) as s:  # type: ignore[arg-type]
                message = await s.get_final_message()
        else:
            message = await client.messages.create(model="m", max_tokens=8, messages=history)  # type: ignore[arg-type]
        return "".join(b.text for b in message.content if b.type == "text")
    openai = _openai(trial)
    if not stream:
        reply = await openai.responses.create(model="m", input=history, max_output_tokens=8)  # type: ignore[arg-type]
        return reply.output_text
    text = ""
    async for event in await openai.responses.create(
        model="m",
        input=history,  # type: ignore[arg-type]
        max_output_tokens=8,
        stream=True,
    ):
        if event.type in ("response.completed", "response.incomplete"):  # 8 tokens: cut
            text = event.response.output_text
    return text


def _user(api: str, *parts: bytes | str) -> dict[str, Any]:
    if api == "chat":
        return chat_user(*parts)
    if api == "anthropic":
        return {
            "role": "user",
            "content": [
                {"type": "text", "text": p} if isinstance(p, str) else anthropic_image(p)
                for p in parts
            ],
        }
    return {
        "role": "user",
        "content": [
            {"type": "input_text", "text": p}
            if isinstance(p, str)
            else {"type": "input_image", "image_url": data_url(p)}
            for p in parts
        ],
    }


def _assistant(api: str, text: str) -> dict[str, Any]:
    if api == "anthropic":
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
async def test_several_images_a_chain_and_an_edited_image_in_every_api(
    vlm_client: ProxyClient, vlm_engine: HFEngine, api: str, stream: bool
) -> None:
    """Several images in one message, a second turn carrying them (one chain), then the
    same history with the first image edited (a new branch); the chain re-scores within
    1e-4 with its recorded pixels."""
    trial = await new_trial(vlm_client)
    first = [_user(api, "compare", RED, "with", GREEN)]
    reply = await _say(api, trial, first, stream)
    second = [*first, _assistant(api, reply), _user(api, SCREENSHOT, "and now?")]
    await _say(api, trial, second, stream)
    edited = [_user(api, "compare", GREEN, "with", GREEN), *second[1:]]
    await _say(api, trial, edited, stream)
    export = await vlm_client.trajectories(trial.trial_id)
    by_turns = {len(t["turns"]): t for t in export["trajectories"]}
    chain = by_turns[2]
    assert [t["branch_reason"] for t in chain["turns"]] == ["new_session", "continued"]
    check_placed(chain, [RED, GREEN, SCREENSHOT])
    edited_root = by_turns[1]
    assert edited_root["turns"][0]["branch_reason"] == "new_branch"
    check_placed(edited_root, [GREEN, GREEN, SCREENSHOT])
    pixels = {sha(i): i for i in (RED, GREEN, SCREENSHOT)}
    pairs = rescored(vlm_engine, chain, pixels)
    assert max(abs(a - b) for a, b in pairs) <= 1e-4
