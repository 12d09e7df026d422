"""``/<trial_id>/v1/messages`` and ``/<trial_id>/v1/messages/count_tokens``.

Claude Code appends ``/v1/messages?beta=true`` to its ``ANTHROPIC_BASE_URL``; the query
and the ``anthropic-version`` / ``anthropic-beta`` / ``x-api-key`` headers are accepted
and not needed. The stream follows Anthropic's event sequence
(https://docs.anthropic.com/en/api/messages-streaming): ``message_start``, per content
block ``content_block_start`` / ``content_block_delta`` / ``content_block_stop``, then
``message_delta`` with the stop reason and ``message_stop``; every event carries its
``event:`` line, which Claude Code requires.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from aiohttp import web

from proxy.api.anthropic.errors import anthropic_error, error_body
from proxy.api.anthropic.models import (
    CountTokensRequest,
    SignatureCheck,
    parse_messages_request,
)
from proxy.api.anthropic.thinking import sign_thinking, thinking_signed
from proxy.api.delivery import retry_marks, send_whole, settle
from proxy.api.errors import json_response, parse_json, register_error_format
from proxy.api.images import take_images
from proxy.api.sse import EventStream, StreamSink
from proxy.appkeys import IMAGES, MODELS, POOL, SERVICE, SESSIONS
from proxy.chat.messages import ChatMessage, ToolCall
from proxy.exceptions import ImageError, ProxyError, ServiceUnavailableError
from proxy.ids import new_id
from proxy.models import ServedModel
from proxy.sessions.agents import agent_claim
from proxy.sessions.model import Session
from proxy.turns import (
    PreparedTurn,
    ReasoningDelta,
    TextDelta,
    ToolCallReady,
    TurnDone,
    TurnEvent,
    TurnRequest,
    TurnResult,
)

# Renders bigger than this (characters of message text) run in a thread, as turns do.
_LARGE_RENDER = 200_000


def stop_reason(result: TurnResult) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "stop_sequence":
        return "stop_sequence"
    if result.tool_calls:
        return "tool_use"
    return "end_turn"


def tool_input(call: ToolCall) -> dict[str, Any]:
    # The tool-call parsers only emit JSON objects; anything else would be a parser bug.
    value = json.loads(call.arguments)
    return value if isinstance(value, dict) else {}


def content_blocks(result: TurnResult, session: Session) -> list[dict[str, Any]]:
    """The reply as content blocks. Sent back in the next request, they translate to
    exactly the assistant message the session recorded, so the session continues."""
    blocks: list[dict[str, Any]] = []
    if result.reasoning:
        blocks.append(thinking_block(session, result.reasoning))
    if result.content:
        blocks.append({"type": "text", "text": result.content})
    blocks.extend(
        {"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c)}
        for c in result.tool_calls
    )
    return blocks


def thinking_block(session: Session, thinking: str) -> dict[str, Any]:
    signature = sign_thinking(session.api_key, session.trial_id, thinking)
    return {"type": "thinking", "thinking": thinking, "signature": signature}


def signature_check(session: Session) -> SignatureCheck:
    return lambda text, signature: thinking_signed(
        session.api_key, session.trial_id, text, signature
    )


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message_id() -> str:
    return new_id("msg")


def message_body(result: TurnResult, session: Session) -> dict[str, Any]:
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": result.model,
        "content": content_blocks(result, session),
        "stop_reason": stop_reason(result),
        "stop_sequence": result.stop_sequence,
        "usage": usage(result.prompt_tokens, result.completion_tokens),
    }


def _session(request: web.Request) -> Session:
    return request.app[SESSIONS].get(request.match_info["trial_id"])


async def create_message(request: web.Request) -> web.StreamResponse:
    session = _session(request)
    session.require_active()
    claim = agent_claim(request.headers)  # a bad harness header is refused before anything
    body = await request.read()
    signed = signature_check(session)
    parsed, messages, images = await take_images(
        request.app[IMAGES],
        session,
        lambda intake: parse_messages_request(body, session.history, signed, intake),
    )
    turn = TurnRequest(
        api="anthropic.messages",
        requested_model=parsed.model,
        messages=messages,
        tools=parsed.internal_tools(),
        sampling=parsed.sampling(),
        stop=parsed.stop_strings(),
        tool_choice=parsed.tool_choice_name(),
        marks=retry_marks(request, "anthropic.messages", body),
        images=images,
        agent=claim,
    )
    service = request.app[SERVICE]
    if not parsed.stream:
        result = await service.run_turn(session, turn)
        response = json_response(message_body(result, session))
        return await send_whole(request, response, service, session, [result])
    # Started before the stream opens: every client error is still a proper HTTP error.
    prepared = await service.start(session, turn)
    async with service.streaming(prepared) as events:
        done: list[TurnResult] = []
        delivered = False
        try:
            streamed = await stream_message(request, prepared, events, done)
            delivered = bool(done)
            return streamed
        finally:
            settle(service, session, done, delivered)


class _BlockWriter(StreamSink[TurnEvent]):
    """Content-block events of one streamed message, numbering the blocks, queued on its
    event stream. It is the turn's sink: the relay writes a step's deltas through it as
    the step arrives."""

    def __init__(self, stream: EventStream, session: Session) -> None:
        self.stream = stream
        self.session = session
        self.index = 0
        self.text_open = False
        self.thinking: list[str] | None = None  # the open thinking block's text so far

    def send(self, payload: dict[str, Any]) -> None:
        self.stream.emit(payload, event=str(payload["type"]))

    def think(self, text: str) -> None:
        if self.thinking is None:
            self.close_text()
            self.send(
                {
                    "type": "content_block_start",
                    "index": self.index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                }
            )
            self.thinking = []
        self.thinking.append(text)
        self.send(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "thinking_delta", "thinking": text},
            }
        )

    def close_thinking(self) -> None:
        """The signature covers the whole block, so it goes out when the block ends."""
        if self.thinking is None:
            return
        signed = thinking_block(self.session, "".join(self.thinking))["signature"]
        self.send(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "signature_delta", "signature": signed},
            }
        )
        self.send({"type": "content_block_stop", "index": self.index})
        self.index += 1
        self.thinking = None

    def text(self, text: str) -> None:
        self.close_thinking()
        if not self.text_open:
            self.send(
                {
                    "type": "content_block_start",
                    "index": self.index,
                    "content_block": {"type": "text", "text": ""},
                }
            )
            self.text_open = True
        self.send(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "text_delta", "text": text},
            }
        )

    def close_text(self) -> None:
        if self.text_open:
            self.send({"type": "content_block_stop", "index": self.index})
            self.index += 1
            self.text_open = False

    def tool_use(self, call: ToolCall) -> None:
        self.close_thinking()
        self.close_text()
        self.send(
            {
                "type": "content_block_start",
                "index": self.index,
                "content_block": {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": {},
                },
            }
        )
        # The call is complete when it is reported: its arguments go out in one delta.
        self.send(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments},
            }
        )
        self.send({"type": "content_block_stop", "index": self.index})
        self.index += 1

    def queue(self, event: TurnEvent) -> None:
        """The events of a delta or a tool call (the end is the writer's)."""
        if isinstance(event, TextDelta):
            self.text(event.text)
        elif isinstance(event, ReasoningDelta):
            self.think(event.text)
        elif isinstance(event, ToolCallReady):
            self.tool_use(event.call)


async def stream_message(
    request: web.Request,
    prepared: PreparedTurn,
    events: AsyncGenerator[TurnEvent, None],
    done: list[TurnResult],
) -> web.StreamResponse:
    """Anthropic stream events, one delta per engine delta; ``done`` receives the result."""
    input_tokens = len(prepared.plan.prompt_ids)
    try:
        stream = await EventStream.open(request)
        writer = _BlockWriter(stream, prepared.session)
        writer.send(
            {
                "type": "message_start",
                "message": {
                    "id": message_id(),
                    "type": "message",
                    "role": "assistant",
                    "model": prepared.served.name,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage(input_tokens, 0),
                },
            }
        )
        await stream.flush()
        prepared.sink = writer
        async for event in events:
            if not isinstance(event, TurnDone):
                writer.queue(event)
                await stream.flush()
                continue
            result = event.result
            writer.close_thinking()
            writer.close_text()
            writer.send(
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason(result),
                        "stop_sequence": result.stop_sequence,
                    },
                    "usage": usage(result.prompt_tokens, result.completion_tokens),
                }
            )
            writer.send({"type": "message_stop"})
            done.append(result)
    except ProxyError as exc:
        # The stream has started: the error travels as an event, then the stream ends.
        stream.emit(error_body(exc), event="error")
    return await stream.close()


