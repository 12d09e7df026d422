"""The Anthropic Messages API through the real proxy, relay, worker and tiny model, with the
official ``anthropic`` client (and raw HTTP where the wire itself is under test)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import anthropic
import pytest
from anthropic import Anthropic, AsyncAnthropic
from transformers import AutoTokenizer

from proxy.api.anthropic.models import MessagesRequest
from proxy.api.anthropic.routes import content_blocks, signature_check
from proxy.appkeys import POOL, SERVICE
from proxy.chat.messages import ChatMessage, ToolCall, extend_key
from proxy.exceptions import UpstreamError
from proxy.images import ImageChecker, ImageIntake, ImageLimits
from proxy.turns import TextDelta, TurnEvent, TurnResult, TurnService
from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient, TrialSession
from sdk.demo import TOOLS
from sdk.fidelity import check_fidelity
from tests.scripted_worker import PacedScriptedEngine, tiny_reply
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e

ANTHROPIC_TOOLS: list[dict[str, Any]] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


def _client(trial: TrialSession) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=trial.anthropic_base_url, api_key=trial.api_key, max_retries=0)


def _sync_client(trial: TrialSession) -> Anthropic:
    return Anthropic(base_url=trial.anthropic_base_url, api_key=trial.api_key, max_retries=0)


def _echo(message: Any) -> dict[str, Any]:
    """The assistant message as an agent sends it back: the blocks it received."""
    return {
        "role": "assistant",
        "content": [b.model_dump(mode="json", exclude_none=True) for b in message.content],
    }


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


async def _turns(client: ProxyClient, trial_id: str) -> list[dict[str, Any]]:
    export = await client.trajectories(trial_id)
    return sorted(
        {t["turn"]: t for tr in export["trajectories"] for t in tr["turns"]}.values(),
        key=lambda t: t["turn"],
    )


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


# What content_blocks reads of a session: the key its thinking blocks are signed with.
SESSION: Any = SimpleNamespace(api_key="key", trial_id="trial")


def _internal(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    request = MessagesRequest.model_validate({"model": "m", "messages": messages})
    return request.internal_messages(
        signature_check(SESSION), ImageIntake(ImageChecker(ImageLimits()))
    )


def test_returned_blocks_translate_back_to_the_recorded_message() -> None:
    """A reply's blocks, as returned whole or as streamed (text split around tool_use),
    translate back to the very assistant message the session recorded."""
    calls = (
        ToolCall("call_1", "bash", '{"command": "ls -a", "n": 1.5}'),
        ToolCall("call_2", "read_file", '{"path": "é.md"}'),
    )
    result = TurnResult(
        node=None,  # type: ignore[arg-type]  # not read when rendering blocks
        model="m",
        content="Let me look.\nThen read.",
        tool_calls=calls,
        finish_reason="stop",
        prompt_tokens=1,
        completion_tokens=1,
    )
    recorded = extend_key(b"", ChatMessage("assistant", result.content, calls))
    tool_uses = [b for b in content_blocks(result, SESSION) if b["type"] == "tool_use"]
    streamed = [
        {"type": "text", "text": "Let me look."},
        *tool_uses,
        {"type": "text", "text": "\nThen read."},
    ]
    for blocks in (content_blocks(result, SESSION), streamed):
        wire = json.loads(json.dumps(blocks))
        (assistant,) = _internal([{"role": "assistant", "content": wire}])
        assert extend_key(b"", assistant) == recorded
        assert [c.id for c in assistant.tool_calls] == ["call_1", "call_2"]
    calls_only = TurnResult(None, "m", "", calls, "stop", 1, 1)  # type: ignore[arg-type]
    assert [b["type"] for b in content_blocks(calls_only, SESSION)] == ["tool_use", "tool_use"]
    (assistant,) = _internal(
        [{"role": "assistant", "content": content_blocks(calls_only, SESSION)}]
    )
    assert extend_key(b"", assistant) == extend_key(b"", ChatMessage("assistant", "", calls))


def test_tool_results_come_before_the_users_text() -> None:
    """tool_result blocks become tool messages in order, the user's text blocks one user
    message after them; thinking blocks are dropped."""
    messages = _internal(
        [
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "a", "content": "one"},
                    {"type": "text", "text": "<system-reminder>r</system-reminder>"},
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "tool_result", "tool_use_id": "b", "is_error": True},
                    {"type": "text", "text": "go on"},
                ],
            }
        ]
    )
    assert messages == [
        ChatMessage("tool", "one", tool_call_id="a"),
        ChatMessage("tool", "", tool_call_id="b"),
        ChatMessage("user", "<system-reminder>r</system-reminder>\n\ngo on"),
    ]


async def test_message_reports_exact_usage(proxy_client: ProxyClient) -> None:
    """A non-streamed message has Anthropic's shape and usage equals the recorded counts."""
    trial = await proxy_client.create_session(sampling={"seed": 1})
    async with _client(trial) as client:
        reply = await client.messages.create(
            model="claude-relay-test",
            max_tokens=12,
            messages=[{"role": "user", "content": "hi"}],
            # This SDK release has no sampling arguments; older ones and raw clients send them.
            extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},
        )
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    assert reply.id.startswith("msg_")
    assert reply.type == "message"
    assert reply.role == "assistant"
    assert reply.usage.input_tokens == len(traj["prompt_ids"])
    assert reply.usage.output_tokens == sum(traj["response_mask"]) >= 1
    assert reply.stop_reason in {"end_turn", "max_tokens"}
    assert [b.type for b in reply.content] in ([], ["text"])
    (turn,) = traj["turns"]
    assert turn["api"] == "anthropic.messages"
    assert turn["requested_model"] == "claude-relay-test"
    assert reply.model == turn["model"]
    assert turn["sampling"] == {
        "max_tokens": 12,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": 1,
    }


