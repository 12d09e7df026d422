"""Running one turn: plan the prompt, relay it to a worker, record what was sampled.

The API adapters (OpenAI chat, and later Anthropic and Responses) translate their wire
format into a ``TurnRequest`` and the ``TurnResult`` back; this module is the one place
that talks to the pool and writes turns into sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from proxy.chat.detokenizer import IncrementalDetokenizer
from proxy.chat.harmony import HarmonySplitter
from proxy.chat.messages import ChatMessage, Tool, ToolCall, extend_key
from proxy.chat.reasoning import (
    Piece,
    ReasoningPiece,
    ReasoningSplitter,
    Splitter,
    split_whole,
)
from proxy.chat.stops import StopMatcher
from proxy.coalesce import StreamCoalescer
from proxy.exceptions import (
    BadRequestError,
    BudgetExhaustedError,
    ContextLengthError,
    ImageError,
    ProxyError,
    ServiceUnavailableError,
    StorageError,
    TooManyRequestsError,
    UpstreamError,
)
from proxy.ids import new_id
from proxy.images import ImageData
from proxy.limits import Limits, check_message_count, session_token_room
from proxy.models import ModelRegistry, ServedModel
from proxy.observability import ProxyMetrics
from proxy.sampling import AgentSampling, resolve_sampling, sampling_record
from proxy.sessions.accounting import locate, plan_raw_prompt, plan_turn, raw_prompt_key
from proxy.sessions.agents import AgentClaim, TurnAgent, attribute, spawns_of
from proxy.sessions.model import (
    Outcome,
    PlacedImage,
    PromptPlan,
    Session,
    SessionState,
    TurnMeta,
    TurnNode,
)
from proxy.sessions.options import CapFinish
from proxy.sessions.retries import RetryAction, RetryMarks, decide
from proxy.sessions.routing import TurnRouting, turn_routing
from proxy.sessions.store import SessionStore
from proxy.toolcalls import (
    ContentDelta,
    ParsedOutput,
    ParsedToolCall,
    StreamEvent,
    ToolCallStream,
    get_parser,
)
from relay import protocol
from relay.exceptions import (
    NoWorkerAvailableError,
    PoolOverloadedError,
    RelayError,
    WorkerFailedError,
)
from relay.images import PromptImage
from relay.pool import (
    Delivery,
    FinishedEvent,
    RelayCall,
    RestartedEvent,
    ResumedEvent,
    TokensEvent,
    WorkerId,
    WorkerPool,
)

log = logging.getLogger(__name__)


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


class _Live:
    """An attempt in flight, which retries of the same body wait for (``done``: its turn
    is recorded, or it ended without one)."""

    __slots__ = ("client_request_id", "done")

    def __init__(self, client_request_id: str) -> None:
        self.client_request_id = client_request_id
        self.done = asyncio.Event()


@dataclass(slots=True)
class PreparedTurn:
    """A turn that passed validation and was dispatched to a worker, or a retry that is
    answered with a recorded reply (``replay``; no call then)."""

    session: Session
    request: TurnRequest
    served: ServedModel
    plan: PromptPlan
    sampling: protocol.Sampling
    call: RelayCall | None
    started: float
    received_at: float = 0.0  # when the turn's request reached the service
    # The response writer, when a single stream writes this turn's events (see stream()).
    sink: EventSink | None = None
    replay: TurnNode | None = None  # the recorded turn a retry is answered with
    retry_of: int | None = None  # the earlier (cut) attempt this sampled turn replaces
    live: _Live | None = None  # registered while in flight, for retries to join
    detached: bool = False  # finished in the background after its client left
    agent: TurnAgent = field(default_factory=TurnAgent)  # the agent the turn belongs to


class TurnService:
    def __init__(
        self,
        pool: WorkerPool,
        models: ModelRegistry,
        *,
        global_max_tokens: int,
        retry_after_seconds: int = 5,
        stream_interval: int = 1,
        coalescer: StreamCoalescer | None = None,
    ) -> None:
        self.pool = pool
        self.models = models
        self.global_max_tokens = global_max_tokens
        self.retry_after_seconds = retry_after_seconds
        # A stream's events carry at least this many tokens (its first and last may carry
        # fewer): 1 writes every engine step to the agent as it is sampled.
        self.stream_interval = stream_interval
        # Holds streams' tokens while the event loop runs behind (None: every step is
        # written as it arrives, or in groups of ``stream_interval``).
        self.coalescer = coalescer
        self.metrics: ProxyMetrics | None = None
        # Where recorded turns are committed (None: in memory only).
        self.store: SessionStore | None = None
        self.limits = Limits()
        # Attempts in flight by (trial, request hash): a retry of one waits for it.
        self._live: dict[tuple[str, str], _Live] = {}
        self._detached: set[asyncio.Task[None]] = set()

    async def _served(self, session: Session, requested: str) -> ServedModel:
        served = await self.pool.wait_for_models()
        if not served:
            raise ServiceUnavailableError(
                f"no worker connected within {self.pool.wait_seconds:g}s",
                retry_after=self.retry_after_seconds,
                code="no_worker",
            )
        return self.models.resolve(requested, session.model, set(served))

    async def served_model(self, session: Session, requested: str) -> ServedModel:
        """The model a request of ``session`` naming ``requested`` is served by."""
        return await self._served(session, requested)

    def _unavailable(self, exc: NoWorkerAvailableError) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            str(exc), retry_after=self.retry_after_seconds, code="no_worker"
        )

    async def start(self, session: Session, request: TurnRequest) -> PreparedTurn:
        """Validate, plan the prompt and dispatch it. Every client error is raised here,
        before a response (or a stream) has begun."""
        try:
            return await self._start(session, request)
        except ProxyError as exc:
            self._count_server_error(session, exc)
            raise

    def _count_server_error(self, session: Session, exc: ProxyError) -> None:
        """A request of ``session`` answered with a server error (5xx) is counted on the
        trial: what its agent did next was not only the policy's doing."""
        if exc.status < 500:
            return
        session.server_errors += 1
        if self.store is not None:
            self.store.save_session(session).add_done_callback(_log_failed_write)

    async def _start(self, session: Session, request: TurnRequest) -> PreparedTurn:
        received = time.perf_counter()
        session.require_active()
        check_message_count(self.limits, len(request.messages))
        served = await self._served(session, request.requested_model)
        if session.options.routed_experts and served.routing is None:
            raise BadRequestError(
                f"{no_routing(self.pool, served.name)}, and this session asked for it",
                code="routing_unsupported",
            )
        renderer = served.renderer
        claimed = request.agent.id if request.agent is not None else None
        if request.prompt_ids is not None:
            plan = plan_raw_prompt(session, request.prompt_ids, claimed)
        else:
            messages, tools = request.messages, request.tools
            if served.vision is None and request.images:
                raise ImageError(
                    f"model {served.name!r} takes no images (it has no vision encoder); "
                    "send text only, or serve a vision-language model",
                    code="images_unsupported",
                )
            located = locate(session, messages, tools, claimed)
            vision = served.vision
            if _large(messages[located.rendered(session) :]):
                plan = await asyncio.to_thread(
                    plan_turn, session, renderer, messages, tools, located, vision
                )
            else:
                plan = plan_turn(session, renderer, messages, tools, located, vision)
        agent = attribute(session, request.agent, plan.parent, request.messages)
        session.claim_spawn(agent)
        room = session_token_room(self.limits, session.stored_tokens, len(plan.context_ids))
        budget = session.options.budget
        if budget is not None and budget.tokens is not None:
            # A reply is capped at the budget's tokens left (at least one, until spent).
            left = max(budget.tokens - session.sampled_tokens, 1)
            room = left if room is None else min(room, left)
        sampling = resolve_sampling(
            request.sampling,
            session.sampling,
            global_max_tokens=self.global_max_tokens
            if room is None
            else min(self.global_max_tokens, room),
            prompt_len=len(plan.prompt_ids),
            max_model_len=served.max_model_len,
            stop_token_ids=renderer.stop_token_ids,
        )
        if plan.parent is not None:
            # The agent continues that reply: it had it, whatever its delivery said.
            self._delivered(session, session.nodes[plan.parent])
        retry_of: int | None = None
        live: _Live | None = None
        marks = request.marks
        if marks is not None:
            replay, retry_of = await self._retry(session, marks)
            if replay is not None and replay.meta.model == served.name:
                return PreparedTurn(
                    session,
                    request,
                    served,
                    plan,
                    sampling,
                    None,
                    time.perf_counter(),
                    received_at=received,
                    replay=replay,
                    agent=agent,
                )
            if replay is not None:  # recorded by a model no longer served: sample anew
                retry_of = replay.index
        self._check_budget(session)
        if marks is not None:
            live = _Live(marks.client_request_id)
            self._live[(session.trial_id, marks.request_hash)] = live
        started = time.perf_counter()
        try:
            call = await self.pool.start(
                served.name,
                plan.prompt_ids,
                sampling,
                affinity=session.trial_id,
                images=_prompt_images(session, request, plan),
                routed_experts_from=_routed_from(session, plan),
            )
        except BaseException as exc:
            if live is not None:
                self._release(session, marks, live)
            if isinstance(exc, NoWorkerAvailableError):
                raise self._unavailable(exc) from None
            if isinstance(exc, PoolOverloadedError):
                if exc.scope == "trial":
                    raise TooManyRequestsError(
                        str(exc), retry_after=self.retry_after_seconds, code="too_many_requests"
                    ) from None
                raise ServiceUnavailableError(
                    str(exc), retry_after=self.retry_after_seconds, code="overloaded"
                ) from None
            raise
        return PreparedTurn(
            session,
            request,
            served,
            plan,
            sampling,
            call,
            started,
            received_at=received,
            retry_of=retry_of,
            live=live,
            agent=agent,
        )

    def _check_budget(self, session: Session) -> None:
        """Refuse a request of a trial whose budget is spent; the trial's outcome is then
        ``budget_exhausted`` (a retry answered from its record spends nothing)."""
        budget = session.options.budget
        spent = None if budget is None else budget.spent(len(session.nodes), session.sampled_tokens)
        if spent is None:
            return
        if session.outcome is None:
            session.outcome = Outcome.BUDGET_EXHAUSTED
            if self.store is not None:
                self.store.save_session(session).add_done_callback(_log_failed_write)
        raise BudgetExhaustedError(f"{spent}; this trial takes no more requests")

    async def _retry(
        self, session: Session, marks: RetryMarks
    ) -> tuple[TurnNode | None, int | None]:
        """The recorded turn a retry is answered with, or (None, the cut attempt a new
        sample replaces, if any). A marked retry of an attempt still in flight waits for
        it to be recorded first."""
        key = (session.trial_id, marks.request_hash)
        while True:
            live = self._live.get(key)
            index = session.by_request.get(marks.request_hash)
            decision = decide(
                marks,
                live_request_id=live.client_request_id if live is not None else None,
                earlier=session.nodes[index] if index is not None else None,
            )
            if decision.action is RetryAction.JOIN:
                assert live is not None
                await live.done.wait()
                session.require_active()
                continue
            if decision.action is RetryAction.REPLAY:
                assert decision.retry_of is not None
                return session.nodes[decision.retry_of], None
            return None, decision.retry_of

    def _release(self, session: Session, marks: RetryMarks | None, live: _Live) -> None:
        if marks is not None:
            key = (session.trial_id, marks.request_hash)
            if self._live.get(key) is live:
                del self._live[key]
        live.done.set()

    def _settled(self, prepared: PreparedTurn, *, detached: bool = False) -> None:
        """The attempt is over (recorded, or ended without a turn): retries stop waiting."""
        if prepared.detached and not detached:
            return  # the background task that finishes it settles it
        live = prepared.live
        if live is not None:
            prepared.live = None
            self._release(prepared.session, prepared.request.marks, live)

    def settle_delivery(
        self, session: Session, nodes: Sequence[TurnNode], delivered: bool, *, replay: bool = False
    ) -> None:
        """After a reply's last write: ``delivered`` when its last byte was handed to the
        client. Recorded on each turn the reply carried."""
        for node in nodes:
            if delivered:
                self._delivered(session, node)
            elif not replay and not node.meta.truncated and self.metrics is not None:
                self.metrics.undelivered_turns.labels(node.meta.api).inc()

    def _delivered(self, session: Session, node: TurnNode) -> None:
        if node.meta.delivered or not _recorded(session, node):
            return
        node.meta.delivered = True
        self._save_meta(session, node)

    def _save_meta(self, session: Session, node: TurnNode) -> None:
        if self.store is not None and _recorded(session, node):
            self.store.save_turn_meta(session, node).add_done_callback(_log_failed_write)

    async def run_turn(self, session: Session, request: TurnRequest) -> TurnResult:
        """A whole turn, for non-streaming APIs."""
        prepared = await self.start(session, request)
        try:
            async for event in self.stream(prepared, incremental=False):
                if isinstance(event, TurnDone):
                    return event.result
        finally:
            self._settled(prepared)
        raise UpstreamError("the turn ended without a result")  # pragma: no cover

    @contextlib.asynccontextmanager
    async def streaming(
        self, prepared: PreparedTurn
    ) -> AsyncIterator[AsyncGenerator[TurnEvent, None]]:
        """``stream(prepared)`` for a response writer, cleaned up however the writer ends.

        A generator that never started (the client left before the first event) runs none
        of its own cleanup, so the call is cancelled here too (a no-op once finished)."""
        events = self.stream(prepared)
        try:
            yield events
        finally:
            await events.aclose()
            if prepared.call is not None:
                await prepared.call.cancel()
            self._settled(prepared)

    async def stream(
        self, prepared: PreparedTurn, *, incremental: bool = True
    ) -> AsyncGenerator[TurnEvent, None]:
        """Events as the worker samples; the turn is recorded before ``TurnDone``.

        ``incremental=False`` is for a consumer that only wants the result (a reply that
        is not streamed): the sampled ids are then decoded and parsed once at the end
        instead of token by token, with the same outcome. Stop strings still need the
        text as it grows, so with them decoding stays incremental.

        Where the consumer set ``prepared.sink``, an engine step's tokens are decoded and
        written by the relay as they arrive (when the sink can write at once); the
        events that come out of this generator are then the rest (the end, and whatever
        the sink declined), in order with what the sink wrote. While the proxy's event
        loop runs behind, the sink holds a stream's tokens (after its first event) until a
        group of them waits or the coalescer's sweep comes, so that they go out together.

        If the consumer goes away (the agent disconnected), the generation is cancelled on
        the worker and what was sampled so far is recorded as a truncated turn."""
        if prepared.replay is not None:
            async for out in self._replay(prepared, prepared.replay):
                yield out
            return
        call = prepared.call
        assert call is not None
        request = prepared.request
        whole = not incremental  # the consumer wants the result only (not streamed)
        incremental = incremental or bool(request.stop)
        decoding = _Decoding(prepared)

        coalescer = self.coalescer

        def deliver(tokens: TokensEvent, may_hold: bool) -> Delivery:
            sink = prepared.sink
            if sink is None:
                return Delivery.DECLINED
            if (
                may_hold
                and coalescer is not None
                and decoding.shown
                and coalescer.hold(call, len(tokens.token_ids))
            ):
                return Delivery.HELD
            if not sink.writable_now():
                return Delivery.DECLINED
            events = decoding.feed(tokens)
            if events:
                sink.write_now(events)
            return Delivery.WRITTEN

        if incremental and not request.stop:
            # A stop string needs the worker cancelled when it matches: not in the relay.
            # Held tokens are offered again once a group of them waits (or at a sweep).
            call.deliver_to(deliver, group=coalescer.policy.group if coalescer else 0)
        finished: FinishedEvent | None = None
        try:
            try:
                wake_after = self.stream_interval if incremental else None
                async for event in call.events(wake_after=wake_after):
                    if isinstance(event, TokensEvent):
                        if not incremental:
                            decoding.add(event)
                            continue
                        for out in decoding.feed(event):
                            yield out
                        finished = await _ended_by_stop(call, decoding)
                        if finished is not None:
                            break
                    elif isinstance(event, RestartedEvent):
                        if decoding.shown:
                            await call.cancel()
                            raise UpstreamError(
                                "the worker was lost after the reply had started streaming",
                                code="worker_lost",
                            )
                        decoding = _Decoding(prepared)
                    elif isinstance(event, ResumedEvent):
                        # Another worker continues after the tokens already received:
                        # nothing to discard, the stream goes on.
                        continue
                    else:
                        finished = event
            except WorkerFailedError as exc:
                if exc.code == "prompt_too_long":
                    raise ContextLengthError(exc.message) from None
                raise UpstreamError(f"the worker failed: {exc.message}", code=exc.code) from None
            except NoWorkerAvailableError as exc:
                raise self._unavailable(exc) from None
            except RelayError as exc:
                raise ProxyError(f"relay error: {exc}") from None
            finally:
                call.deliver_to(None)
        except ProxyError as exc:
            self._count_server_error(prepared.session, exc)
            _take_waiting(prepared, decoding)
            if decoding.detok.ids:
                # The worker failed mid-turn: what it sampled is kept as a truncated turn.
                self._keep_cut(prepared, decoding)
            self._settled(prepared)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if whole and prepared.live is not None and not call.cancelled:
                # A whole reply whose client stopped waiting (an SDK's timeout), with stop
                # strings or without: it is finished anyway, so the client's retry joins it
                # or gets it from the record instead of starting over (and timing out again).
                self._detach(prepared, decoding)
                raise
            await call.cancel()
            self._keep_cut(prepared, decoding)
            self._settled(prepared)
            raise
        if finished is None:
            raise UpstreamError("the worker stream ended without finishing")
        # The generation is over: record it whole before the last events go out, so an
        # agent that leaves while they are written loses nothing that was sampled.
        last, parsed = decoding.finish()
        result = self._record_whole(prepared, decoding, finished, parsed)
        # Durable before the agent is answered: TurnDone is what writes the reply's end
        # (the whole body, or the stream's final events).
        await self._commit(prepared.session, result.node)
        self._settled(prepared)
        for out in last:
            yield out
        yield TurnDone(result)

    def _detach(self, prepared: PreparedTurn, decoding: _Decoding) -> None:
        prepared.detached = True
        task = asyncio.get_running_loop().create_task(self._finish_detached(prepared, decoding))
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _finish_detached(self, prepared: PreparedTurn, decoding: _Decoding) -> None:
        """Sample the rest of a non-streamed reply whose client left, and record it whole
        and undelivered (or cut, if the worker fails): a retry is answered with it."""
        call = prepared.call
        assert call is not None
        # Stop strings need the text as it grows, to end the reply where one matches (as
        # it would have ended had the client waited).
        stops = bool(prepared.request.stop)
        finished: FinishedEvent | None = None
        try:
            try:
                async for event in call.events(wake_after=self.stream_interval if stops else None):
                    if isinstance(event, TokensEvent):
                        if not stops:
                            decoding.add(event)
                            continue
                        decoding.feed(event)
                        finished = await _ended_by_stop(call, decoding)
                        if finished is not None:
                            break
                    elif isinstance(event, RestartedEvent):
                        decoding = _Decoding(prepared)
                    elif isinstance(event, FinishedEvent):
                        finished = event
            except (RelayError, NoWorkerAvailableError):
                finished = None
            if finished is None:
                self._keep_cut(prepared, decoding)
                return
            _, parsed = decoding.finish()
            result = self._record_whole(prepared, decoding, finished, parsed)
            if self.metrics is not None:
                self.metrics.undelivered_turns.labels(prepared.request.api).inc()
            self._commit_later(prepared.session, result.node)
        except asyncio.CancelledError:  # the proxy stops
            await call.cancel()
            self._keep_cut(prepared, decoding)
            raise
        except StorageError as exc:  # the store closed first: the proxy is stopping
            log.warning("a reply finished after its client left could not be saved: %s", exc)
        finally:
            self._settled(prepared, detached=True)

    async def _replay(
        self, prepared: PreparedTurn, node: TurnNode
    ) -> AsyncGenerator[TurnEvent, None]:
        """A retry answered with a recorded reply: its events, decoded from the recorded
        ids for this request's API, and the result. Nothing is sampled or recorded."""
        decoding = _Decoding(prepared)
        events = decoding.feed_ids(node.completion_ids, node.logprobs)
        last, parsed = decoding.finish()
        streamed = decoding.calls
        calls = tuple(
            streamed[i]
            if i < len(streamed)
            else ToolCall(_call_id(c, streamed), c.name, c.arguments)
            for i, c in enumerate(parsed.tool_calls)
        )
        meta = node.meta
        meta.replays += 1
        self._save_meta(prepared.session, node)
        if self.metrics is not None:
            self.metrics.replayed_turns.labels(prepared.request.api).inc()
        stop_cap = meta.capped and prepared.session.options.cap_finish is CapFinish.STOP
        result = TurnResult(
            node=node,
            model=meta.model,
            content=parsed.content,
            tool_calls=calls,
            finish_reason="stop" if stop_cap else meta.finish_reason,
            prompt_tokens=node.prompt_len,
            completion_tokens=len(node.completion_ids),
            stop_sequence=meta.stop_sequence,
            reasoning="".join(decoding.splitter.reasoning),
            replayed=True,
        )
        for out in (*events, *last):
            yield out
        yield TurnDone(result)

    async def _commit(self, session: Session, node: TurnNode) -> None:
        if self.store is not None and _recorded(session, node):
            await self.store.save_turn(session, node)

    def _commit_later(self, session: Session, node: TurnNode) -> None:
        if self.store is not None and _recorded(session, node):
            self.store.save_turn(session, node).add_done_callback(_log_failed_write)

    def _keep_cut(self, prepared: PreparedTurn, decoding: _Decoding) -> None:
        """What was sampled of a reply that did not finish, recorded as a truncated turn;
        nobody waits for it, so its write is queued and committed regardless."""
        _take_waiting(prepared, decoding)
        cut = self._record(
            prepared, decoding.detok.ids, decoding.logprobs, None, None, truncated=True
        )
        self._commit_later(prepared.session, cut.node)

    def _record_whole(
        self,
        prepared: PreparedTurn,
        decoding: _Decoding,
        finished: FinishedEvent,
        parsed: ParsedOutput,
    ) -> TurnResult:
        """A finished reply, recorded whole (before its last events go out)."""
        return self._record(
            prepared,
            decoding.detok.ids,
            decoding.logprobs,
            finished,
            parsed,
            truncated=False,
            streamed=decoding.calls,
            stop_sequence=decoding.stopper.hit,
            reasoning="".join(decoding.splitter.reasoning),
        )

    def _record(
        self,
        prepared: PreparedTurn,
        ids: list[int],
        logprobs: list[float],
        finished: FinishedEvent | None,
        parsed: ParsedOutput | None,
        *,
        truncated: bool,
        streamed: Sequence[ToolCall] = (),
        stop_sequence: str | None = None,
        reasoning: str | None = None,
    ) -> TurnResult:
        session, plan, renderer = prepared.session, prepared.plan, prepared.served.renderer
        if parsed is None:
            reasoning, answer = split_whole(_splitter(prepared), renderer.completion_text(ids))
            parsed = renderer.parse(answer, prepared.request.tools)
        # Tool calls keep the ids a streaming client already saw; malformed output has none.
        made: list[ToolCall] = []
        for i, c in enumerate(parsed.tool_calls):
            made.append(
                streamed[i]
                if i < len(streamed)
                else ToolCall(_call_id(c, made), c.name, c.arguments)
            )
        tool_calls = tuple(made)
        marks = prepared.request.marks
        returned = ChatMessage(role="assistant", content=parsed.content, tool_calls=tool_calls)
        choice = prepared.request.tool_choice
        unmet = (choice == "required" and not tool_calls) or (
            choice not in {"auto", "none", "required"}
            and not any(c.name == choice for c in tool_calls)
        )
        call = prepared.call
        assert call is not None
        dispatched = call.started_at or prepared.started
        finish = finished.finish_reason if finished is not None else "abort"
        asked = prepared.request.sampling.max_tokens
        capped = finish == "length" and (asked is None or prepared.sampling.max_tokens < asked)
        node = TurnNode(
            index=len(session.nodes),
            parent=plan.parent,
            context_ids=array("i", plan.context_ids),
            completion_ids=array("i", ids),
            logprobs=array("f", logprobs[: len(ids)]),
            prompt_len=len(plan.prompt_ids),
            images=plan.images,
            routing=_routing(prepared, len(plan.prompt_ids) + len(ids)),
            agent=_with_spawns(prepared.agent, tool_calls),
            key=raw_prompt_key([*plan.prompt_ids, *ids])
            if prepared.request.prompt_ids is not None
            else extend_key(plan.request_key, returned),
            meta=TurnMeta(
                api=prepared.request.api,
                model=prepared.served.name,
                requested_model=prepared.request.requested_model,
                worker_id=finished.worker_id if finished is not None else (call.worker_id or ""),
                finish_reason=finish,
                sampling=sampling_record(prepared.sampling),
                created_at=time.time(),
                queue_seconds=dispatched - call.queued_at,
                engine_seconds=time.perf_counter() - dispatched,
                branch_reason=plan.branch_reason,
                tool_calls=len(tool_calls),
                malformed_tool_call=parsed.malformed,
                truncated=truncated,
                stop_sequence=stop_sequence,
                tool_choice_unmet=unmet,
                reasoning_returned=_with_reasoning(prepared.request.messages),
                capped=capped,
                extra=dict(finished.extra) if finished is not None else {},
                versions=[list(span) for span in call.version_spans(len(ids))],
                delivered=False,  # until its reply's end is written (settle_delivery)
                retry_of=prepared.retry_of,
                request_hash=marks.request_hash if marks is not None else "",
                client_request_id=marks.client_request_id if marks is not None else "",
            ),
        )
        if session.state is SessionState.ACTIVE:
            for placed in plan.images:  # an image is kept with the first turn that uses it
                if placed.sha256 not in session.images:
                    session.images[placed.sha256] = prepared.request.images[placed.sha256]
            session.add_turn(node)
        if self.metrics is not None:
            now = time.perf_counter()
            first = call.first_token_at
            self.metrics.observe_turn(
                api=prepared.request.api,
                finish_reason=finish,
                truncated=truncated,
                prompt_tokens=len(plan.prompt_ids),
                completion_tokens=len(ids),
                queue_seconds=node.meta.queue_seconds,
                engine_seconds=node.meta.engine_seconds,
                total_seconds=now - prepared.received_at,
                first_token_seconds=None if first is None else first - prepared.received_at,
            )
            if truncated:  # a cut reply never reaches the client whole
                self.metrics.undelivered_turns.labels(prepared.request.api).inc()
        return TurnResult(
            node=node,
            model=prepared.served.name,
            content=parsed.content,
            tool_calls=tool_calls,
            # What the agent is told; the record above keeps "length" (session cap_finish).
            finish_reason="stop"
            if capped and session.options.cap_finish is CapFinish.STOP
            else finish,
            prompt_tokens=len(plan.prompt_ids),
            completion_tokens=len(ids),
            stop_sequence=stop_sequence,
            reasoning=reasoning or "",
        )