async def _served_model(request: web.Request, session: Session, requested: str) -> ServedModel:
    """The model a turn of this request would use (as the turn service resolves it)."""
    served = await request.app[POOL].wait_for_models()
    if not served:
        raise ServiceUnavailableError(
            "no worker connected",
            retry_after=request.app[SERVICE].retry_after_seconds,
            code="no_worker",
        )
    return request.app[MODELS].resolve(requested, session.model, set(served))


def _large(messages: Sequence[ChatMessage]) -> bool:
    return sum(len(m.content) for m in messages) > _LARGE_RENDER


async def count_tokens(request: web.Request) -> web.Response:
    """The length of a new branch's prompt for this request: the full rendering of the
    system prompt, messages and tools. Nothing is recorded. A request that continues an
    earlier turn reuses that turn's sampled ids instead of re-rendering them, so its real
    prompt can differ by a few tokens."""
    session = _session(request)
    parsed = parse_json(CountTokensRequest, await request.read())
    signed = signature_check(session)
    # Images are taken (and refused) as a real request's are; nothing is recorded.
    _, messages, _ = await take_images(
        request.app[IMAGES],
        session,
        lambda intake: (parsed, parsed.internal_messages(signed, intake)),
    )
    tools = parsed.internal_tools()
    parsed.tool_choice_name()  # validated like a real request
    served = await _served_model(request, session, parsed.model)
    renderer = served.renderer
    images = [image for message in messages for image in message.images]
    if images and served.vision is None:
        raise ImageError(f"model {served.name!r} takes no images", code="images_unsupported")
    if _large(messages):
        ids = await asyncio.to_thread(renderer.render_conversation, messages, tools)
    else:
        ids = renderer.render_conversation(messages, tools)
    if served.vision is not None and images:
        ids, _ = served.vision.expand(ids, images)  # each image as many tokens as it takes
    return json_response({"input_tokens": len(ids)})


# The error format is a process-wide table keyed by path suffix; register once.
register_error_format("/v1/messages", anthropic_error)
register_error_format("/v1/messages/count_tokens", anthropic_error)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/{trial_id}/v1/messages", create_message)
    app.router.add_post("/{trial_id}/v1/messages/count_tokens", count_tokens)