async def test_sync_client_creates_and_streams(proxy_client: ProxyClient) -> None:
    """The synchronous client works for plain and streamed calls (run off the event loop,
    which also serves the proxy)."""
    trial = await proxy_client.create_session(sampling={"seed": 4})

    def run() -> tuple[Any, str, Any]:
        with _sync_client(trial) as client:
            messages: Any = [{"role": "user", "content": "hello there"}]
            whole = client.messages.create(model="m", max_tokens=16, messages=messages)
            with client.messages.stream(model="m", max_tokens=16, messages=messages) as stream:
                text = "".join(stream.text_stream)
                final = stream.get_final_message()
        return whole, text, final

    whole, text, final = await asyncio.to_thread(run)
    assert text == _text(final) == _text(whole)
    assert final.usage.output_tokens == whole.usage.output_tokens >= 1
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert len((await proxy_client.trajectories(trial.trial_id))["trajectories"]) == 2


async def test_stream_equals_non_stream_for_the_same_seed(proxy_client: ProxyClient) -> None:
    """With the session's seed, streamed and non-streamed calls return the same text and
    record the same token ids; streamed text deltas add up to the final message."""
    trial = await proxy_client.create_session(sampling={"seed": 7, "temperature": 1.0})
    kwargs: dict[str, Any] = {
        "model": "m",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "tell me a story"}],
    }
    async with _client(trial) as client:
        whole = await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as stream:
            deltas = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        raw = [e async for e in await client.messages.create(stream=True, **kwargs)]
    raw_text = "".join(
        e.delta.text
        for e in raw
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert len(deltas) >= 3  # real streaming: one delta per engine step
    assert "".join(deltas) == _text(final) == _text(whole) == raw_text
    assert final.stop_reason == whole.stop_reason
    assert raw[0].type == "message_start"
    assert raw[0].message.usage.input_tokens == whole.usage.input_tokens
    (last,) = [e for e in raw if e.type == "message_delta"]
    assert last.usage.output_tokens == final.usage.output_tokens == whole.usage.output_tokens
    export = await proxy_client.trajectories(trial.trial_id)
    assert len(export["trajectories"]) == 3  # siblings of one context
    first, *others = (t["response_ids"] for t in export["trajectories"])
    assert all(o == first for o in others)
    assert whole.usage.output_tokens == sum(export["trajectories"][0]["response_mask"])


async def test_claude_code_shaped_stream_has_event_lines(
    proxy_client: ProxyClient, http: aiohttp.ClientSession
) -> None:
    """A request shaped like Claude Code's (``?beta=true``, its headers, system blocks with
    cache_control, metadata, thinking) streams events that each name themselves in an
    ``event:`` line, in Anthropic's order."""
    trial = await proxy_client.create_session(sampling={"seed": 2})
    body = {
        "model": "claude-relay-test",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "text", "text": "Be concise."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "list the files", "cache_control": {"type": "x"}},
                ],
            }
        ],
        "tools": ANTHROPIC_TOOLS,
        "metadata": {"user_id": "u"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
    }
    headers = {
        "x-api-key": trial.api_key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }
    url = f"{trial.anthropic_base_url}/v1/messages?beta=true"
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    events = [chunk.split("\n") for chunk in raw.strip().split("\n\n")]
    names: list[str] = []
    for lines in events:
        assert lines[0].startswith("event: "), lines
        assert lines[1].startswith("data: "), lines
        payload = json.loads(lines[1].removeprefix("data: "))
        assert payload["type"] == lines[0].removeprefix("event: ")
        names.append(payload["type"])
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    blocks = names[1:-2]
    while blocks:  # start, deltas, stop, per block
        assert blocks[0] == "content_block_start"
        end = blocks.index("content_block_stop")
        assert set(blocks[1:end]) == {"content_block_delta"}
        blocks = blocks[end + 1 :]
    (turn,) = await _turns(proxy_client, trial.trial_id)
    assert turn["sampling"]["max_tokens"] == 64  # the stack's cap wins over 32000