class _Decoding:
    """What one attempt of a turn made of its sampled tokens: the text decoded so far,
    stop strings, reasoning split from the answer, tool calls parsed while streaming.
    The same steps whether the relay delivers a step's tokens or the stream's consumer
    takes them."""

    __slots__ = ("calls", "detok", "logprobs", "parser", "shown", "splitter", "stopper")

    def __init__(self, prepared: PreparedTurn) -> None:
        renderer = prepared.served.renderer
        self.detok = IncrementalDetokenizer(renderer.tokenizer, renderer.stop_token_ids)
        self.parser = _parser(prepared)
        self.splitter = _splitter(prepared)
        self.stopper = StopMatcher(prepared.request.stop)
        self.logprobs: list[float] = []
        self.calls: list[ToolCall] = []
        self.shown = False  # an event went out: the reply can no longer restart

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
        events = list(_parsed(self.parser, self.splitter.feed(text), self.calls))
        if events:
            self.shown = True
        return events

    def finish(self) -> tuple[list[TurnEvent], ParsedOutput]:
        """The events of what was held back, and the reply's parsed tool calls."""
        stopper = self.stopper
        tail = "" if stopper.hit is not None else stopper.feed(self.detok.flush()) + stopper.flush()
        pieces = (self.splitter.feed(tail) if tail else []) + self.splitter.finish()
        last = list(_parsed(self.parser, pieces, self.calls))
        events, parsed = self.parser.finish()
        last.extend(_parsed_events(events, self.calls))
        return last, parsed


