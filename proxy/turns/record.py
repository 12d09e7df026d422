"""A turn's record: what was sampled, committed to the session (and its store) as a turn.

A finished reply is recorded whole before its last events go out, and committed before
the agent is answered, so an agent that leaves while they are written loses nothing that
was sampled; a reply that did not finish (the client left, the worker failed) is recorded
as a truncated turn. The turn's agent carries the spawning calls its reply made, so they
are durable with it.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from array import array
from collections.abc import Callable, Sequence
from typing import NoReturn

import msgspec

from proxy.chat.messages import ChatMessage, ToolCall, extend_key
from proxy.chat.reasoning import split_whole
from proxy.exceptions import BudgetExhaustedError, ProxyError
from proxy.observability import ProxyMetrics
from proxy.sampling import sampling_record
from proxy.sessions.accounting import raw_prompt_key
from proxy.sessions.agents import Spawn, TurnAgent, spawn_message, spawns_of
from proxy.sessions.model import Outcome, Session, SessionState, TurnMeta, TurnNode
from proxy.sessions.options import CapFinish
from proxy.sessions.routing import TurnRouting, turn_routing
from proxy.sessions.store import SessionStore
from proxy.toolcalls import ParsedOutput
from proxy.turns.attempt import PreparedTurn
from proxy.turns.decoding import Decoding, splitter_for
from proxy.turns.request import TurnResult
from relay.pool import FinishedEvent

__all__ = ["Recorder"]

log = logging.getLogger(__name__)


class Recorder:
    """Turns into the session, and the session's writes to its store (None: in memory)."""

    def __init__(self) -> None:
        self.store: SessionStore | None = None
        self.metrics: ProxyMetrics | None = None

    def whole(
        self,
        prepared: PreparedTurn,
        decoding: Decoding,
        finished: FinishedEvent,
        parsed: ParsedOutput,
    ) -> TurnResult:
        """A finished reply, recorded whole (before its last events go out)."""
        return self._record(prepared, decoding, finished, parsed, truncated=False)

    def cut(self, prepared: PreparedTurn, decoding: Decoding) -> None:
        """What was sampled of a reply that did not finish, recorded as a truncated turn;
        nobody waits for it, so its write is queued and committed regardless."""
        result = self._record(prepared, decoding, None, None, truncated=True)
        self.commit_later(prepared.session, result.node)

    def _record(
        self,
        prepared: PreparedTurn,
        decoding: Decoding,
        finished: FinishedEvent | None,
        parsed: ParsedOutput | None,
        *,
        truncated: bool,
    ) -> TurnResult:
        session, renderer = prepared.session, prepared.served.renderer
        ids = decoding.detok.ids
        reasoning = "".join(decoding.splitter.reasoning)
        if parsed is None:
            reasoning, answer = split_whole(splitter_for(prepared), renderer.completion_text(ids))
            parsed = renderer.parse(answer, prepared.request.tools)
        calls = decoding.reply_calls(parsed)  # malformed output has none
        stop = decoding.stopper.hit if not truncated else None
        node = _node(prepared, ids, decoding.logprobs, finished, parsed, calls, stop)
        if session.state is SessionState.ACTIVE:
            for placed in prepared.plan.images:  # an image is kept with the first turn using it
                if placed.sha256 not in session.images:
                    session.images[placed.sha256] = prepared.request.images[placed.sha256]
            session.add_turn(node)
        self._observe(prepared, node, truncated)
        capped = node.meta.capped and session.options.cap_finish is CapFinish.STOP
        return TurnResult(
            node=node,
            model=prepared.served.name,
            content=parsed.content,
            tool_calls=calls,
            # What the agent is told; the record keeps "length" (session cap_finish).
            finish_reason="stop" if capped else node.meta.finish_reason,
            prompt_tokens=node.prompt_len,
            completion_tokens=len(ids),
            stop_sequence=stop,
            reasoning=reasoning,
        )

    def _observe(self, prepared: PreparedTurn, node: TurnNode, truncated: bool) -> None:
        metrics, call = self.metrics, prepared.call
        if metrics is None or call is None:
            return
        first = call.first_token_at
        metrics.observe_turn(
            api=prepared.request.api,
            finish_reason=node.meta.finish_reason,
            truncated=truncated,
            prompt_tokens=node.prompt_len,
            completion_tokens=len(node.completion_ids),
            queue_seconds=node.meta.queue_seconds,
            engine_seconds=node.meta.engine_seconds,
            total_seconds=time.perf_counter() - prepared.received_at,
            first_token_seconds=None if first is None else first - prepared.received_at,
        )
        if truncated:  # a cut reply never reaches the client whole
            metrics.undelivered_turns.labels(prepared.request.api).inc()

    # ------------------------------------------------------------------ writes

    async def commit(self, session: Session, node: TurnNode) -> None:
        """Durable before the agent is answered."""
        if self.store is not None and _recorded(session, node):
            await self.store.save_turn(session, node)

    def commit_later(self, session: Session, node: TurnNode) -> None:
        if self.store is not None and _recorded(session, node):
            self.store.save_turn(session, node).add_done_callback(_log_failed_write)

    def save_session(self, session: Session) -> None:
        if self.store is not None:
            self.store.save_session(session).add_done_callback(_log_failed_write)

    def delivered(self, session: Session, node: TurnNode) -> None:
        """The agent had the reply (its last byte was written, or a later turn continues
        it)."""
        if node.meta.delivered or not _recorded(session, node):
            return
        node.meta.delivered = True
        self._save_meta(session, node)

    def settle_delivery(
        self, session: Session, nodes: Sequence[TurnNode], delivered: bool, *, replay: bool
    ) -> None:
        for node in nodes:
            if delivered:
                self.delivered(session, node)
            elif not replay and not node.meta.truncated and self.metrics is not None:
                self.metrics.undelivered_turns.labels(node.meta.api).inc()

    def replayed(self, prepared: PreparedTurn, node: TurnNode) -> None:
        """A retry was answered with ``node``'s recorded reply."""
        node.meta.replays += 1
        self._save_meta(prepared.session, node)
        if self.metrics is not None:
            self.metrics.replayed_turns.labels(prepared.request.api).inc()

    def budget_spent(self, session: Session, why: str) -> NoReturn:
        """A trial whose budget is spent takes no more requests: its outcome is
        ``budget_exhausted`` (unless it has one already) and the request is refused."""
        if session.outcome is None:
            session.outcome = Outcome.BUDGET_EXHAUSTED
            self.save_session(session)
        raise BudgetExhaustedError(f"{why}; this trial takes no more requests")

    def server_error(self, session: Session, exc: ProxyError) -> None:
        """A request of ``session`` answered with a server error (5xx) is counted on the
        trial: what its agent did next was not only the policy's doing."""
        if exc.status >= 500:
            session.server_errors += 1
            self.save_session(session)

    @staticmethod
    def spawn_sender(prepared: PreparedTurn) -> Callable[[ToolCall], None]:
        """What a streamed reply tells the session of each tool call before the agent is
        sent it: a spawning call can be taken by its sub-agent from then on (the turn,
        once recorded, holds it durably)."""

        def sent(call: ToolCall) -> None:
            message = spawn_message(call)
            if message is not None:
                spawns = [Spawn(call.id, message)]
                prepared.sent_spawns.extend(
                    prepared.session.spawning.sent(prepared.agent.id, spawns)
                )

        return sent

    def _save_meta(self, session: Session, node: TurnNode) -> None:
        if self.store is not None and _recorded(session, node):
            self.store.save_turn_meta(session, node).add_done_callback(_log_failed_write)


