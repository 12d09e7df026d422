"""A turn's generation: the plan's prompt sent to a worker (``served_model``, then
``dispatch``), its stream turned into the agent API's events.

``Generation.events`` yields what the agent is shown as the worker samples: where the
response writer set a sink (``PreparedTurn.sink``), an engine step's tokens are decoded
and written by the relay as they arrive, and only the rest comes out of the generator, in
order with what the sink wrote. While the event loop runs behind, the sink holds a
stream's tokens (after its first event) until a group of them waits or the coalescer's
sweep comes. Relay failures become the proxy's errors here. ``replay`` is a retry's
answer: the events of a recorded reply, nothing sampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable

from proxy.chat.messages import ToolCall
from proxy.coalesce import StreamCoalescer
from proxy.exceptions import (
    BadRequestError,
    ContextLengthError,
    ProxyError,
    ServiceUnavailableError,
    TooManyRequestsError,
    UpstreamError,
)
from proxy.models import ModelRegistry, ServedModel
from proxy.sessions.model import PlacedImage, Session, TurnNode
from proxy.sessions.options import CapFinish
from proxy.turns.attempt import PreparedTurn
from proxy.turns.decoding import Decoding
from proxy.turns.request import TurnDone, TurnEvent, TurnResult
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

__all__ = ["Generation", "dispatch", "no_routing", "replay", "served_model", "unavailable"]

# How long a reply ended by a stop string waits for its worker's last frame, which brings
# the routing rows of what it sampled (sessions that record routing only); past it, the
# turn is recorded with those rows missing.
_ROWS_AFTER_STOP_SECONDS = 5.0


def unavailable(exc: NoWorkerAvailableError, retry_after: int) -> ServiceUnavailableError:
    return ServiceUnavailableError(str(exc), retry_after=retry_after, code="no_worker")


class Generation:
    """One attempt's sampling: what it decoded so far (``decoding``) and how it ended
    (``finished``: None until the worker finished, or when it never did)."""

    __slots__ = ("call", "coalescer", "decoding", "finished", "on_call", "prepared", "retry_after")

    def __init__(
        self,
        prepared: PreparedTurn,
        *,
        coalescer: StreamCoalescer | None,
        retry_after: int,
        on_call: Callable[[ToolCall], None] | None = None,
    ) -> None:
        assert prepared.call is not None
        self.prepared = prepared
        self.call: RelayCall = prepared.call
        self.coalescer = coalescer
        self.retry_after = retry_after
        self.on_call = on_call  # told of each tool call before the agent is sent it
        self.decoding = Decoding(prepared, on_call)
        self.finished: FinishedEvent | None = None

    async def events(
        self, *, incremental: bool, stream_interval: int
    ) -> AsyncGenerator[TurnEvent, None]:
        """The reply's events until the worker finishes; ``incremental=False`` for a
        consumer that wants the result only (the ids are decoded once at the end, unless
        stop strings need the text as it grows). Raises ``ProxyError``."""
        call, stops = self.call, bool(self.prepared.request.stop)
        incremental = incremental or stops
        if incremental and not stops:
            # A stop string needs the worker cancelled when it matches: not in the relay.
            call.deliver_to(
                self._deliver, group=self.coalescer.policy.group if self.coalescer else 0
            )
        try:
            async for event in call.events(wake_after=stream_interval if incremental else None):
                if isinstance(event, TokensEvent):
                    if not incremental:
                        self.decoding.add(event)
                        continue
                    for out in self.decoding.feed(event):
                        yield out
                    if await self._ended_by_stop():
                        return
                elif isinstance(event, RestartedEvent):
                    await self._restart()
                elif not isinstance(event, ResumedEvent):  # resumed: the stream goes on
                    self.finished = event
        except WorkerFailedError as exc:
            if exc.code == "prompt_too_long":
                raise ContextLengthError(exc.message) from None
            raise UpstreamError(f"the worker failed: {exc.message}", code=exc.code) from None
        except NoWorkerAvailableError as exc:
            raise unavailable(exc, self.retry_after) from None
        except RelayError as exc:
            raise ProxyError(f"relay error: {exc}") from None
        finally:
            call.deliver_to(None)
        if self.finished is None:
            raise UpstreamError("the worker stream ended without finishing")

    async def rest(self, stream_interval: int) -> None:
        """Sample the rest with nobody reading (a whole reply whose client left): stop
        strings still end it where one matches, as they would have with the client there."""
        stops = bool(self.prepared.request.stop)
        try:
            async for event in self.call.events(wake_after=stream_interval if stops else None):
                if isinstance(event, TokensEvent):
                    if not stops:
                        self.decoding.add(event)
                    else:
                        self.decoding.feed(event)
                        if await self._ended_by_stop():
                            return
                elif isinstance(event, RestartedEvent):
                    self.decoding = Decoding(self.prepared, self.on_call)
                elif isinstance(event, FinishedEvent):
                    self.finished = event
        except (RelayError, NoWorkerAvailableError):
            self.finished = None

    def take_waiting(self) -> None:
        """Tokens the worker sent that the consumer never took (a stream's sink held them
        while the proxy ran behind, or its task was cancelled before it woke): they were
        sampled, so a cut turn keeps them after the ones decoded."""
        waiting = self.call.take_waiting()
        if waiting is not None:
            self.decoding.add(waiting)

    def _deliver(self, tokens: TokensEvent, may_hold: bool) -> Delivery:
        """The relay's delivery of an engine step, straight to the response's sink."""
        sink, coalescer = self.prepared.sink, self.coalescer
        if sink is None:
            return Delivery.DECLINED
        if (
            may_hold
            and coalescer is not None
            and self.decoding.shown
            and coalescer.hold(self.call, len(tokens.token_ids))
        ):
            return Delivery.HELD
        if not sink.writable_now():
            return Delivery.DECLINED
        events = self.decoding.feed(tokens)
        if events:
            sink.write_now(events)
        return Delivery.WRITTEN

    async def _restart(self) -> None:
        """Another worker samples the reply from the start: nothing shown is lost, or the
        turn fails (the agent saw the start of a reply that is gone)."""
        if self.decoding.shown:
            await self.call.cancel()
            raise UpstreamError(
                "the worker was lost after the reply had started streaming", code="worker_lost"
            )
        self.decoding = Decoding(self.prepared, self.on_call)

    async def _ended_by_stop(self) -> bool:
        """Where a stop string matched, the reply ends: the worker is stopped."""
        if self.decoding.stopper.hit is None:
            return False
        call = self.call
        await call.cancel(keep_rows=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_ROWS_AFTER_STOP_SECONDS):
                await call.rows_after_cancel()
        self.finished = FinishedEvent("stop_sequence", call.worker_id or WorkerId(""), {})
        return True


async def replay(prepared: PreparedTurn, node: TurnNode) -> AsyncGenerator[TurnEvent, None]:
    """A retry answered with a recorded reply: its events, decoded from the recorded ids
    for this request's API, and the result. Nothing is sampled or recorded."""
    decoding = Decoding(prepared)
    events = decoding.feed_ids(node.completion_ids, node.logprobs)
    last, parsed = decoding.finish()
    calls = decoding.reply_calls(parsed)
    meta = node.meta
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