# How long a reply ended by a stop string waits for its worker's last frame, which brings
# the routing rows of what it sampled (sessions that record routing only); past it, the
# turn is recorded with those rows missing.
_ROWS_AFTER_STOP_SECONDS = 5.0


async def _ended_by_stop(call: RelayCall, decoding: _Decoding) -> FinishedEvent | None:
    """Where a stop string matched, the reply ends: the worker is stopped."""
    if decoding.stopper.hit is None:
        return None
    await call.cancel(keep_rows=True)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_ROWS_AFTER_STOP_SECONDS):
            await call.rows_after_cancel()
    return FinishedEvent("stop_sequence", call.worker_id or WorkerId(""), {})


def _take_waiting(prepared: PreparedTurn, decoding: _Decoding) -> None:
    """Tokens the worker sent that the attempt's consumer never took (a stream's sink held
    them while the proxy ran behind, or its task was cancelled before it woke): they were
    sampled, so a cut turn keeps them after the ones decoded."""
    call = prepared.call
    assert call is not None
    waiting = call.take_waiting()
    if waiting is not None:
        decoding.add(waiting)


def _parser(prepared: PreparedTurn) -> ToolCallStream:
    parser = prepared.served.renderer.parser
    if prepared.request.tool_choice == "none" or not prepared.request.tools:
        # Without tools there is nothing to call; with tool_choice "none" the tools
        # stay rendered but calls are not parsed.
        parser = get_parser("none")
    return parser.stream(_tool_schemas(prepared.request.tools))


