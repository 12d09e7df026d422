"""An Anthropic Messages body taken apart message by message: the same conversation and
the same refusals as validating it whole, converting only what a session has not seen."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.api.anthropic.models import MessagesRequest, parse_messages_request
from proxy.chat.history import HistoryMemory
from proxy.chat.messages import ChatMessage
from proxy.exceptions import BadRequestError
from proxy.images import ImageChecker, ImageIntake, ImageLimits


def _intake() -> ImageIntake:
    return ImageIntake(ImageChecker(ImageLimits()))


def _signed(thinking: str, signature: str) -> bool:
    return signature == "ok"


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "list the files"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "use ls", "signature": "ok"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "a.py\nb.py"},
            {"type": "text", "text": "and now?"},
        ],
    },
    {"role": "assistant", "content": "Two files."},
    {"role": "user", "content": [{"type": "text", "text": "thanks", "cache_control": {}}]},
]


def _body(messages: Any, **fields: Any) -> bytes:
    return json.dumps(
        {
            "model": "m",
            "max_tokens": 64,
            "system": [{"type": "text", "text": "You are terse."}],
            "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
            "messages": messages,
            **fields,
        }
    ).encode()


def _whole(body: bytes) -> list[ChatMessage]:
    return MessagesRequest.model_validate_json(body).internal_messages(_signed, _intake())


def test_the_conversation_equals_whole_validation_and_reuses_what_was_seen() -> None:
    """Growing histories (a tool result makes two internal messages) give the whole
    validation's conversation, system prompt first, each turn from one memory."""
    memory = HistoryMemory()
    for end in range(1, len(HISTORY) + 1):
        body = _body(HISTORY[:end])
        fields, messages = parse_messages_request(body, memory, _signed, _intake())
        assert messages == _whole(body)
        assert messages[0] == ChatMessage("system", "You are terse.")
        assert fields.max_tokens == 64
        assert [t.name for t in fields.internal_tools()] == ["ls"]


@pytest.mark.parametrize(
    ("messages", "code", "text"),
    [
        ([], "invalid_request", "messages"),
        ([{"role": "tool", "content": "x"}], "invalid_request", "messages.0.role"),
        (
            [*HISTORY[:2], {"role": "user", "content": [{"type": "document"}]}],
            "unsupported_content",
            "messages.2.content.0: document blocks are not supported",
        ),
        (
            [*HISTORY[:2], {"role": "user", "content": [{"type": "image"}]}],
            "invalid_request",
            "messages.2.content.0: an image block needs a source",
        ),
        (
            [*HISTORY[:2], {"role": "user", "content": [{"type": "tool_result"}]}],
            "invalid_request",
            "messages.2.content.0: a tool_result block needs tool_use_id",
        ),
    ],
)
def test_a_bad_message_is_refused_as_whole_validation_refuses_it(
    messages: list[dict[str, Any]], code: str, text: str
) -> None:
    """With a memory that saw the good history, a bad message still gets the code and
    place whole validation gives it."""
    memory = HistoryMemory()
    parse_messages_request(_body(HISTORY), memory, _signed, _intake())
    with pytest.raises(BadRequestError) as got:
        parse_messages_request(_body(messages), memory, _signed, _intake())
    assert got.value.code == code
    assert text in got.value.message


def test_a_thinking_block_whose_signature_fails_is_refused_even_when_remembered() -> None:
    """A changed signature is a changed message: checked again, not taken from memory."""
    memory = HistoryMemory()
    parse_messages_request(_body(HISTORY), memory, _signed, _intake())
    forged = json.loads(json.dumps(HISTORY))
    forged[1]["content"][0]["signature"] = "forged"
    body = _body(forged)
    with pytest.raises(BadRequestError) as whole:
        _whole(body)
    with pytest.raises(BadRequestError) as got:
        parse_messages_request(body, memory, _signed, _intake())
    assert got.value.code == whole.value.code
