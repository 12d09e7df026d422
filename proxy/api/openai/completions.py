"""``/<trial_id>/v1/completions``: the legacy OpenAI completions API.

The prompt is raw: text is tokenized as is (no chat template, the tokenizer's own special
tokens as vLLM adds them), token ids are sent verbatim. Each choice is a turn recorded like
a chat turn: the prompt ids are context, the sampled ids are sampled. A token-id prompt
that starts with an earlier turn's prompt + sampled ids continues that turn. A client's
retry of a request (same raw body, ``proxy.sessions.retries``) is answered as on the chat
route: from the recorded reply, or by joining the attempt still sampling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from aiohttp import web

from proxy.api.delivery import retry_marks, send_whole, settle
from proxy.api.errors import error_body, json_response, parse_json
from proxy.api.openai.choices import IndexedEvent, choice_requests, streamed_choices
from proxy.api.openai.models import CompletionRequest
from proxy.api.sse import EventStream, StreamSink
from proxy.appkeys import SERVICE, SESSIONS
from proxy.exceptions import BadRequestError, ProxyError
from proxy.ids import new_id
from proxy.sampling import AgentSampling
from proxy.sessions.agents import agent_claim
from proxy.sessions.model import Session
from proxy.turns import (
    PreparedTurn,
    TextDelta,
    TurnDone,
    TurnEvent,
    TurnRequest,
    TurnResult,
    TurnService,
)

# Text prompts longer than this are tokenized off the event loop.
_LARGE_PROMPT_CHARS = 200_000


def finish_reason(result: TurnResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def legacy_logprobs(result: TurnResult, tokenizer: Any) -> dict[str, Any]:
    """The legacy ``logprobs`` object over the sampled tokens. Workers report only the
    sampled token's logprob, so each ``top_logprobs`` entry lists just that token."""
    tokens: list[str] = []
    offsets: list[int] = []
    at = 0
    for token_id in result.node.completion_ids:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
    logprobs = [float(lp) for lp in result.node.logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
        "text_offset": offsets,
    }


def usage(results: Sequence[TurnResult]) -> dict[str, int]:
    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _prompt_ids(
    service: TurnService, session: Session, parsed: CompletionRequest
) -> tuple[int, ...]:
    prompt = parsed.single_prompt()
    served = await service.served_model(session, parsed.model)
    tokenizer = served.renderer.tokenizer
    if isinstance(prompt, str):
        if len(prompt) > _LARGE_PROMPT_CHARS:
            ids: list[int] = await asyncio.to_thread(tokenizer.encode, prompt)
        else:
            ids = tokenizer.encode(prompt)
        if not ids:
            raise BadRequestError("prompt: tokenizes to no tokens", code="invalid_request")
        return tuple(ids)
    vocab = len(tokenizer)
    for i, token_id in enumerate(prompt):
        if not 0 <= token_id < vocab:
            raise BadRequestError(
                f"prompt.{i}: token id {token_id} is outside the vocabulary (0..{vocab - 1})",
                code="invalid_request",
            )
    return tuple(prompt)


async def completions(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    session.require_active()
    claim = agent_claim(request.headers)  # a bad harness header is refused before anything
    body = await request.read()
    parsed = parse_json(CompletionRequest, body)
    parsed.check_supported()
    service = request.app[SERVICE]
    prompt = await _prompt_ids(service, session, parsed)
    turn = TurnRequest(
        api="openai.completions",
        requested_model=parsed.model,
        messages=(),
        tools=(),
        sampling=AgentSampling(
            max_tokens=parsed.max_tokens,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k,
            seed=parsed.seed,
        ),
        stop=parsed.stop_strings(),
        tool_choice="none",
        prompt_ids=prompt,
        # Several choices are several turns: such a request is never taken for a retry.
        marks=retry_marks(request, "openai.completions", body) if parsed.n == 1 else None,
        agent=claim,
    )
    # n > 1: each choice is its own turn, a sibling branch with seed + i.
    turns = choice_requests(turn, parsed.n)
    if not parsed.stream:
        results = await asyncio.gather(*(service.run_turn(session, t) for t in turns))
        tokenizer = service.models.models[results[0].model].renderer.tokenizer
        response = json_response(
            {
                "id": new_id("cmpl", "-"),
                "object": "text_completion",
                "created": int(time.time()),
                "model": results[0].model,
                "choices": [
                    _choice(r, i, parsed, tokenizer, prompt, text=r.content)
                    for i, r in enumerate(results)
                ],
                "usage": usage(results),
            }
        )
        return await send_whole(request, response, service, session, results)
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    async with streamed_choices(service, session, turns) as (prepared, events):
        tokenizer = prepared[0].served.renderer.tokenizer
        done: list[TurnResult] = []
        delivered = False
        try:
            streamed = await _stream(
                request, prepared, events, parsed, tokenizer, prompt, include_usage, done
            )
            delivered = len(done) == len(prepared)
            return streamed
        finally:
            settle(service, session, done, delivered)


def _choice(
    result: TurnResult,
    index: int,
    parsed: CompletionRequest,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    *,
    text: str,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": legacy_logprobs(result, tokenizer) if parsed.logprobs is not None else None,
        "finish_reason": finish_reason(result),
    }
    if parsed.return_token_ids:
        choice["prompt_token_ids"] = list(prompt_ids)
        choice["token_ids"] = result.node.completion_ids.tolist()
    return choice


class _TextChunks(StreamSink[TurnEvent]):
    """The ``text_completion`` chunks of one stream, queued on its event stream; the
    turn's sink when there is a single choice."""

    def __init__(self, stream: EventStream, model: str) -> None:
        self.stream = stream
        self.base = {
            "id": new_id("cmpl", "-"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def event(self, index: int, event: TurnEvent) -> None:
        if isinstance(event, TextDelta):
            choice = {"index": index, "text": event.text, "logprobs": None, "finish_reason": None}
            self.stream.emit(self.base | {"choices": [choice]})

    def queue(self, event: TurnEvent) -> None:
        self.event(0, event)


async def _stream(
    request: web.Request,
    prepared: Sequence[PreparedTurn],
    events: AsyncGenerator[IndexedEvent, None],
    parsed: CompletionRequest,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    include_usage: bool,
    done: list[TurnResult],
) -> web.StreamResponse:
    """``text_completion`` chunks, one per engine delta and choice, then ``data: [DONE]``.

    With ``logprobs``, a choice's logprobs arrive with its final chunk (the one that
    carries its finish reason); concatenated over the chunks they are the whole list."""
    stream = await EventStream.open(request)
    chunks = _TextChunks(stream, prepared[0].served.name)
    if len(prepared) == 1:
        prepared[0].sink = chunks  # from the first flush on
    try:
        async for index, event in events:
            if isinstance(event, TurnDone):
                done.append(event.result)
                final = _choice(event.result, index, parsed, tokenizer, prompt_ids, text="")
                stream.emit(chunks.base | {"choices": [final]})
            else:
                chunks.event(index, event)
            if len(prepared) > 1 or not isinstance(event, TurnDone):
                await stream.flush()  # a single choice's end leaves with the stream's
        if include_usage and done:
            stream.emit(chunks.base | {"choices": [], "usage": usage(done)})
    except ProxyError as exc:
        # The stream has started: the error travels as an event, then the stream ends.
        stream.emit(error_body(exc))
    stream.emit_raw(b"[DONE]")
    return await stream.close()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/{trial_id}/v1/completions", completions)