def _splitter(prepared: PreparedTurn) -> Splitter:
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
    parser: ToolCallStream, pieces: list[Piece], calls: list[ToolCall]
) -> Iterator[TurnEvent]:
    """Reasoning pieces as they are; answer pieces through the tool-call parser."""
    for piece in pieces:
        if isinstance(piece, ReasoningPiece):
            yield ReasoningDelta(piece.text)
        else:
            yield from _parsed_events(parser.feed(piece.text), calls)


def _parsed_events(events: list[StreamEvent], calls: list[ToolCall]) -> Iterator[TurnEvent]:
    for event in events:
        if isinstance(event, ContentDelta):
            if event.text:
                yield TextDelta(event.text)
        else:
            call = ToolCall(_call_id(event.call, calls), event.call.name, event.call.arguments)
            calls.append(call)
            yield ToolCallReady(event.index, call)


def _prompt_images(session: Session, request: TurnRequest, plan: PromptPlan) -> list[PromptImage]:
    """Every image of the turn's prompt, with its bytes, for the worker."""
    placed: list[PlacedImage] = session.prompt_images(plan.parent)
    placed.extend(plan.images)
    out: list[PromptImage] = []
    for image in placed:
        data = session.images.get(image.sha256) or request.images[image.sha256]
        out.append(PromptImage(image.sha256, data.data, image.start, image.end))
    return out


