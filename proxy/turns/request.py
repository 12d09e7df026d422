"""What a turn is made of, as the agent APIs and the turn's steps pass it along: the
request an API adapter translates its wire format into, the events a generation yields,
and the result a recorded turn answers with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from proxy.chat.messages import ChatMessage, Tool, ToolCall
from proxy.images import ImageData
from proxy.sampling import AgentSampling
from proxy.sessions.agents import AgentClaim
from proxy.sessions.model import TurnNode
from proxy.sessions.retries import RetryMarks

__all__ = [
    "EventSink",
    "ReasoningDelta",
    "TextDelta",
    "ToolCallReady",
    "TurnDone",
    "TurnEvent",
    "TurnRequest",
    "TurnResult",
]


@dataclass(slots=True, frozen=True)
class TurnRequest:
    api: str
    requested_model: str
    messages: Sequence[ChatMessage]
    tools: Sequence[Tool]
    sampling: AgentSampling
    # Generation ends when the text contains one of these; it is not part of the reply.
    stop: tuple[str, ...] = ()
    # "auto" | "none" (tool calls are not parsed) | "required" | a tool's name.
    tool_choice: str = "auto"
    # A raw prompt (legacy completions): sent as given, no chat template; ``messages``
    # and ``tools`` are then empty.
    prompt_ids: tuple[int, ...] | None = None
    # How the request's attempts are told apart (None: it is never treated as a retry).
    marks: RetryMarks | None = None
    # The bytes of the images the messages name that this request brought, by sha256
    # (the others the session holds already).
    images: Mapping[str, ImageData] = field(default_factory=dict)
    # The agent its headers name (None: none; proxy.sessions.agents).
    agent: AgentClaim | None = None


@dataclass(slots=True, frozen=True)
class TurnResult:
    node: TurnNode
    model: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str  # stop | length | abort | stop_sequence
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None  # which stop string ended the generation
    reasoning: str = ""  # the reasoning the model wrote before its answer
    replayed: bool = False  # a retry answered with the recorded reply of ``node``


@dataclass(slots=True, frozen=True)
class TextDelta:
    """Content text the client may be shown now."""

    text: str


@dataclass(slots=True, frozen=True)
class ReasoningDelta:
    """Reasoning text the client may be shown now."""

    text: str


@dataclass(slots=True, frozen=True)
class ToolCallReady:
    """A complete tool call, parsed while streaming."""

    index: int
    call: ToolCall


@dataclass(slots=True, frozen=True)
class TurnDone:
    result: TurnResult


TurnEvent = TextDelta | ReasoningDelta | ToolCallReady | TurnDone


class EventSink(Protocol):
    """A stream's writer, as the relay sees it: events written without waiting."""

    def writable_now(self) -> bool:
        """Whether ``write_now`` can write at once (else the events wait for the
        writer's own loop)."""

    def write_now(self, events: Sequence[TurnEvent]) -> None:
        """Write these events (never ``TurnDone``) to the client, without waiting."""
