"""``/<trial_id>/v1/responses``: the OpenAI Responses API, which Codex speaks.

Codex posts ``<base_url>/responses`` with ``stream: true`` and the whole conversation in
``input`` (``store: false``); see ``models`` for what is accepted and ``output`` for the
response and its events. Errors take the OpenAI shape (the default of ``api.errors``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from aiohttp import web

from proxy.api.delivery import retry_marks, send_whole, settle
from proxy.api.errors import json_response, parse_json
from proxy.api.images import take_images
from proxy.api.responses.models import ResponsesRequest
from proxy.api.responses.output import (
    Event,
    ResponseEcho,
    ResponseHead,
    ResponseStream,
    new_id,
    response_body,
)
from proxy.api.sse import EventStream, StreamSink
from proxy.appkeys import IMAGES, SERVICE, SESSIONS
from proxy.exceptions import ProxyError
from proxy.sampling import AgentSampling
from proxy.sessions.agents import agent_claim
from proxy.turns import (
    PreparedTurn,
    ReasoningDelta,
    TextDelta,
    TurnDone,
    TurnEvent,
    TurnRequest,
    TurnResult,
)


def _echo(parsed: ResponsesRequest) -> ResponseEcho:
    return ResponseEcho(
        instructions=parsed.instructions,
        tools=parsed.tools_echo(),
        tool_choice=parsed.tool_choice_echo(),
        parallel_tool_calls=parsed.parallel_tool_calls is not False,
        max_output_tokens=parsed.max_output_tokens,
        namespaces=parsed.namespaces(),
    )


async def create_response(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    session.require_active()
    claim = agent_claim(request.headers)  # a bad harness header is refused before anything
    body = await request.read()
    parsed = parse_json(ResponsesRequest, body)
    parsed.check_supported()
    _, messages, images = await take_images(
        request.app[IMAGES], session, lambda intake: (parsed, parsed.internal_messages(intake))
    )
    turn = TurnRequest(
        api="openai.responses",
        requested_model=parsed.model,
        messages=messages,
        tools=parsed.internal_tools(),
        sampling=AgentSampling(
            max_tokens=parsed.max_output_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
        ),
        tool_choice=parsed.tool_choice_name(),
        marks=retry_marks(request, "openai.responses", body),
        images=images,
        agent=claim,
    )
    echo = _echo(parsed)
    created_at = int(time.time())
    service = request.app[SERVICE]
    if not parsed.stream:
        result = await service.run_turn(session, turn)
        sampling = result.node.meta.sampling
        head = ResponseHead(
            new_id("resp"),
            created_at,
            result.model,
            float(sampling["temperature"]),
            float(sampling["top_p"]),
            echo,
        )
        response = json_response(response_body(head, result))
        return await send_whole(request, response, service, session, [result])
    # Started before the stream opens: every client error is still a proper HTTP error.
    prepared = await service.start(session, turn)
    head = ResponseHead(
        new_id("resp"),
        created_at,
        prepared.served.name,
        prepared.sampling.temperature,
        prepared.sampling.top_p,
        echo,
    )
    async with service.streaming(prepared) as events:
        done: list[TurnResult] = []
        delivered = False
        try:
            streamed = await stream_response(request, prepared, ResponseStream(head), events, done)
            delivered = bool(done)
            return streamed
        finally:
            settle(service, session, done, delivered)


class _ResponseEvents(StreamSink[TurnEvent]):
    """A streamed response's events, queued on its event stream; the turn's sink (the
    relay writes a step's deltas through it as the step arrives)."""

    def __init__(self, stream: EventStream, writer: ResponseStream) -> None:
        self.stream = stream
        self.writer = writer

    def send(self, batch: list[Event]) -> None:
        for kind, payload in batch:
            self.stream.emit(payload, event=kind)

    def queue(self, event: TurnEvent) -> None:
        if isinstance(event, TextDelta):
            self.send(self.writer.text(event.text))
        elif isinstance(event, ReasoningDelta):
            self.send(self.writer.reasoning(event.text))
        elif isinstance(event, TurnDone):
            self.send(self.writer.finish(event.result))
        # ToolCallReady: the calls are sent from the result (see ``output``).


async def stream_response(
    request: web.Request,
    prepared: PreparedTurn,
    writer: ResponseStream,
    events: AsyncGenerator[TurnEvent, None],
    done: list[TurnResult],
) -> web.StreamResponse:
    """Responses events; ``done`` receives the result once its final events are queued."""
    stream = await EventStream.open(request)
    out = _ResponseEvents(stream, writer)
    try:
        out.send(writer.start())
        await stream.flush()
        prepared.sink = out
        async for event in events:
            out.queue(event)
            if not isinstance(event, TurnDone):
                await stream.flush()  # the end leaves with the stream's
            else:
                done.append(event.result)
    except ProxyError as exc:
        # The stream has started: the error travels as an event, then the stream ends.
        out.send(writer.fail(exc))
    return await stream.close()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/{trial_id}/v1/responses", create_response)
