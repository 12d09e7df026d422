"""Context keys: stable bytes, so that sessions stored by one version keep continuing."""

from __future__ import annotations

import json

from proxy.chat.messages import ChatMessage, Tool, _canonical, prefix_keys, root_key


def _message(role: str, content: str) -> ChatMessage:
    return ChatMessage(role=role, content=content)  # type: ignore[arg-type]


def test_canonical_bytes_are_compact_utf8_json() -> None:
    """The hashed bytes are exactly compact, non-ASCII-preserving JSON (the form stored
    keys were made with), control characters and line separators included."""
    text = 'héllo \u2028 \x01 \t\n "q" / 🙂'
    expected = json.dumps(["user", text], ensure_ascii=False, separators=(",", ":")).encode()
    assert _canonical(_message("user", text)) == expected


def test_keys_chain_over_messages_and_depend_on_tools() -> None:
    messages = [_message("system", "s"), _message("user", "u")]
    keys = prefix_keys([], messages)
    assert len(keys) == 3
    assert len(set(keys)) == 3
    assert prefix_keys([], messages[:1]) == keys[:2]
    tool = Tool(name="ls", description="list", parameters={"type": "object", "b": 1, "a": 2})
    assert root_key([tool]) != root_key([])
    same = Tool(name="ls", description="list", parameters={"a": 2, "type": "object", "b": 1})
    assert root_key([same]) == root_key([tool])  # key order in a schema does not matter


def test_messages_are_not_tracked_by_the_cyclic_garbage_collector() -> None:
    """Sessions remember their recent histories: their messages and tool calls must not
    make every full collection scan them."""
    import gc

    from proxy.chat.messages import ToolCall

    call = ToolCall("id-1", "search", '{"q": "x"}')
    message = ChatMessage("assistant", "text", (call,), reasoning="why")
    assert not gc.is_tracked(message)
    assert not gc.is_tracked(call)
    assert message == ChatMessage(
        "assistant", "text", (ToolCall("id-1", "search", '{"q": "x"}'),), reasoning="why"
    )
