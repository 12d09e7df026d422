"""Running one turn: plan the prompt, relay it to a worker, record what was sampled.

The API adapters (OpenAI chat, and later Anthropic and Responses) translate their wire
format into a ``TurnRequest`` and the ``TurnResult`` back; this module is the one place
that talks to the pool and writes turns into sessions.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import shortuuid

from proxy.chat.messages import ChatMessage, Tool, ToolCall, extend_key
from proxy.exceptions import (
    ContextLengthError,
    ProxyError,
    ServiceUnavailableError,
    UpstreamError,
)
from proxy.models import ModelRegistry, ServedModel
from proxy.sampling import AgentSampling, resolve_sampling, sampling_record
from proxy.sessions.accounting import plan_turn
from proxy.sessions.model import Session, TurnMeta, TurnNode
from relay.exceptions import NoWorkerAvailableError, RelayError, WorkerFailedError
from relay.pool import FinishedEvent, RelayCall, RestartedEvent, TokensEvent, WorkerPool


@dataclass(slots=True, frozen=True)
class TurnRequest:
    api: str
    requested_model: str
    messages: Sequence[ChatMessage]
    tools: Sequence[Tool]
    sampling: AgentSampling


@dataclass(slots=True, frozen=True)
class TurnResult:
    node: TurnNode
    model: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str  # engine-level: stop | length | abort
    prompt_tokens: int
    completion_tokens: int


class TurnService:
    def __init__(
        self,
        pool: WorkerPool,
        models: ModelRegistry,
        *,
        global_max_tokens: int,
        retry_after_seconds: int = 5,
    ) -> None:
        self.pool = pool
        self.models = models
        self.global_max_tokens = global_max_tokens
        self.retry_after_seconds = retry_after_seconds

    async def _served(self, session: Session, requested: str) -> ServedModel:
        served = await self.pool.wait_for_models()
        if not served:
            raise ServiceUnavailableError(
                f"no worker connected within {self.pool.wait_seconds:g}s",
                retry_after=self.retry_after_seconds,
                code="no_worker",
            )
        return self.models.resolve(requested, session.model, set(served))

    async def run_turn(self, session: Session, request: TurnRequest) -> TurnResult:
        session.require_active()
        served = await self._served(session, request.requested_model)
        renderer = served.renderer
        if _large(request.messages):
            plan = await asyncio.to_thread(
                plan_turn, session, renderer, request.messages, request.tools
            )
        else:
            plan = plan_turn(session, renderer, request.messages, request.tools)
        sampling = resolve_sampling(
            request.sampling,
            session.sampling,
            global_max_tokens=self.global_max_tokens,
            prompt_len=len(plan.prompt_ids),
            max_model_len=served.max_model_len,
            stop_token_ids=renderer.stop_token_ids,
        )
        started = time.perf_counter()
        try:
            call = await self.pool.start(
                served.name, plan.prompt_ids, sampling, affinity=session.trial_id
            )
        except NoWorkerAvailableError as exc:
            raise ServiceUnavailableError(
                str(exc), retry_after=self.retry_after_seconds, code="no_worker"
            ) from None
        ids, logprobs, finished = await self._collect(call)
        dispatched = call.started_at or started
        finish = finished.finish_reason

        session.require_active()  # completed or deleted while we were generating
        text = renderer.completion_text(ids)
        parsed = renderer.parse(text, request.tools)
        tool_calls = tuple(
            ToolCall(f"call_{shortuuid.uuid()[:22]}", c.name, c.arguments)
            for c in parsed.tool_calls
        )
        returned = ChatMessage(role="assistant", content=parsed.content, tool_calls=tool_calls)
        node = TurnNode(
            index=len(session.nodes),
            parent=plan.parent,
            context_ids=array("i", plan.context_ids),
            completion_ids=array("i", ids),
            logprobs=array("f", logprobs),
            prompt_len=len(plan.prompt_ids),
            key=extend_key(plan.request_key, returned),
            meta=TurnMeta(
                api=request.api,
                model=served.name,
                requested_model=request.requested_model,
                worker_id=finished.worker_id,
                finish_reason=finish,
                sampling=sampling_record(sampling),
                created_at=time.time(),
                queue_seconds=dispatched - call.queued_at,
                engine_seconds=time.perf_counter() - dispatched,
                branch_reason=plan.branch_reason,
                tool_calls=len(tool_calls),
                malformed_tool_call=parsed.malformed,
                extra=finished.extra,
            ),
        )
        session.add_turn(node)
        return TurnResult(
            node=node,
            model=served.name,
            content=parsed.content,
            tool_calls=tool_calls,
            finish_reason=finish,
            prompt_tokens=len(plan.prompt_ids),
            completion_tokens=len(ids),
        )

    async def _collect(self, call: RelayCall) -> tuple[list[int], list[float], FinishedEvent]:
        ids: list[int] = []
        logprobs: list[float] = []
        try:
            async for event in call.events():
                if isinstance(event, TokensEvent):
                    ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                elif isinstance(event, RestartedEvent):
                    ids.clear()
                    logprobs.clear()
                elif isinstance(event, FinishedEvent):
                    return ids, logprobs, event
        except asyncio.CancelledError:
            await call.cancel()
            raise
        except WorkerFailedError as exc:
            if exc.code == "prompt_too_long":
                raise ContextLengthError(exc.message) from None
            raise UpstreamError(f"the worker failed: {exc.message}", code=exc.code) from None
        except NoWorkerAvailableError as exc:
            raise ServiceUnavailableError(
                str(exc), retry_after=self.retry_after_seconds, code="no_worker"
            ) from None
        except RelayError as exc:
            raise ProxyError(f"relay error: {exc}") from None
        raise UpstreamError("the worker stream ended without finishing")


def _large(messages: Sequence[ChatMessage]) -> bool:
    """Big renders go to a thread so they do not stall other sessions' streams."""
    return sum(len(m.content) for m in messages) > 200_000
