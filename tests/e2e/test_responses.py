"""The Responses API through the real proxy, relay, worker and tiny model, with the
official ``openai`` client (sync and async), and the raw wire for what Codex sends."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from proxy.api.responses.models import ResponsesRequest
from proxy.api.responses.output import ResponseEcho, ResponseHead, ResponseStream
from proxy.appkeys import POOL
from proxy.exceptions import UpstreamError
from proxy.images import ImageChecker, ImageIntake, ImageLimits
from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient, TrialSession
from sdk.fidelity import check_fidelity
from tests.scripted_worker import PacedScriptedEngine, tiny_reply
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e

# A request for tools, and what the tests that need a tool call script the worker to
# answer (tests.scripted_worker): a call alone, two calls, a line of text then a call.
TOOL_ASK = "please read the file README.md then run ls"
_TOOL_SAMPLING: dict[str, Any] = {"temperature": 0.7}
CALL_README = tiny_reply("", [("read_file", {"path": "README.md"})])
TWO_CALLS = tiny_reply("", [("read_file", {"path": "README.md"}), ("bash", {"command": "ls"})])
TEXT_THEN_CALL = tiny_reply("Let me look.", [("bash", {"command": "ls"})])

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "bash",
        "description": "Run a read-only command in the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
        "strict": False,
    },
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file of the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
        "strict": False,
    },
]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _async(trial: TrialSession) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)


def _sync(trial: TrialSession) -> OpenAI:
    return OpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)


async def _only_trajectory(proxy_client: ProxyClient, trial: TrialSession) -> dict[str, Any]:
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    result: dict[str, Any] = traj
    return result


async def _post(trial: TrialSession, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{trial.base_url}/responses", json=body) as response,
    ):
        return response.status, await response.json()


async def _sse(
    trial: TrialSession, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The raw stream as (event line, data) pairs."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{trial.base_url}/responses", json=body, headers=headers) as response,
    ):
        assert response.status == 200, await response.text()
        assert response.content_type == "text/event-stream"
        text = await response.text()
    events = []
    for block in text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        events.append(
            (event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: ")))
        )
    return events


def _check_sequence(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Every event names its type, numbers itself, and validates as the SDK's event."""
    assert [e[1]["sequence_number"] for e in events] == list(range(len(events)))
    for name, data in events:
        assert name == data["type"]
        EVENTS.validate_python(data)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1][0] in {"response.completed", "response.incomplete"}


async def test_sync_create_reports_exact_usage(proxy_client: ProxyClient) -> None:
    """The sync client gets a completed response whose usage equals the recorded counts."""
    trial = await proxy_client.create_session(sampling={"seed": 3})

    def call() -> Response:
        with _sync(trial) as client:
            return client.responses.create(model="m", input="hello", max_output_tokens=8)

    reply = await asyncio.to_thread(call)
    traj = await _only_trajectory(proxy_client, trial)
    assert reply.object == "response"
    assert reply.id.startswith("resp_")
    assert reply.usage is not None
    assert reply.usage.input_tokens == len(traj["prompt_ids"])
    assert reply.usage.output_tokens == sum(traj["response_mask"]) >= 1
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert traj["turns"][0]["api"] == "openai.responses"


async def test_response_object_validates_with_the_sdk(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine
) -> None:
    """The raw JSON validates strictly as the SDK's Response, with and without tool calls."""
    scripted.script(tiny_reply("The files are main.py and README.md."), CALL_README)
    trial = await scripted_client.create_session(sampling={"seed": 1})
    status, body = await _post(
        trial, {"model": "m", "input": "list the files", "max_output_tokens": 40}
    )
    assert status == 200, body
    reply = Response.model_validate(body)
    assert reply.output, body
    assert reply.tools == []

    trial = await scripted_client.create_session(sampling=_TOOL_SAMPLING | {"seed": 1})
    status, body = await _post(
        trial, {"model": "m", "input": TOOL_ASK, "tools": TOOLS, "max_output_tokens": 40}
    )
    assert status == 200, body
    reply = Response.model_validate(body)
    assert [t.type for t in reply.tools] == ["function"] * len(TOOLS)
    call = next(o for o in reply.output if o.type == "function_call")
    assert call.call_id.startswith("call_")
    assert call.id is not None
    assert call.id.startswith("fc_")
    assert json.loads(call.arguments)


