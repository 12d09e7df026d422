"""The internal message model every agent API translates into, and its canonical hash.

Sessions recognise that a request continues an earlier context by hashing messages, not
by storing them: a session keeps one 16-byte digest per turn instead of every turn's
message list. The canonical form keeps what a chat template renders (role, text, images by
the hash of their bytes and in their places, tool calls with their arguments as canonical
JSON, the tool-call id a tool result answers)
and drops what clients rewrite freely (``null`` vs ``""`` content, whitespace inside
argument JSON, key order, tool-call ids on assistant messages). An assistant message's
reasoning is outside the hash too: agents send it back or drop it as they please, and
the sampled reasoning is in the session's token ids either way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

Role = Literal["system", "developer", "user", "assistant", "tool"]


# Messages are msgspec Structs the cyclic garbage collector does not track (``gc=False``;
# they hold strings and tuples of tool calls, never a cycle): sessions remember their recent
# histories (``proxy.chat.history``), and a full collection that had to scan 300k messages
# as dataclasses stalled the proxy ~66 ms, as Structs ~9 ms.


class ToolCall(msgspec.Struct, frozen=True, gc=False):
    id: str
    name: str
    arguments: str  # a JSON object as text, exactly as the client sees it


class ImagePart(msgspec.Struct, frozen=True, gc=False):
    """An image in a message, named by the sha256 of its bytes as the agent sent them (the
    bytes themselves travel beside the messages, once per image). Its size decides how many
    tokens a vision-language model gives it."""

    sha256: str
    media_type: str
    width: int
    height: int


class ChatMessage(msgspec.Struct, frozen=True, gc=False):
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant message's reasoning, as the agent sent it (no other role has one).
    reasoning: str | None = None
    # A message with images: its text and images in order (``content`` is its text alone).
    # Empty for a message of text only.
    parts: tuple[str | ImagePart, ...] = ()

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(part for part in self.parts if isinstance(part, ImagePart))

    def template_dict(self, *, string_arguments: bool = False) -> dict[str, Any]:
        """The message as Hugging Face chat templates expect it. Tool-call arguments are
        a mapping, or their JSON text for templates that concatenate them
        (``string_arguments``). Reasoning goes under both names templates read it from
        (``reasoning_content``: Qwen3, GLM; ``thinking``: gpt-oss)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content,
        }
        if self.parts:
            # The content-part list vision-language templates read (Qwen-VL: one
            # vision block per ``{"type": "image"}``, in its place among the text).
            out["content"] = [
                {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part}
                for part in self.parts
            ]
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": c.arguments
                        if string_arguments
                        else _arguments_object(c.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.reasoning:
            out["reasoning_content"] = out["thinking"] = self.reasoning
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def template_dict(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _arguments_object(arguments: str) -> Any:
    """Arguments as an object when they are valid JSON (templates render objects with
    ``tojson``), else the raw text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def canonical_arguments(arguments: str) -> str:
    try:
        return json.dumps(
            json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
    except ValueError:
        return arguments


# Compact UTF-8 JSON with object keys sorted: the bytes a context key hashes. Every
# message of every request is hashed, so this is msgspec's encoder rather than json.dumps.
_ENCODE = msgspec.json.Encoder(order="sorted").encode


def _canonical(message: ChatMessage) -> bytes:
    parts: list[Any] = [message.role, message.content]
    if message.parts:  # only then: a text message keeps the key it always had
        parts.append(
            [["i", p.sha256] if isinstance(p, ImagePart) else ["t", p] for p in message.parts]
        )
    if message.role == "assistant":
        parts.append([[c.name, canonical_arguments(c.arguments)] for c in message.tool_calls])
    if message.role == "tool":
        parts.append(message.tool_call_id)
    return _ENCODE(parts)


def _digest(previous: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(payload)
    return h.digest()


def root_key(tools: Sequence[Tool]) -> bytes:
    """The chain's start: the tool set is part of every context (templates render it)."""
    payload = _ENCODE([[t.name, t.description, t.parameters] for t in tools])
    return _digest(b"rollout-relay/1", payload)


def extend_key(previous: bytes, message: ChatMessage) -> bytes:
    return _digest(previous, _canonical(message))


def prefix_keys(tools: Sequence[Tool], messages: Sequence[ChatMessage]) -> list[bytes]:
    """``keys[k]`` identifies the context made of the tools and ``messages[:k]``."""
    keys = [root_key(tools)]
    for message in messages:
        keys.append(extend_key(keys[-1], message))
    return keys