def _node(
    prepared: PreparedTurn,
    ids: list[int],
    logprobs: list[float],
    finished: FinishedEvent | None,
    parsed: ParsedOutput,
    calls: tuple[ToolCall, ...],
    stop_sequence: str | None,
) -> TurnNode:
    plan, request = prepared.plan, prepared.request
    if request.prompt_ids is not None:
        key = raw_prompt_key([*plan.prompt_ids, *ids])
    else:
        returned = ChatMessage(role="assistant", content=parsed.content, tool_calls=calls)
        key = extend_key(plan.request_key, returned)
    return TurnNode(
        index=len(prepared.session.nodes),
        parent=plan.parent,
        context_ids=array("i", plan.context_ids),
        completion_ids=array("i", ids),
        logprobs=array("f", logprobs[: len(ids)]),
        prompt_len=len(plan.prompt_ids),
        images=plan.images,
        routing=_routing(prepared, len(plan.prompt_ids) + len(ids)),
        agent=_with_spawns(prepared.agent, calls),
        key=key,
        meta=_meta(prepared, len(ids), finished, parsed, calls, stop_sequence),
    )


def _meta(
    prepared: PreparedTurn,
    sampled: int,
    finished: FinishedEvent | None,
    parsed: ParsedOutput,
    calls: tuple[ToolCall, ...],
    stop_sequence: str | None,
) -> TurnMeta:
    call, request, marks = prepared.call, prepared.request, prepared.request.marks
    assert call is not None
    dispatched = call.started_at or prepared.started
    finish = finished.finish_reason if finished is not None else "abort"
    asked = request.sampling.max_tokens
    choice = request.tool_choice
    return TurnMeta(
        api=request.api,
        model=prepared.served.name,
        requested_model=request.requested_model,
        worker_id=finished.worker_id if finished is not None else (call.worker_id or ""),
        finish_reason=finish,
        sampling=sampling_record(prepared.sampling),
        created_at=time.time(),
        queue_seconds=dispatched - call.queued_at,
        engine_seconds=time.perf_counter() - dispatched,
        branch_reason=prepared.plan.branch_reason,
        tool_calls=len(calls),
        malformed_tool_call=parsed.malformed,
        truncated=finished is None,
        stop_sequence=stop_sequence,
        tool_choice_unmet=(choice == "required" and not calls)
        or (
            choice not in {"auto", "none", "required"} and not any(c.name == choice for c in calls)
        ),
        reasoning_returned=sum(map(bool, map(_REASONING, request.messages))),
        capped=finish == "length" and (asked is None or prepared.sampling.max_tokens < asked),
        extra=dict(finished.extra) if finished is not None else {},
        versions=[list(span) for span in call.version_spans(sampled)],
        delivered=False,  # until its reply's end is written (settle_delivery)
        retry_of=prepared.retry_of,
        request_hash=marks.request_hash if marks is not None else "",
        client_request_id=marks.client_request_id if marks is not None else "",
    )