async def test_async_create_with_tools_returns_function_calls(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine
) -> None:
    """Parsed tool calls come back as function_call items matching the recorded turn."""
    scripted.script(TWO_CALLS)
    trial = await scripted_client.create_session(sampling=_TOOL_SAMPLING | {"seed": 1})
    async with _async(trial) as client:
        reply = await client.responses.create(
            model="m",
            input=[{"role": "user", "content": TOOL_ASK}],
            tools=TOOLS,  # type: ignore[arg-type]
            max_output_tokens=60,
        )
    calls = [o for o in reply.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["read_file", "bash"]
    assert all(o.status == "completed" for o in calls)
    turn = (await _only_trajectory(scripted_client, trial))["turns"][0]
    assert turn["tool_calls"] == len(calls)
    assert reply.status == "completed"


async def _stream_items(
    client: AsyncOpenAI, **kwargs: Any
) -> tuple[list[Any], list[str], Response]:
    """Output items from ``output_item.done`` (what Codex keeps), text deltas, final."""
    items: list[Any] = []
    deltas: list[str] = []
    final: Response | None = None
    async for event in await client.responses.create(stream=True, **kwargs):
        if event.type == "response.output_item.done":
            items.append(event.item)
        elif event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in {"response.completed", "response.incomplete"}:
            final = event.response
    assert final is not None
    return items, deltas, final


async def test_stream_equals_non_stream_for_the_session_seed(proxy_client: ProxyClient) -> None:
    """Deltas add up to the text; streamed and plain calls record the same ids and usage."""
    trial = await proxy_client.create_session(sampling={"seed": 7, "temperature": 1.0})
    kwargs: dict[str, Any] = {"model": "m", "input": "tell me a story", "max_output_tokens": 40}
    async with _async(trial) as client:
        whole = await client.responses.create(**kwargs)
        items, deltas, final = await _stream_items(client, **kwargs)
    assert len(deltas) >= 3
    assert "".join(deltas) == final.output_text == whole.output_text
    assert [i.model_dump() for i in items] == [o.model_dump() for o in final.output]
    export = await proxy_client.trajectories(trial.trial_id)
    first, second = export["trajectories"]
    assert first["response_ids"] == second["response_ids"]
    assert final.usage is not None
    assert whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens == len(second["response_ids"])
    assert final.usage.input_tokens == len(second["prompt_ids"])


async def test_stream_helper_sync_with_tools(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine
) -> None:
    """The sync ``responses.stream`` helper accumulates text and function calls."""
    scripted.script(TEXT_THEN_CALL)

    def call(trial: TrialSession) -> tuple[list[str], Response]:
        with (
            _sync(trial) as client,
            client.responses.stream(
                model="m",
                input=TOOL_ASK,
                tools=TOOLS,  # type: ignore[arg-type]
                max_output_tokens=40,
            ) as stream,
        ):
            kinds: list[str] = [event.type for event in stream]
            # Cut at max_output_tokens, the helper would have no final response.
            assert kinds[-1] == "response.completed"
            return kinds, stream.get_final_response()

    trial = await scripted_client.create_session(sampling=_TOOL_SAMPLING | {"seed": 1})
    kinds, final = await asyncio.to_thread(call, trial)
    shape = [o.type for o in final.output]
    assert shape[:1] == ["message"]  # text, then a tool call
    assert "function_call" in shape
    assert kinds[-1] == "response.completed"
    calls = [o for o in final.output if o.type == "function_call"]
    assert kinds.count("response.output_item.done") == len(final.output)
    assert kinds.count("response.function_call_arguments.done") == len(calls)


async def test_stream_events_validate_and_keep_order(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine
) -> None:
    """Streamed events validate as the SDK's, in order: the message item, then calls."""
    scripted.script(TEXT_THEN_CALL)
    trial = await scripted_client.create_session(sampling=_TOOL_SAMPLING | {"seed": 1})
    body = {
        "model": "m",
        "input": TOOL_ASK,
        "tools": TOOLS,
        "max_output_tokens": 40,
        "stream": True,
    }
    events = await _sse(trial, body)
    _check_sequence(events)
    names = [name for name, _ in events]
    assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert len(done) >= 2  # text, then at least one call
    assert [i["type"] for i in done] == ["message"] + ["function_call"] * (len(done) - 1)
    assert events[-1][1]["response"]["output"] == done
    Response.model_validate(events[-1][1]["response"])


async def _tool_loop(
    client: AsyncOpenAI, turns: int, *, tools: list[dict[str, Any]], stream: bool
) -> list[list[Any]]:
    """An agent loop that sends every reply back with its function_call_output items (or
    a new user message), as Codex does; returns each turn's output items."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": "You are a careful agent."},
        {"role": "user", "content": "list the files"},
    ]
    outputs: list[list[Any]] = []
    for turn in range(turns):
        kwargs: dict[str, Any] = {"model": "m", "input": items, "max_output_tokens": 40}
        if tools:
            kwargs["tools"] = tools
        if stream:
            output, _, _ = await _stream_items(client, **kwargs)
        else:
            output = (await client.responses.create(**kwargs)).output
        outputs.append(output)
        items += [o.model_dump(exclude_none=True) for o in output]
        calls = [o for o in output if o.type == "function_call"]
        items += [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"ran {c.name}"}
            for c in calls
        ]
        if not calls:
            items.append(
                {"role": "user", "content": [{"type": "input_text", "text": f"go {turn}"}]}
            )
    return outputs


@pytest.mark.parametrize("stream", [False, True])
async def test_multi_turn_loop_with_tools_continues(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine, stream: bool
) -> None:
    """Output items sent back (+ function_call_output) continue the same trajectory."""
    # Turns with calls and turns with text only.
    scripted.script(CALL_README, tiny_reply("It has a title."), TEXT_THEN_CALL, tiny_reply("Done."))
    trial = await scripted_client.create_session(sampling={"seed": 1, "temperature": 1.0})
    async with _async(trial) as client:
        outputs = await _tool_loop(client, 4, tools=TOOLS, stream=stream)
    shapes = [[o.type for o in out] for out in outputs]
    assert any("function_call" in shape for shape in shapes), shapes
    assert ["message"] in shapes, shapes
    assert all(shape.count("message") <= 1 for shape in shapes), shapes  # one message item
    assert all(shape[1:] == ["function_call"] * (len(shape) - 1) for shape in shapes), shapes
    traj = await _only_trajectory(scripted_client, trial)
    assert [t["branch_reason"] for t in traj["turns"]] == ["new_session"] + ["continued"] * 3
    assert sum(t["tool_calls"] for t in traj["turns"]) == sum(
        shape.count("function_call") for shape in shapes
    )


async def test_multi_turn_loop_without_tools_continues(proxy_client: ProxyClient) -> None:
    """Text-only replies sent back as message items continue the same trajectory."""
    trial = await proxy_client.create_session(sampling={"seed": 5})
    async with _async(trial) as client:
        await _tool_loop(client, 3, tools=[], stream=False)
    traj = await _only_trajectory(proxy_client, trial)
    assert [t["branch_reason"] for t in traj["turns"]] == ["new_session", "continued", "continued"]


async def test_instructions_and_developer_messages_are_system_turns(
    stack: RunningProxy, proxy_client: ProxyClient, tiny_model_dir: Path
) -> None:
    """instructions, then developer messages, render as system messages before the user's."""
    trial = await proxy_client.create_session(sampling={"seed": 1})
    async with _async(trial) as client:
        await client.responses.create(
            model="m",
            instructions="Answer briefly.",
            input=[
                {"role": "developer", "content": "Prefer lists."},
                {"role": "user", "content": "hi"},
            ],
            max_output_tokens=4,
        )
    traj = await _only_trajectory(proxy_client, trial)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "system", "content": "Prefer lists."},
            {"role": "user", "content": "hi"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert tokenizer.decode(traj["prompt_ids"], skip_special_tokens=False) == expected


async def test_codex_like_request_is_accepted(
    stack: RunningProxy, proxy_client: ProxyClient, tiny_model_dir: Path
) -> None:
    """A Codex-shaped body streams to response.completed; hosted tools are not rendered."""
    trial = await proxy_client.create_session(sampling={"seed": 3})
    namespace = {
        "type": "namespace",
        "name": "mcp__files__",
        "description": "Workspace files.",
        "tools": [
            {
                "type": "function",
                "name": "stat_path",
                "description": "Stat a path.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
                "strict": False,
            }
        ],
    }
    body = {
        "model": "gpt-5-codex",
        "instructions": None,
        "input": [
            {
                "type": "message",
                "id": "msg_dev",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "list the files"}],
            },
        ],
        "tools": [*TOOLS, namespace, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-thread",
        "client_metadata": {"x-codex-installation-id": "abc"},
        "text": {"verbosity": "low"},
    }
    headers = {"Accept": "text/event-stream", "session-id": "s1", "thread-id": "s1"}
    events = await _sse(trial, body, headers)
    _check_sequence(events)  # to response.completed or .incomplete (the stack's token cap)
    final = Response.model_validate(events[-1][1]["response"])
    assert [t.type for t in final.tools] == ["function", "function", "namespace"]
    assert final.parallel_tool_calls is False
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompt = tokenizer.decode((await _only_trajectory(proxy_client, trial))["prompt_ids"])
    assert "mcp__files__stat_path" in prompt
    assert "web_search" not in prompt
    assert prompt.index("You are Codex.") < prompt.index("list the files")


