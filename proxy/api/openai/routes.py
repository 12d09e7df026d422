"""``/<trial_id>/v1/chat/completions`` and ``/<trial_id>/v1/models``."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import shortuuid
from aiohttp import web

from proxy.api.errors import error_body, json_response, parse_json
from proxy.api.openai.models import ChatCompletionRequest
from proxy.api.sse import EventStream
from proxy.appkeys import POOL, SERVICE, SESSIONS
from proxy.exceptions import BadRequestError, ProxyError
from proxy.sampling import AgentSampling
from proxy.service import TextDelta, ToolCallReady, TurnEvent, TurnRequest, TurnResult


def finish_reason(result: TurnResult) -> str:
    if result.finish_reason == "length":
        return "length"
    if result.tool_calls:
        return "tool_calls"
    return "stop"


def chat_completion_body(result: TurnResult, created: int) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": result.content if (result.content or not result.tool_calls) else None,
    }
    if result.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls
        ]
    return {
        "id": f"chatcmpl-{shortuuid.uuid()}",
        "object": "chat.completion",
        "created": created,
        "model": result.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason(result),
                "logprobs": None,
            }
        ],
        "usage": usage(result),
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    session.require_active()
    parsed = parse_json(ChatCompletionRequest, await request.read())
    if parsed.n != 1:
        raise BadRequestError("only n=1 is supported", code="unsupported")
    turn = TurnRequest(
        api="openai.chat",
        requested_model=parsed.model,
        messages=parsed.internal_messages(),
        tools=parsed.internal_tools(),
        sampling=AgentSampling(
            max_tokens=parsed.max_completion_tokens or parsed.max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k,
            seed=parsed.seed,
        ),
    )
    service = request.app[SERVICE]
    if not parsed.stream:
        result = await service.run_turn(session, turn)
        return json_response(chat_completion_body(result, int(time.time())))
    prepared = await service.start(session, turn)
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    return await stream_chat_completion(request, service.stream(prepared), include_usage)


async def stream_chat_completion(
    request: web.Request, events: AsyncGenerator[TurnEvent, None], include_usage: bool
) -> web.StreamResponse:
    """OpenAI chat-completion chunks, one per engine delta, then ``data: [DONE]``."""
    stream = await EventStream.open(request)
    base = {
        "id": f"chatcmpl-{shortuuid.uuid()}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return base | {
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        }

    await stream.send(chunk({"role": "assistant", "content": ""}))
    try:
        async for event in events:
            if isinstance(event, TextDelta):
                await stream.send(chunk({"content": event.text}))
            elif isinstance(event, ToolCallReady):
                call = event.call
                await stream.send(
                    chunk(
                        {
                            "tool_calls": [
                                {
                                    "index": event.index,
                                    "id": call.id,
                                    "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments},
                                }
                            ]
                        }
                    )
                )
            else:
                result = event.result
                base["model"] = result.model
                await stream.send(chunk({}, finish_reason(result)))
                if include_usage:
                    await stream.send(base | {"choices": [], "usage": usage(result)})
    except ProxyError as exc:
        # The stream has started: the error travels as an event, then the stream ends.
        await stream.send(error_body(exc))
    finally:
        await events.aclose()
    await stream.send_raw(b"[DONE]")
    return await stream.close()


def usage(result: TurnResult) -> dict[str, int]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


async def list_models(request: web.Request) -> web.Response:
    request.app[SESSIONS].get(request.match_info["trial_id"])
    now = int(time.time())
    models = sorted(request.app[POOL].served_models())
    return json_response(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": now, "owned_by": "rollout-relay"}
                for name in models
            ],
        }
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/{trial_id}/v1/chat/completions", chat_completions)
    app.router.add_get("/{trial_id}/v1/models", list_models)