@pytest.mark.parametrize("first_streamed", [False, True], ids=["plain-first", "streamed-first"])
async def test_tool_loop_continues_one_trajectory(
    scripted_client: ProxyClient,
    scripted: PacedScriptedEngine,
    tiny_model_dir: Path,
    first_streamed: bool,
) -> None:
    """An agent loop that echoes the assistant blocks and answers tool_use with tool_result
    blocks (alternating streamed and plain calls) extends one trajectory without branching,
    and the export is token-exact under teacher forcing. The worker is scripted to call
    tools on the first two turns (one plain, one streamed) and the fourth, and to answer in
    text on the others."""
    scripted.script(
        tiny_reply("", [("bash", {"command": "ls"})]),
        tiny_reply("Now the readme.", [("read_file", {"path": "README.md"})]),
        tiny_reply("The project has a readme and a main module."),
        tiny_reply("", [("bash", {"command": "ls"}), ("bash", {"command": "pwd"})]),
        tiny_reply("Done."),
    )
    trial = await scripted_client.create_session(sampling={"seed": 1, "temperature": 0.7})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look at the workspace."}]
    tool_uses = {False: 0, True: 0}  # by streamed
    async with _client(trial) as client:
        for turn in range(5):
            kwargs: dict[str, Any] = {
                "model": "m",
                "max_tokens": 48,
                "system": "You are a careful assistant with tools.",
                "messages": messages,
                "tools": ANTHROPIC_TOOLS,
            }
            streamed = (turn % 2 == 1) != first_streamed
            if streamed:
                async with client.messages.stream(**kwargs) as stream:
                    reply = await stream.get_final_message()
            else:
                reply = await client.messages.create(**kwargs)
            messages.append(_echo(reply))
            calls = [b for b in reply.content if b.type == "tool_use"]
            if reply.stop_reason != "max_tokens":
                assert (reply.stop_reason == "tool_use") == bool(calls)
            if calls:
                tool_uses[streamed] += len(calls)
                # A result's content as text blocks reads the same as the plain string.
                results: list[dict[str, Any]] = [
                    {"type": "tool_result", "tool_use_id": c.id, "content": "ok"} for c in calls
                ]
                results[0]["content"] = [{"type": "text", "text": "ok"}]
                messages.append({"role": "user", "content": results})
            else:
                messages.append({"role": "user", "content": f"Keep going ({turn})."})
    # Tool_use blocks of the first turn's kind, and of the other, were sent back.
    assert tool_uses[first_streamed]
    assert tool_uses[not first_streamed]
    export = await scripted_client.trajectories(trial.trial_id)
    (traj,) = export["trajectories"]
    assert [t["branch_reason"] for t in traj["turns"]] == ["new_session"] + ["continued"] * 4
    assert sum(t["tool_calls"] for t in traj["turns"]) == sum(tool_uses.values())
    report = check_fidelity(export, HFEngine.load(tiny_model_dir).score)
    assert report.sampled_tokens > 20
    assert report.max_abs_error <= 1e-4, report