def _routed_from(session: Session, plan: PromptPlan) -> int | None:
    """The first position whose routing row a turn asks for: the chain it continues holds
    the rows before its parent's last sampled token (which nothing ran forward yet); a new
    root asks for all. None: the session records no routing."""
    if not session.options.routed_experts:
        return None
    return 0 if plan.parent is None else session.nodes[plan.parent].end - 1


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
    """The turn's agent with the sub-agents its reply asked for (Agent/Task calls)."""
    spawns = spawns_of(tool_calls)
    return msgspec.structs.replace(agent, spawns=spawns) if spawns else agent


def _recorded(session: Session, node: TurnNode) -> bool:
    """Whether ``node`` was added to the session (not when it had stopped accepting turns)."""
    return node.index < len(session.nodes) and session.nodes[node.index] is node


def _log_failed_write(future: asyncio.Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a write to the session store failed: %s", future.exception())


def _call_id(call: ParsedToolCall, earlier: Sequence[ToolCall]) -> str:
    """The id the model wrote for the call (Kimi-K2), unless an earlier call of the reply
    has it already; else a fresh one."""
    if call.id and all(c.id != call.id for c in earlier):
        return call.id
    return new_id("call")


def _tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    return [t.template_dict() for t in tools] if tools else None


_CONTENT = operator.attrgetter("content")
_REASONING = operator.attrgetter("reasoning")


def _with_reasoning(messages: Sequence[ChatMessage]) -> int:
    """How many of the history's (assistant) messages came with their reasoning; counted
    in C, as the history may be long."""
    return sum(map(bool, map(_REASONING, messages)))


def _large(messages: Sequence[ChatMessage]) -> bool:
    """Big renders go to a thread so they do not stall other sessions' streams."""
    return sum(map(len, map(_CONTENT, messages))) > 200_000


def no_routing(pool: WorkerPool, model: str) -> str:
    """Why ``model`` comes without expert routing, for a refusal: what its worker's engine
    said (vLLM's CPU build cannot return it), else the two usual reasons."""
    info = pool.served_models().get(model)
    why = info.routing_unavailable if info is not None else None
    if why:
        return f"model {model!r} reports no expert routing: {why}"
    return (
        f"model {model!r} reports no expert routing (a dense model, or workers whose engine "
        "cannot report it)"
    )
