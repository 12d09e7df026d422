"""The response object and the stream's event sequence, built without I/O.

A reply is an optional ``reasoning`` item (the model's reasoning, as ``reasoning_text``
content), at most one assistant message item, then one ``function_call`` item per tool
call: exactly what ``models.internal_messages`` turns back into the assistant
message the session recorded, so an agent that sends its output items back continues the
same trajectory. The message item is present whenever there is text or no tool call at
all (an empty reply is an empty message, and sent back it still matches the record).

Streaming follows https://platform.openai.com/docs/api-reference/responses-streaming:
``response.created``, ``response.in_progress``, then per item ``output_item.added`` …
``output_item.done`` (text through ``content_part.added`` / ``output_text.delta`` /
``output_text.done`` / ``content_part.done``), and last ``response.completed`` (or
``response.incomplete``); Codex fails a stream that does not end with it. Text is sent
as it is sampled. Function-call items are sent when the turn ends: the tool-call parser
only knows then whether text follows the calls (it belongs in the message item, which
comes first) or whether the output was malformed after all (then there is no call), and
the streamed items must equal the final output for the round trip above to hold.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy import ids
from proxy.chat.messages import ToolCall
from proxy.exceptions import ProxyError
from proxy.turns import TurnResult

Event = tuple[str, dict[str, Any]]  # (event name, payload)


@dataclass(slots=True, frozen=True)
class ResponseEcho:
    """What a response repeats of its request."""

    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    max_output_tokens: int | None
    # flat tool name → (namespace, name): calls are named as the agent declared them
    namespaces: Mapping[str, tuple[str, str]] = field(default_factory=dict)


def new_id(prefix: str) -> str:
    return ids.new_id(prefix)


def status_of(result: TurnResult) -> tuple[str, dict[str, Any] | None]:
    """``(status, incomplete_details)`` of a finished turn."""
    if result.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if result.finish_reason == "abort":
        return "incomplete", None
    return "completed", None


def usage_body(result: TurnResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """``text`` None: the item as first announced."""
    return {
        "type": "reasoning",
        "id": item_id,
        "status": status,
        "summary": [],
        "content": [] if text is None else [reasoning_part(text)],
        "encrypted_content": None,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """``text`` None: the item as first announced, before any content part."""
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [text_part(text)],
    }


def function_call_item(
    item_id: str, call: ToolCall, echo: ResponseEcho, *, arguments: str | None = None
) -> dict[str, Any]:
    """``arguments`` "" : the item as first announced, still in progress."""
    item: dict[str, Any] = {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }
    if call.name in echo.namespaces:
        item["namespace"], item["name"] = echo.namespaces[call.name]
    return item


def has_message(result: TurnResult) -> bool:
    return bool(result.content) or not result.tool_calls


def output_items(result: TurnResult, echo: ResponseEcho) -> list[dict[str, Any]]:
    status, _ = status_of(result)
    items: list[dict[str, Any]] = []
    if result.reasoning:
        items.append(reasoning_item(new_id("rs"), result.reasoning, status))
    if has_message(result):
        items.append(message_item(new_id("msg"), result.content, status))
    items.extend(function_call_item(new_id("fc"), c, echo) for c in result.tool_calls)
    return items


@dataclass(slots=True, frozen=True)
class ResponseHead:
    """The fields a response has from its start: id, time, model, sampling, echo."""

    id: str
    created_at: int
    model: str
    temperature: float
    top_p: float
    echo: ResponseEcho

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: dict[str, Any] | None = None,
        incomplete_details: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        echo = self.echo
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": error,
            "incomplete_details": incomplete_details,
            "instructions": echo.instructions,
            "max_output_tokens": echo.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": echo.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": self.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": echo.tool_choice,
            "tools": echo.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": {},
        }

    def final(self, result: TurnResult, output: list[dict[str, Any]]) -> dict[str, Any]:
        status, details = status_of(result)
        return self.body(status, output, usage=usage_body(result), incomplete_details=details)


def response_body(head: ResponseHead, result: TurnResult) -> dict[str, Any]:
    """The whole response of a non-streamed turn."""
    return head.final(result, output_items(result, head.echo))


class StreamPhase(enum.Enum):
    NEW = "new"
    STREAMING = "streaming"
    DONE = "done"  # completed, incomplete or failed: nothing may follow


class ResponseStream:
    """The events of one streamed response, each with its ``sequence_number``."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.phase = StreamPhase.NEW
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # finished items, in output order
        self._message_id: str | None = None  # the open message item
        self._text: list[str] = []
        self._reasoning_id: str | None = None  # the open reasoning item
        self._reasoning: list[str] = []

    def __repr__(self) -> str:
        return f"<ResponseStream {self.head.id} {self.phase.value} items={len(self._output)}>"

    def _event(self, kind: str, **payload: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return kind, event

    def _require(self, phase: StreamPhase) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"{self!r}: expected phase {phase.value}")

    def start(self) -> list[Event]:
        self._require(StreamPhase.NEW)
        self.phase = StreamPhase.STREAMING
        snapshot = self.head.body("in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def reasoning(self, delta: str) -> list[Event]:
        self._require(StreamPhase.STREAMING)
        events: list[Event] = []
        if self._reasoning_id is None:
            self._reasoning_id = new_id("rs")
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self._output),
                    item=reasoning_item(self._reasoning_id, None, "in_progress"),
                )
            )
        self._reasoning.append(delta)
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=self._reasoning_id,
                output_index=len(self._output),
                content_index=0,
                delta=delta,
            )
        )
        return events

    def _close_reasoning(self, status: str = "completed") -> list[Event]:
        if self._reasoning_id is None:
            return []
        item_id, index, text = self._reasoning_id, len(self._output), "".join(self._reasoning)
        done_item = reasoning_item(item_id, text, status)
        self._output.append(done_item)
        self._reasoning_id = None
        return [
            self._event(
                "response.reasoning_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
            ),
            self._event("response.output_item.done", output_index=index, item=done_item),
        ]

    def text(self, delta: str) -> list[Event]:
        self._require(StreamPhase.STREAMING)
        events = self._close_reasoning()
        if self._message_id is None:
            events.extend(self._open_message())
        assert self._message_id is not None
        self._text.append(delta)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self._message_id,
                output_index=len(self._output),
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def _open_message(self) -> list[Event]:
        self._message_id = new_id("msg")
        index = len(self._output)
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=message_item(self._message_id, None, "in_progress"),
            ),
            self._event(
                "response.content_part.added",
                item_id=self._message_id,
                output_index=index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def finish(self, result: TurnResult) -> list[Event]:
        """The rest of the reply, then ``response.completed`` or ``response.incomplete``."""
        self._require(StreamPhase.STREAMING)
        status, _ = status_of(result)
        events: list[Event] = self._close_reasoning()
        if self._message_id is None and has_message(result):
            events.extend(self._open_message())  # an empty reply is an empty message
        if self._message_id is not None:
            # The deltas add up to the parsed content (ToolCallStream guarantees it).
            text = result.content
            item_id, index = self._message_id, len(self._output)
            done_item = message_item(item_id, text, status)
            events += [
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=text_part(text),
                ),
                self._event("response.output_item.done", output_index=index, item=done_item),
            ]
            self._output.append(done_item)
            self._message_id = None
        for call in result.tool_calls:
            events.extend(self._function_call(call))
        self.phase = StreamPhase.DONE
        final = self.head.final(result, list(self._output))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        events.append(self._event(kind, response=final))
        return events

    def _function_call(self, call: ToolCall) -> list[Event]:
        item_id, index, echo = new_id("fc"), len(self._output), self.head.echo
        done_item = function_call_item(item_id, call, echo)
        self._output.append(done_item)
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=function_call_item(item_id, call, echo, arguments=""),
            ),
            self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=index,
                delta=call.arguments,
            ),
            self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                arguments=call.arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=done_item),
        ]

    def fail(self, exc: ProxyError) -> list[Event]:
        """``response.failed`` after an error mid-stream. The error keeps the proxy's
        code (Codex reads ``context_length_exceeded``), outside the SDK's code list."""
        self._require(StreamPhase.STREAMING)
        self.phase = StreamPhase.DONE
        error = {"code": exc.code or "server_error", "message": exc.message}
        failed = self.head.body("failed", list(self._output), error=error)
        return [self._event("response.failed", response=failed)]