async def test_system_string_and_blocks_render_alike(
    proxy_client: ProxyClient, tokenizer: Any
) -> None:
    """``system`` as a string and as text blocks render the same system message (blocks
    joined by a blank line), at the start of the prompt."""
    trial = await proxy_client.create_session(sampling={"seed": 3})
    user: Any = [{"role": "user", "content": "hi"}]
    async with _client(trial) as client:
        await client.messages.create(model="m", max_tokens=2, system="One.\n\nTwo.", messages=user)
        await client.messages.create(
            model="m",
            max_tokens=2,
            system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}],
            messages=user,
        )
        await client.messages.create(model="m", max_tokens=2, messages=user)
    with_string, with_blocks, without = (
        t["prompt_ids"] for t in (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    )
    assert with_string == with_blocks != without
    assert tokenizer.decode(with_blocks).startswith("<|im_start|>system\nOne.\n\nTwo.<|im_end|>")


async def test_mid_conversation_system_message_continues(
    proxy_client: ProxyClient, tokenizer: Any
) -> None:
    """A ``system`` message after the history (as Claude Code sends) continues the session
    and is rendered last, right before the reply."""
    trial = await proxy_client.create_session(sampling={"seed": 5})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    async with _client(trial) as client:
        first = await client.messages.create(model="m", max_tokens=8, messages=messages)
        messages += [
            _echo(first),
            {"role": "user", "content": "and now?"},
            {"role": "system", "content": [{"type": "text", "text": "Reminder: be brief."}]},
        ]
        second = await client.messages.create(model="m", max_tokens=8, messages=messages)
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    assert [t["branch_reason"] for t in traj["turns"]] == ["new_session", "continued"]
    prompt = traj["prompt_ids"] + traj["response_ids"][: traj["turns"][1]["response_start"]]
    assert second.usage.input_tokens == len(prompt)
    assert tokenizer.decode(prompt).endswith(
        "<|im_start|>user\nand now?<|im_end|>\n"
        "<|im_start|>system\nReminder: be brief.<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_count_tokens_equals_the_recorded_prompt(proxy_client: ProxyClient) -> None:
    """count_tokens gives the prompt length the same request then records, counts tools
    but not server tools, and records nothing itself."""
    trial = await proxy_client.create_session(sampling={"seed": 6})
    kwargs: dict[str, Any] = {
        "model": "m",
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "list the files"}]}],
        "tools": ANTHROPIC_TOOLS,
    }
    async with _client(trial) as client:
        counted = await client.messages.count_tokens(**kwargs)
        with_server_tool = await client.messages.count_tokens(
            **(kwargs | {"tools": [*ANTHROPIC_TOOLS, {"type": "web_search_20250305", "name": "s"}]})
        )
        without_tools = await client.messages.count_tokens(
            model="m", system=kwargs["system"], messages=kwargs["messages"]
        )
        assert (await proxy_client.get_session(trial.trial_id))["turns"] == 0
        reply = await client.messages.create(max_tokens=4, **kwargs)
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    assert counted.input_tokens == reply.usage.input_tokens == len(traj["prompt_ids"])
    assert with_server_tool.input_tokens == counted.input_tokens > without_tools.input_tokens


async def test_stop_sequence_and_max_tokens_stop_reasons(proxy_client: ProxyClient) -> None:
    """A stop sequence cuts the text before it (stop_reason stop_sequence, echoed), and a
    one-token cap ends with max_tokens unless the end-of-turn token came first."""
    trial = await proxy_client.create_session(sampling={"seed": 2})
    user: Any = [{"role": "user", "content": "words"}]
    async with _client(trial) as client:
        free = await client.messages.create(model="m", max_tokens=40, messages=user)
        text = _text(free)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip()
        cut = await client.messages.create(
            model="m", max_tokens=40, messages=user, stop_sequences=[stop]
        )
        one = await client.messages.create(model="m", max_tokens=1, messages=user)
    assert _text(cut) == text[: text.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    turns = await _turns(proxy_client, trial.trial_id)
    assert turns[1]["stop_sequence"] == stop
    assert one.usage.output_tokens == 1
    assert one.stop_reason == (
        "max_tokens" if turns[2]["finish_reason"] == "length" else "end_turn"
    )


async def test_tool_choice_none_never_returns_tool_use(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine
) -> None:
    """With tool_choice none the tools stay rendered but nothing becomes a tool_use: a reply
    in tool-call markup comes back as text."""
    scripted.script(tiny_reply("", [("bash", {"command": "ls"})]))
    trial = await scripted_client.create_session()
    async with _client(trial) as client:
        reply = await client.messages.create(
            model="m",
            max_tokens=40,
            messages=[{"role": "user", "content": "list the files"}],
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "none"},
        )
    assert all(b.type == "text" for b in reply.content)
    assert reply.stop_reason in {"end_turn", "max_tokens"}
    assert '<tool_call>\n{"name": "bash"' in _text(reply)
    (prompt,) = scripted.prompts
    assert '"name": "bash"' in scripted.tokenizer.decode(prompt)  # type: ignore[attr-defined]