async def served_model(
    pool: WorkerPool, models: ModelRegistry, session: Session, requested: str, retry_after: int
) -> ServedModel:
    """The model a request of ``session`` naming ``requested`` is served by (waiting a
    while for a worker), refusing one that cannot do what the session asked."""
    served = await pool.wait_for_models()
    if not served:
        raise ServiceUnavailableError(
            f"no worker connected within {pool.wait_seconds:g}s",
            retry_after=retry_after,
            code="no_worker",
        )
    model = models.resolve(requested, session.model, set(served))
    if session.options.routed_experts and model.routing is None:
        raise BadRequestError(
            f"{no_routing(pool, model.name)}, and this session asked for it",
            code="routing_unsupported",
        )
    return model


async def dispatch(pool: WorkerPool, turn: PreparedTurn, retry_after: int) -> RelayCall:
    """The plan's prompt (and its images) to a worker; a pool that cannot take it is the
    agent's 503 (or 429: the trial's own requests are too many)."""
    session = turn.session
    turn.started = time.perf_counter()
    try:
        return await pool.start(
            turn.served.name,
            turn.plan.prompt_ids,
            turn.sampling,
            affinity=session.trial_id,
            images=_prompt_images(session, turn),
            routed_experts_from=_routed_from(session, turn),
        )
    except NoWorkerAvailableError as exc:
        raise unavailable(exc, retry_after) from None
    except PoolOverloadedError as exc:
        raise _overloaded(exc, retry_after) from None


def _overloaded(exc: PoolOverloadedError, retry_after: int) -> ProxyError:
    if exc.scope == "trial":
        return TooManyRequestsError(str(exc), retry_after=retry_after, code="too_many_requests")
    return ServiceUnavailableError(str(exc), retry_after=retry_after, code="overloaded")


def _prompt_images(session: Session, turn: PreparedTurn) -> list[PromptImage]:
    """Every image of the turn's prompt, with its bytes, for the worker."""
    placed: list[PlacedImage] = session.prompt_images(turn.plan.parent)
    placed.extend(turn.plan.images)
    out: list[PromptImage] = []
    for image in placed:
        data = session.images.get(image.sha256) or turn.request.images[image.sha256]
        out.append(PromptImage(image.sha256, data.data, image.start, image.end))
    return out


def _routed_from(session: Session, turn: PreparedTurn) -> int | None:
    """The first position whose routing row a turn asks for: the chain it continues holds
    the rows before its parent's last sampled token (which nothing ran forward yet); a new
    root asks for all. None: the session records no routing."""
    if not session.options.routed_experts:
        return None
    parent = turn.plan.parent
    return 0 if parent is None else session.nodes[parent].end - 1


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