async def test_max_output_tokens_one_is_incomplete(proxy_client: ProxyClient) -> None:
    """A 1-token cap gives status incomplete (max_output_tokens), streamed or not."""
    trial = await proxy_client.create_session(sampling={"seed": 1})
    kwargs: dict[str, Any] = {"model": "m", "input": "count to ten", "max_output_tokens": 1}
    async with _async(trial) as client:
        reply = await client.responses.create(**kwargs)
        _, _, streamed = await _stream_items(client, **kwargs)
    assert reply.usage is not None
    assert reply.usage.output_tokens == 1
    export = await proxy_client.trajectories(trial.trial_id)
    turn = export["trajectories"][0]["turns"][0]
    assert turn["finish_reason"] == "length"  # seed 1 does not stop at once
    assert turn["sampling"]["max_tokens"] == 1
    for response in (reply, streamed):
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"


async def test_unsupported_requests_are_400_and_unknown_trial_404(
    stack: RunningProxy, proxy_client: ProxyClient
) -> None:
    """Unsupported input is a 400 in the OpenAI error shape; an unknown trial is a 404."""
    trial = await proxy_client.create_session()
    async with _async(trial) as client:
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await client.responses.create(
                model="m", input="hi", previous_response_id="resp_123", stream=True
            )
        image_part = {"type": "input_image", "image_url": "data:image/png;base64,"}
        with pytest.raises(openai.BadRequestError) as image:
            await client.responses.create(
                model="m",
                input=[{"role": "user", "content": [image_part]}],  # type: ignore[list-item,misc]
            )
        assert image.value.code == "invalid_image"
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            await client.responses.create(  # type: ignore[call-overload]
                model="m",
                input="hi",
                tools=TOOLS,
                tool_choice={"type": "function", "name": "nope"},
            )
    lost = TrialSession("no-such-trial", f"{stack.url}/no-such-trial/v1", "key")
    async with _async(lost) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="m", input="hi")
    assert (await proxy_client.get_session(trial.trial_id))["turns"] == 0