async def test_unknown_trial_is_404_in_anthropic_shape(stack: RunningProxy) -> None:
    """An unknown trial raises the SDK's NotFoundError with Anthropic's error body, for
    messages and count_tokens alike."""
    missing = TrialSession("nope", f"{stack.url}/nope/v1", "rr-key")
    async with _client(missing) as client:
        with pytest.raises(anthropic.NotFoundError) as caught:
            await client.messages.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
        with pytest.raises(anthropic.NotFoundError) as counted:
            await client.messages.count_tokens(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
    for exc in (caught.value, counted.value):
        assert exc.body == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "unknown trial 'nope'"},
        }


GOOD: dict[str, Any] = {
    "model": "m",
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "x"}],
}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


def _body(**changes: Any) -> bytes:
    return json.dumps(GOOD | changes).encode()


def _tool_result(content: Any) -> list[dict[str, Any]]:
    block = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
    return [{"role": "user", "content": [block]}]


@pytest.mark.parametrize(
    ("raw", "needle", "counted_too"),
    [
        (b"{not json", "not valid JSON", True),
        (b"", "empty", True),
        (json.dumps({"model": "m", "max_tokens": 4}).encode(), "messages", True),
        (_body(messages=[]), "messages", True),
        (_body(messages=[{"role": "tool", "content": "x"}]), "messages.0.role", True),
        (_body(temperature=3), "temperature", False),  # count_tokens has no sampling
        (_body(max_tokens=0), "max_tokens", False),
        (_body(tool_choice={"type": "any"}), "needs tools", True),
        (
            _body(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"}),
            "not among the tools",
            True,
        ),
        (_body(tools=[{"name": "t"}]), "tools.0: a custom tool needs input_schema", True),
        (
            _body(messages=[{"role": "user", "content": [IMAGE]}]),
            "messages.0.content.0: the image data is not an image",
            True,
        ),
        (
            _body(system=[{"type": "document", "source": {}}]),
            "system.0: document blocks are not supported",
            True,
        ),
        (
            _body(messages=_tool_result([IMAGE])),
            "messages.0.content.0.content.0: the image data is not an image",
            True,
        ),
        (
            _body(system=[{"type": "text", "text": "s"}, IMAGE]),
            "system.1: images are taken in user messages and tool results only",
            True,
        ),
        (
            _body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "x"}]}]),
            "needs id and name",
            True,
        ),
    ],
)
async def test_bad_requests_are_400_in_anthropic_shape(
    proxy_client: ProxyClient,
    http: aiohttp.ClientSession,
    raw: bytes,
    needle: str,
    counted_too: bool,
) -> None:
    """Malformed or unsupported bodies get a 400 invalid_request_error and record nothing."""
    trial = await proxy_client.create_session()
    paths = ["/v1/messages"] + (["/v1/messages/count_tokens"] if counted_too else [])
    for path in paths:
        async with http.post(f"{trial.anthropic_base_url}{path}", data=raw) as response:
            body = await response.json(content_type=None)
        assert response.status == 400, body
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert needle in body["error"]["message"]
    assert (await proxy_client.get_session(trial.trial_id))["turns"] == 0


async def test_image_block_raises_the_sdk_bad_request(proxy_client: ProxyClient) -> None:
    """Through the SDK, an image block whose data is no image is a BadRequestError (400)."""
    trial = await proxy_client.create_session()
    async with _client(trial) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}]
            )
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"


async def test_completed_session_is_409(proxy_client: ProxyClient) -> None:
    """A completed session refuses new messages with 409 and Anthropic's error shape."""
    trial = await proxy_client.create_session()
    await proxy_client.complete(trial.trial_id, reward=0.0)
    async with _client(trial) as client:
        with pytest.raises(anthropic.ConflictError) as caught:
            await client.messages.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
    assert caught.value.body["error"]["type"] == "invalid_request_error"


