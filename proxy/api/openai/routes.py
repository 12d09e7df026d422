"""``/<trial_id>/v1/chat/completions`` and ``/<trial_id>/v1/models``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from aiohttp import web

from proxy.api.delivery import retry_marks, send_whole, settle
from proxy.api.errors import error_body, json_response
from proxy.api.images import take_images
from proxy.api.openai import completions
from proxy.api.openai.choices import IndexedEvent, choice_requests, streamed_choices
from proxy.api.openai.models import parse_chat_completion
from proxy.api.sse import EventStream, StreamSink
from proxy.appkeys import IMAGES, MODELS, POOL, SERVICE, SESSIONS
from proxy.exceptions import ProxyError
from proxy.ids import new_id
from proxy.sampling import AgentSampling
from proxy.sessions.agents import agent_claim
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
from relay.pool import WorkerPool


def finish_reason(result: TurnResult) -> str:
    if result.finish_reason == "length":
        return "length"
    if result.finish_reason == "stop_sequence":
        return "stop"
    if result.tool_calls:
        return "tool_calls"
    return "stop"


def choice_body(result: TurnResult, index: int, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": result.content if (result.content or not result.tool_calls) else None,
    }
    if result.reasoning:
        # Both names clients read reasoning from (vLLM and DeepSeek; OpenRouter).
        message["reasoning_content"] = message["reasoning"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls
        ]
    return {
        "index": index,
        "message": message,
        "finish_reason": finish_reason(result),
        "logprobs": logprobs,
    }


def logprobs_body(result: TurnResult, tokenizer: Any) -> dict[str, Any]:
    """Per-token logprobs of the sampled tokens. Workers report the sampled token's
    logprob only, so ``top_logprobs`` lists just that token."""
    content = []
    for token_id, logprob in zip(result.node.completion_ids, result.node.logprobs, strict=True):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        content.append(entry | {"top_logprobs": [dict(entry)]})
    return {"content": content}


def chat_completion_body(
    results: Sequence[TurnResult], created: int, tokenizer: Any = None
) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl", "-"),
        "object": "chat.completion",
        "created": created,
        "model": results[0].model,
        "choices": [
            choice_body(r, i, logprobs_body(r, tokenizer) if tokenizer is not None else None)
            for i, r in enumerate(results)
        ],
        "usage": usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results)),
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    session.require_active()
    claim = agent_claim(request.headers)  # a bad harness header is refused before anything
    body = await request.read()
    parsed, messages, images = await take_images(
        request.app[IMAGES],
        session,
        lambda intake: parse_chat_completion(body, session.history, intake),
    )
    turn = TurnRequest(
        api="openai.chat",
        requested_model=parsed.model,
        messages=messages,
        tools=parsed.internal_tools(),
        sampling=AgentSampling(
            max_tokens=parsed.max_completion_tokens or parsed.max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k,
            seed=parsed.seed,
        ),
        stop=parsed.stop_strings(),
        tool_choice=parsed.tool_choice_name(),
        # Several choices are several turns: such a request is never taken for a retry.
        marks=retry_marks(request, "openai.chat", body) if parsed.n == 1 else None,
        images=images,
        agent=claim,
    )
    service = request.app[SERVICE]
    # n > 1: each choice is its own turn (a sibling branch of the session's tree), with
    # its own seed so the choices differ.
    turns = choice_requests(turn, parsed.n)
    if not parsed.stream:
        if len(turns) == 1:  # the common case, without a task per choice
            results = [await service.run_turn(session, turns[0])]
        else:
            results = list(await asyncio.gather(*(service.run_turn(session, t) for t in turns)))
        tokenizer = (
            service.models.models[results[0].model].renderer.tokenizer if parsed.logprobs else None
        )
        response = json_response(chat_completion_body(results, int(time.time()), tokenizer))
        return await send_whole(request, response, service, session, results)
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    async with streamed_choices(service, session, turns) as (prepared, events):
        done: list[TurnResult] = []
        delivered = False
        try:
            streamed = await stream_chat_completion(
                request, prepared, events, include_usage, model=prepared[0].served.name, done=done
            )
            delivered = len(done) == len(prepared)
            return streamed
        finally:
            settle(service, session, done, delivered)


class _ChatChunks(StreamSink[TurnEvent]):
    """The chunks of one streamed chat completion, queued on its event stream.

    With a single choice it is the turn's sink: the relay writes a step's delta through
    it as the step arrives."""

    def __init__(self, stream: EventStream, model: str) -> None:
        self.stream = stream
        self.base = {
            "id": new_id("chatcmpl", "-"),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> None:
        self.stream.emit(
            self.base
            | {
                "choices": [
                    {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
                ]
            }
        )

    def event(self, index: int, event: TurnEvent) -> None:
        """The chunk of a delta or a tool call (the end is the writer's)."""
        if isinstance(event, TextDelta):
            self.chunk(index, {"content": event.text})
        elif isinstance(event, ReasoningDelta):
            text = event.text
            self.chunk(index, {"reasoning_content": text, "reasoning": text})
        elif isinstance(event, ToolCallReady):
            call = event.call
            self.chunk(
                index,
                {
                    "tool_calls": [
                        {
                            "index": event.index,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ]
                },
            )

    def queue(self, event: TurnEvent) -> None:
        self.event(0, event)


async def stream_chat_completion(
    request: web.Request,
    prepared: Sequence[PreparedTurn],
    events: AsyncGenerator[IndexedEvent, None],
    include_usage: bool,
    *,
    model: str = "",
    done: list[TurnResult] | None = None,
) -> web.StreamResponse:
    """OpenAI chat-completion chunks, one per engine delta (each tagged with its choice's
    index), then ``data: [DONE]``. ``done`` receives each choice's result as it ends."""
    stream = await EventStream.open(request)
    chunks = _ChatChunks(stream, model)
    if done is None:
        done = []
    for index in range(len(prepared)):
        chunks.chunk(index, {"role": "assistant", "content": ""})
    await stream.flush()
    if len(prepared) == 1:
        prepared[0].sink = chunks
    try:
        async for index, event in events:
            if isinstance(event, TurnDone):
                result = event.result
                chunks.base["model"] = result.model
                done.append(result)
                chunks.chunk(index, {}, finish_reason(result))
            else:
                chunks.event(index, event)
            if len(prepared) > 1 or not isinstance(event, TurnDone):
                await stream.flush()  # a single choice's end leaves with the stream's
        if include_usage and done:
            stream.emit(
                chunks.base
                | {
                    "choices": [],
                    "usage": usage(done[0].prompt_tokens, sum(r.completion_tokens for r in done)),
                }
            )
    except ProxyError as exc:
        # The stream has started: the error travels as an event, then the stream ends.
        stream.emit(error_body(exc))
    stream.emit_raw(b"[DONE]")
    return await stream.close()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def list_models(request: web.Request) -> web.Response:
    request.app[SESSIONS].get(request.match_info["trial_id"])
    now = int(time.time())
    pool = request.app[POOL]
    # A teacher is not offered: an agent that takes the first model listed must not get it.
    models = sorted(name for name, info in pool.served_models().items() if not info.teacher)
    known = request.app[MODELS].models
    data = []
    for name in models:
        entry: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "rollout-relay",
            # What computes it: each distinct backend and engine settings among the
            # workers serving it (the dtype is what the recorded logprobs are computed in).
            "engines": served_engines(pool, name),
        }
        served = known.get(name)
        if served is not None:
            entry["tool_call_format"] = served.renderer.parser.name
            # Whether the model takes images (a vision-language model).
            entry["vision"] = served.vision is not None
            entry["template_check"] = [r.as_dict() for r in served.template_check]
            if served.tools_check is not None:
                entry["tools"] = served.tools_check.as_dict()
        data.append(entry)
    return json_response({"object": "list", "data": data})


def served_engines(pool: WorkerPool, model: str) -> list[dict[str, Any]]:
    """The distinct (backend, logprobs mode, engine settings) of the workers serving
    ``model``, in the order they connected."""
    seen: list[dict[str, Any]] = []
    for handle in pool.workers.values():
        info = handle.models.get(model)
        if info is None:
            continue
        entry = {"backend": info.backend, "logprobs_mode": info.logprobs_mode, **info.engine}
        if entry not in seen:
            seen.append(entry)
    return seen


def add_routes(app: web.Application) -> None:
    app.router.add_post("/{trial_id}/v1/chat/completions", chat_completions)
    completions.add_routes(app)
    app.router.add_get("/{trial_id}/v1/models", list_models)
