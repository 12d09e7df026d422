"""The chat body taken apart message by message answers as whole validation does: the
same fields and messages for a good body, the same error code and place for a bad one,
whatever the session remembers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.api.errors import parse_json
from proxy.api.openai.models import (
    ChatCompletionFields,
    ChatCompletionRequest,
    MessageIn,
    parse_chat_completion,
)
from proxy.chat.history import HistoryMemory
from proxy.chat.messages import ChatMessage
from proxy.exceptions import BadRequestError
from proxy.images import ImageChecker, ImageIntake, ImageLimits


def _intake() -> ImageIntake:
    return ImageIntake(ImageChecker(ImageLimits()))


HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "list files"},
    {"role": "assistant", "content": "ok"},
]


def _body(messages: Any = None, **fields: Any) -> bytes:
    payload: dict[str, Any] = {"model": "m"} | fields
    if messages is not None:
        payload["messages"] = messages
    return json.dumps(payload).encode()


def _with(index: int, message: Any) -> list[Any]:
    out: list[Any] = list(HISTORY)
    out[index] = message
    return out


def _whole(body: bytes) -> tuple[ChatCompletionFields, list[ChatMessage]]:
    """The reference: the whole body validated in one pydantic model."""
    whole = parse_json(ChatCompletionRequest, body)
    return whole, whole.internal_messages(_intake())


def _refusal(parse: Any, body: bytes) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        parse(body)
    return info.value


def _where(error: BadRequestError) -> str:
    """The place an error names: ``messages.3.role`` in
    ``invalid request: messages.3.role: ...``, ``messages.3`` in ``messages.3: ...``."""
    return error.message.removeprefix("invalid request: ").split(":")[0]


def _remembering() -> HistoryMemory:
    """A memory that has seen the good history (so only the changed part is new)."""
    memory = HistoryMemory()
    parse_chat_completion(_body(HISTORY), memory, _intake())
    return memory


BAD_BODIES: list[tuple[str, bytes, str, str]] = [
    # (name, body, code, where the error is)
    ("empty", b"", "invalid_json", "the request body is empty; expected JSON"),
    ("not json", b'{"model": "m", "messages": [', "invalid_json", "the request body is not valid JSON"),
    ("json array", b"[1, 2, 3]", "invalid_request", "body"),
    ("no messages", _body(), "invalid_request", "messages"),
    ("empty messages", _body([]), "invalid_request", "messages"),
    ("messages not a list", _body("hello"), "invalid_request", "messages"),
    ("messages an object", _body({"role": "user"}), "invalid_request", "messages"),
    ("bad role in message 3 of 5", _body(_with(3, {"role": "bot", "content": "x"})),
     "invalid_request", "messages.3.role"),
    ("message 3 not an object", _body(_with(3, 5)), "invalid_request", "messages.3"),
    ("tool message without tool_call_id", _body(_with(3, {"role": "tool", "content": "r"})),
     "invalid_message", "messages.3"),
    ("unknown content part",
     _body(_with(3, {"role": "user", "content": [{"type": "input_audio"}]})),
     "unsupported_content", "messages.3.content.0"),
    ("image_url part without its url",
     _body(_with(3, {"role": "user", "content": [{"type": "image_url"}]})),
     "invalid_request", "messages.3.content.0"),
    ("content a number", _body(_with(1, {"role": "user", "content": 5})),
     "invalid_request", "messages.1.content.str"),
    ("temperature 9", _body(HISTORY, temperature=9), "invalid_request", "temperature"),
    ("model missing", json.dumps({"messages": HISTORY}).encode(), "invalid_request", "model"),
    ("model empty", _body(HISTORY, model=""), "invalid_request", "model"),
    ("NaN temperature",
     _body(HISTORY).replace(b'"model": "m"', b'"model": "m", "temperature": NaN'),
     "invalid_request", "temperature"),
    ("n 0", _body(HISTORY, n=0), "invalid_request", "n"),
    ("invalid UTF-8 inside message 1",
     _body(_with(1, {"role": "user", "content": "@@"})).replace(b"@@", b"\xff\xfe"),
     "invalid_json", "the request body is not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "code", "where"),
    [pytest.param(body, code, where, id=name) for name, body, code, where in BAD_BODIES],
)
@pytest.mark.parametrize("memory", ["empty", "remembering"])
def test_a_bad_body_is_refused_as_whole_validation_refuses_it(
    body: bytes, code: str, where: str, memory: str
) -> None:
    """Same error code and place as the whole body validated in one model (and as the
    table says), with an empty memory or one that has seen the good history."""
    history = HistoryMemory() if memory == "empty" else _remembering()
    expected = _refusal(_whole, body)
    got = _refusal(lambda b: parse_chat_completion(b, history, _intake()), body)
    assert (got.code, _where(got)) == (expected.code, _where(expected))
    assert (got.code, _where(got)) == (code, where)
    assert got.status == 400


def test_the_first_bad_message_is_named() -> None:
    """Messages are validated and converted in order: a tool message without its
    tool_call_id at 1 is named before a bad role at 3 (whole validation names 3)."""
    history = [HISTORY[0], {"role": "tool", "content": "r"}, HISTORY[2], {"role": "bot"}]
    error = _refusal(lambda b: parse_chat_completion(b, HistoryMemory(), _intake()), _body(history))
    assert (error.code, error.message) == (
        "invalid_message",
        "messages.1: a tool message needs tool_call_id",
    )
    assert _where(_refusal(_whole, _body(history))) == "messages.3.role"


def test_an_invalid_message_in_a_remembered_history_is_refused() -> None:
    """Message 2 of a history seen before, replaced by an invalid one, is refused: the
    memory does not hide the change; a valid replacement parses as from scratch."""
    memory = _remembering()
    bad = _body(_with(2, {"role": "assistant", "content": "x", "tool_call_id": 7}))
    error = _refusal(lambda b: parse_chat_completion(b, memory, _intake()), bad)
    assert (error.code, _where(error)) == ("invalid_request", "messages.2.tool_call_id")
    error = _refusal(lambda b: parse_chat_completion(b, memory, _intake()), bad)  # and again
    assert _where(error) == "messages.2.tool_call_id"
    good = _body(_with(2, {"role": "assistant", "content": "something else"}))
    fields, messages = parse_chat_completion(good, memory, _intake())
    fresh_fields, fresh_messages = parse_chat_completion(good, HistoryMemory(), _intake())
    assert messages == fresh_messages == _whole(good)[1]
    assert messages[2].content == "something else"
    assert fields == fresh_fields


def test_a_message_only_reformatted_is_parsed_again_to_the_same_result() -> None:
    """A history whose messages are the same JSON written differently (spacing, key
    order) is not taken from the memory byte for byte but parses to the same messages."""
    memory = _remembering()
    compact = json.dumps(
        {"messages": [dict(reversed(m.items())) for m in HISTORY], "model": "m"},
        separators=(",", ":"),
    ).encode()
    assert parse_chat_completion(compact, memory, _intake())[1] == _whole(_body(HISTORY))[1]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "find things",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
CALLING: list[dict[str, Any]] = [
    {"role": "developer", "content": "use tools"},
    {"role": "user", "content": [{"type": "text", "text": "find "}, {"type": "input_text", "text": "x"}]},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I should search",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": {"q": "x", "ü": [1]}}},
            {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"q": "y"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "found x", "name": "search"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "output_text", "text": "found y"}]},
    {"role": "assistant", "content": "done", "reasoning": "both found"},
    {"role": "user", "content": "thanks", "unknown_field": {"ignored": True}},
]  # fmt: skip
GOOD_BODIES: list[tuple[str, bytes]] = [
    ("plain", _body(HISTORY)),
    ("tools and calls", _body(CALLING, tools=TOOLS, tool_choice="auto")),
    ("forced tool", _body(CALLING, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}})),
    ("sampling", _body(HISTORY, temperature=0.5, top_p=0.9, top_k=20, seed=3, max_tokens=7, n=2)),
    ("stop list", _body(HISTORY, stop=["\n", "END"], max_completion_tokens=9)),
    ("stream options", _body(HISTORY, stream=True, stream_options={"include_usage": True})),
    ("logprobs", _body(HISTORY, logprobs=True, top_logprobs=3, extra_body_field=[1, 2])),
    ("nulls", _body(HISTORY, tools=None, stop=None, temperature=None)),
]  # fmt: skip


@pytest.mark.parametrize("body", [pytest.param(b, id=name) for name, b in GOOD_BODIES])
@pytest.mark.parametrize("memory", ["empty", "remembering"])
def test_a_good_body_parses_as_whole_validation_parses_it(body: bytes, memory: str) -> None:
    """Fields and internal messages equal the whole body validated in one model."""
    history = HistoryMemory() if memory == "empty" else _remembering()
    fields, messages = parse_chat_completion(body, history, _intake())
    whole, whole_messages = _whole(body)
    assert messages == whole_messages
    assert fields.model_dump() == whole.model_dump(exclude={"messages"})
    assert fields.internal_tools() == whole.internal_tools()
    assert fields.stop_strings() == whole.stop_strings()
    assert fields.tool_choice_name() == whole.tool_choice_name()
    again = parse_chat_completion(body, history, _intake())  # now from the memory
    assert again[1] == whole_messages


def test_only_the_messages_past_a_remembered_history_are_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A history two messages longer than one parsed before converts those two only."""
    converted: list[int] = []
    original = MessageIn.to_internal

    def counting(self: MessageIn, index: int, intake: ImageIntake) -> ChatMessage:
        converted.append(index)
        return original(self, index, intake)

    monkeypatch.setattr(MessageIn, "to_internal", counting)
    memory = HistoryMemory()
    parse_chat_completion(_body(HISTORY), memory, _intake())
    assert converted == [0, 1, 2, 3, 4]
    longer = [*HISTORY, {"role": "user", "content": "more"}, {"role": "assistant", "content": "!"}]
    converted.clear()
    _, messages = parse_chat_completion(_body(longer, temperature=1.0), memory, _intake())
    assert converted == [5, 6]
    assert messages == _whole(_body(longer))[1]