async def test_disconnect_mid_stream_records_a_truncated_turn(
    stack: RunningProxy, proxy_client: ProxyClient
) -> None:
    """A client that leaves mid-stream cancels the generation; the sampled part is kept."""
    trial = await proxy_client.create_session(sampling={"seed": 1, "max_tokens": 60})
    body = {"model": "m", "input": "long answer", "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{trial.base_url}/responses", json=body) as response,
    ):
        assert response.status == 200
        await response.content.readline()  # the first event line; then the client goes away
    for _ in range(100):
        if (await proxy_client.get_session(trial.trial_id))["turns"] == 1:
            break
        await asyncio.sleep(0.05)
    turn = (await _only_trajectory(proxy_client, trial))["turns"][0]
    assert turn["truncated"] is True
    assert turn["completion_tokens"] < 60
    assert stack.app[POOL].in_flight == 0


async def test_exported_loop_is_token_faithful(
    proxy_client: ProxyClient, tiny_model_dir: Path
) -> None:
    """A streamed tool-using loop exports logprobs that match teacher forcing within 1e-4."""
    trial = await proxy_client.create_session(sampling={"seed": 0, "temperature": 1.0})
    async with _async(trial) as client:
        await _tool_loop(client, 3, tools=TOOLS, stream=True)
    export = await proxy_client.trajectories(trial.trial_id)
    assert len(export["trajectories"]) == 1
    report = check_fidelity(export, HFEngine.load(tiny_model_dir).score)
    assert report.sampled_tokens > 30
    assert report.max_abs_error <= 1e-4, report


