"""Context keys: stable bytes, so that sessions stored by one version keep continuing."""

from __future__ import annotations

import json

from proxy.chat.messages import ChatMessage, ImagePart, Tool, _canonical, prefix_keys, root_key


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


def _picture(sha: str, size: tuple[int, int] = (64, 48)) -> ImagePart:
    return ImagePart(sha256=sha, media_type="image/png", width=size[0], height=size[1])


def test_images_are_in_the_key_by_hash_and_place() -> None:
    """A message's images are part of its context key by the hash of their bytes and their
    place among the text: the same image again keeps the key, another image or the same one
    elsewhere changes it, and a text message keeps the key it had before images existed."""
    a, b = _picture("a" * 64), _picture("b" * 64)

    def key(*parts: str | ImagePart) -> bytes:
        text = "".join(p for p in parts if isinstance(p, str))
        message = ChatMessage(role="user", content=text, parts=parts)
        return prefix_keys([], [message])[-1]

    assert key("look", a) == key("look", _picture("a" * 64, (1, 1)))  # the bytes name it
    assert len({key("look", a), key("look", b), key(a, "look"), key("look", a, a)}) == 4
    assert key("look") != key("look", a)
    text_only = ChatMessage(role="user", content="look")
    assert _canonical(text_only) == json.dumps(["user", "look"]).replace(" ", "").encode()
    assert key("a" * 64) != key(a)  # a text equal to a hash is not that image


def test_template_dict_lists_the_parts_in_order() -> None:
    """A message with images reaches the template as content parts, images in their
    places; a text message keeps plain string content."""
    a = _picture("a" * 64)
    message = ChatMessage(
        role="tool", content="shot:done", tool_call_id="c1", parts=("shot:", a, "done")
    )
    assert message.images == (a,)
    assert message.template_dict()["content"] == [
        {"type": "text", "text": "shot:"},
        {"type": "image"},
        {"type": "text", "text": "done"},
    ]
    assert ChatMessage(role="user", content="hi").template_dict()["content"] == "hi"