async def test_disconnect_mid_stream_records_a_truncated_turn(
    stack: RunningProxy, proxy_client: ProxyClient, http: aiohttp.ClientSession
) -> None:
    """A client that leaves mid-stream cancels the generation; the sampled part is kept."""
    trial = await proxy_client.create_session(sampling={"seed": 1, "max_tokens": 60})
    body = {"model": "m", "max_tokens": 60, "stream": True}
    body["messages"] = [{"role": "user", "content": "long answer"}]
    async with http.post(f"{trial.anthropic_base_url}/v1/messages", json=body) as response:
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"event: message_start")
    for _ in range(100):
        if (await proxy_client.get_session(trial.trial_id))["turns"] == 1:
            break
        await asyncio.sleep(0.05)
    (turn,) = await _turns(proxy_client, trial.trial_id)
    assert turn["truncated"] is True
    assert turn["finish_reason"] == "abort"
    assert turn["completion_tokens"] < 60
    assert stack.app[POOL].in_flight == 0


async def test_tool_choice_any_and_tool_are_recorded_as_unmet_without_a_call(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine
) -> None:
    """tool_choice any / tool map to required / a tool's name: a reply without the call is
    flagged tool_choice_unmet, unlike with auto."""
    choices: list[Any] = [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "bash"}]
    # No choice is forced on the model, only checked: the worker answers in text each time.
    scripted.script(*(tiny_reply(f"I will look at it ({i}).") for i in range(len(choices))))
    trial = await scripted_client.create_session(sampling={"seed": 1, "temperature": 1.0})
    async with _client(trial) as client:
        replies = [
            await client.messages.create(
                model="m",
                max_tokens=48,
                system="You are a careful assistant with tools.",
                messages=[{"role": "user", "content": "Look at the workspace."}],
                tools=ANTHROPIC_TOOLS,
                tool_choice=choice,
            )
            for choice in choices
        ]
    assert all(r.content and r.content[0].type == "text" for r in replies)
    turns = await _turns(scripted_client, trial.trial_id)
    assert [t["tool_choice_unmet"] for t in turns] == [False, True, True]


async def test_missing_max_tokens_leaves_the_caps_in_charge(
    proxy_client: ProxyClient, http: aiohttp.ClientSession
) -> None:
    """A body without max_tokens is accepted; the session's cap applies."""
    trial = await proxy_client.create_session(sampling={"seed": 1, "max_tokens": 3})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{trial.anthropic_base_url}/v1/messages", json=body) as response:
        assert response.status == 200
        reply = await response.json()
    (turn,) = await _turns(proxy_client, trial.trial_id)
    assert turn["sampling"]["max_tokens"] == 3
    assert reply["usage"]["output_tokens"] == turn["completion_tokens"] <= 3


async def test_error_after_the_stream_started_is_an_error_event(
    stack: RunningProxy, proxy_client: ProxyClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure once text has streamed arrives as an ``error`` event in Anthropic's shape
    (the SDK raises it), the generation is stopped and the partial turn is kept."""
    service = stack.app[SERVICE]
    real_stream = TurnService.stream

    async def failing(prepared: Any) -> AsyncGenerator[TurnEvent, None]:
        # Every delta through this generator (the relay would write them past it).
        prepared.sink = None
        events = real_stream(service, prepared)
        try:
            async for event in events:
                yield event
                if isinstance(event, TextDelta):
                    raise UpstreamError("the worker was lost", code="worker_lost")
        finally:
            await events.aclose()

    monkeypatch.setattr(service, "stream", failing)
    trial = await proxy_client.create_session(sampling={"seed": 3, "max_tokens": 40})
    seen: list[str] = []

    async def consume(client: AsyncAnthropic) -> None:
        async with client.messages.stream(
            model="m", max_tokens=40, messages=[{"role": "user", "content": "go on"}]
        ) as stream:
            async for event in stream:
                seen.append(event.type)

    async with _client(trial) as client:
        with pytest.raises(anthropic.APIStatusError) as caught:
            await consume(client)
    assert seen[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert "message_stop" not in seen
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "api_error", "message": "the worker was lost"},
    }
    (turn,) = await _turns(proxy_client, trial.trial_id)
    assert turn["truncated"] is True
    assert stack.app[POOL].in_flight == 0