def test_output_items_translate_back_to_one_assistant_message() -> None:
    """A message item and its function_call items become one assistant message."""
    parsed = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "sys",
            "tools": [
                {
                    "type": "namespace",
                    "name": "mcp__fs__",
                    "description": "",
                    "tools": [{"type": "function", "name": "ls"}, {"type": "custom", "name": "x"}],
                },
                {"type": "web_search"},
            ],
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "ok", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "ls",
                    "namespace": "mcp__fs__",
                    "arguments": "{}",
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "ls",
                    "namespace": "mcp__fs__",
                    "arguments": '{"a": 1}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "y"}],
                },
                {"type": "function_call", "call_id": "c3", "name": "ls", "namespace": "mcp__fs__"},
            ],
        }
    )
    messages = parsed.internal_messages(ImageIntake(ImageChecker(ImageLimits())))
    assert [(m.role, m.content) for m in messages] == [
        ("system", "sys"),
        ("user", "hi"),
        ("assistant", "ok"),
        ("tool", "x"),
        ("tool", "y"),
        ("assistant", ""),
    ]
    assert [c.name for c in messages[2].tool_calls] == ["mcp__fs__ls", "mcp__fs__ls"]
    assert [m.tool_call_id for m in messages[3:5]] == ["c1", "c2"]
    assert [t.name for t in parsed.internal_tools()] == ["mcp__fs__ls"]
    assert parsed.namespaces() == {"mcp__fs__ls": ("mcp__fs__", "ls")}


def test_failed_stream_event_carries_the_error() -> None:
    """An error after the stream began ends it with response.failed carrying the code."""
    echo = ResponseEcho(None, [], "auto", True, None)
    writer = ResponseStream(ResponseHead("resp_1", 0, "m", 1.0, 1.0, echo))
    events = writer.start() + writer.text("partial")
    events += writer.fail(UpstreamError("the worker was lost", code="worker_lost"))
    kind, data = events[-1]
    assert kind == "response.failed"
    assert data["response"]["status"] == "failed"
    assert data["response"]["error"] == {"code": "worker_lost", "message": "the worker was lost"}
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    with pytest.raises(RuntimeError):
        writer.text("more")
