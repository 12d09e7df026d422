"""A reply's sampled tokens as the agent sees them: text decoded as it grows, stop
strings, reasoning split from the answer, tool calls parsed while streaming; the same
steps whether the reply streams or is wanted whole."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from proxy.chat.detokenizer import IncrementalDetokenizer
from proxy.chat.harmony import HarmonySplitter
from proxy.chat.messages import Tool, ToolCall
from proxy.chat.reasoning import Piece, ReasoningPiece, ReasoningSplitter, Splitter
from proxy.chat.stops import StopMatcher
from proxy.ids import new_id
from proxy.toolcalls import (
    ContentDelta,
    ParsedOutput,
    ParsedToolCall,
    StreamEvent,
    ToolCallStream,
    get_parser,
)
from proxy.turns.attempt import PreparedTurn
from proxy.turns.request import ReasoningDelta, TextDelta, ToolCallReady, TurnEvent
from relay.pool import TokensEvent

__all__ = ["Decoding", "call_id", "splitter_for"]


class Decoding:
    """What one attempt of a turn made of its sampled tokens: the text decoded so far,
    stop strings, reasoning split from the answer, tool calls parsed while streaming.
    The same steps whether the relay delivers a step's tokens or the stream's consumer
    takes them."""

    __slots__ = (
        "calls",
        "detok",
        "logprobs",
        "on_call",
        "parser",
        "shown",
        "splitter",
        "stopper",
    )

    def __init__(
        self, prepared: PreparedTurn, on_call: Callable[[ToolCall], None] | None = None
    ) -> None:
        renderer = prepared.served.renderer
        self.detok = IncrementalDetokenizer(renderer.tokenizer, renderer.stop_token_ids)
        self.parser = _parser(prepared)
        self.splitter = splitter_for(prepared)
        self.stopper = StopMatcher(prepared.request.stop)
        self.logprobs: list[float] = []
        self.calls: list[ToolCall] = []
        self.shown = False  # an event went out: the reply can no longer restart
        # Told of each tool call as it is parsed, before the agent is sent it.
        self.on_call = on_call

    def add(self, tokens: TokensEvent) -> None:
        """Keep tokens to decode at the end (a consumer of the whole reply)."""
        self.logprobs.extend(tokens.logprobs)
        self.detok.add(tokens.token_ids)

    def feed(self, tokens: TokensEvent) -> list[TurnEvent]:
        """The events a step's tokens make (none while text is held back)."""
        return self.feed_ids(tokens.token_ids, tokens.logprobs)

    def feed_ids(self, ids: Sequence[int], logprobs: Sequence[float]) -> list[TurnEvent]:
        self.logprobs.extend(logprobs)
        text = self.stopper.feed(self.detok.push(ids))
        if not text:
            return []
        events = list(_parsed(self.parser, self.splitter.feed(text), self.calls, self.on_call))
        if events:
            self.shown = True
        return events

    def finish(self) -> tuple[list[TurnEvent], ParsedOutput]:
        """The events of what was held back, and the reply's parsed tool calls."""
        stopper = self.stopper
        tail = "" if stopper.hit is not None else stopper.feed(self.detok.flush()) + stopper.flush()
        pieces = (self.splitter.feed(tail) if tail else []) + self.splitter.finish()
        last = list(_parsed(self.parser, pieces, self.calls, self.on_call))
        events, parsed = self.parser.finish()
        last.extend(_parsed_events(events, self.calls, self.on_call))
        return last, parsed

    def reply_calls(self, parsed: ParsedOutput) -> tuple[ToolCall, ...]:
        """The reply's tool calls: those the agent was already sent keep their ids (a
        stream's, or a replay's as decoded), the rest get one now."""
        calls: list[ToolCall] = []
        for i, c in enumerate(parsed.tool_calls):
            sent = i < len(self.calls)
            calls.append(
                self.calls[i] if sent else ToolCall(call_id(c, calls), c.name, c.arguments)
            )
        return tuple(calls)


def _parser(prepared: PreparedTurn) -> ToolCallStream:
    parser = prepared.served.renderer.parser
    if prepared.request.tool_choice == "none" or not prepared.request.tools:
        # Without tools there is nothing to call; with tool_choice "none" the tools
        # stay rendered but calls are not parsed.
        parser = get_parser("none")
    return parser.stream(_tool_schemas(prepared.request.tools))


def splitter_for(prepared: PreparedTurn) -> Splitter:
    """Reasoning is separated on the chat APIs of a template that has it (a raw prompt
    gets its text as sampled)."""
    renderer = prepared.served.renderer
    if prepared.request.prompt_ids is not None:
        return ReasoningSplitter(enabled=False)
    if renderer.harmony:
        return HarmonySplitter()
    if not renderer.reasons:
        return ReasoningSplitter(enabled=False)
    return ReasoningSplitter(in_reasoning=renderer.opens_reasoning(prepared.plan.prompt_ids))


def _parsed(
    parser: ToolCallStream,
    pieces: list[Piece],
    calls: list[ToolCall],
    on_call: Callable[[ToolCall], None] | None,
) -> Iterator[TurnEvent]:
    """Reasoning pieces as they are; answer pieces through the tool-call parser."""
    for piece in pieces:
        if isinstance(piece, ReasoningPiece):
            yield ReasoningDelta(piece.text)
        else:
            yield from _parsed_events(parser.feed(piece.text), calls, on_call)


def _parsed_events(
    events: list[StreamEvent],
    calls: list[ToolCall],
    on_call: Callable[[ToolCall], None] | None,
) -> Iterator[TurnEvent]:
    for event in events:
        if isinstance(event, ContentDelta):
            if event.text:
                yield TextDelta(event.text)
        else:
            call = ToolCall(call_id(event.call, calls), event.call.name, event.call.arguments)
            calls.append(call)
            if on_call is not None:
                on_call(call)
            yield ToolCallReady(event.index, call)


def call_id(call: ParsedToolCall, earlier: Sequence[ToolCall]) -> str:
    """The id the model wrote for the call (Kimi-K2), unless an earlier call of the reply
    has it already; else a fresh one."""
    if call.id and all(c.id != call.id for c in earlier):
        return call.id
    return new_id("call")


def _tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    return [t.template_dict() for t in tools] if tools else None