# How many of the history's (assistant) messages came with their reasoning: counted in C,
# as the history may be long.
_REASONING = operator.attrgetter("reasoning")


def _routing(prepared: PreparedTurn, end: int) -> TurnRouting | None:
    """The turn's routing rows, positions [its start, ``end`` - 1): what its call gathered,
    the rest missing (a cut reply, a lost worker's rows, an engine that gave fewer)."""
    call, shape = prepared.call, prepared.served.routing
    routed = call.routed if call is not None else None
    if routed is None or shape is None:
        return None
    if routed.shape not in (None, shape):  # never expected: rows of another model's shape
        return turn_routing(shape, routed.start, end - 1, routed.start, b"")
    return turn_routing(
        shape, routed.start, end - 1, routed.start, routed.data, routed.missing, routed.versions
    )


def _with_spawns(agent: TurnAgent, tool_calls: Sequence[ToolCall]) -> TurnAgent:
    """The turn's agent with the sub-agents its reply asked for (its spawning calls)."""
    spawns = spawns_of(tool_calls)
    return msgspec.structs.replace(agent, spawns=spawns) if spawns else agent


def _recorded(session: Session, node: TurnNode) -> bool:
    """Whether ``node`` was added to the session (not when it had stopped accepting turns)."""
    return node.index < len(session.nodes) and session.nodes[node.index] is node


def _log_failed_write(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a write to the session store failed: %s", future.exception())
