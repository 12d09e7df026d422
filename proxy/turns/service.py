"""Running one turn: plan, generate, record, in that order.

The API adapters (OpenAI chat and completions, Anthropic messages, Responses) translate
their wire format into a ``TurnRequest`` and the ``TurnResult`` back; this is the one
place that sequences a turn's steps:

1. ``start``: the model that serves it (waiting for a worker), then the plan
   (``proxy.turns.plan``: pure), then the retry it may be (wait for the attempt in
   flight, or answer from the record), then the dispatch to a worker. Every client error
   is raised here, before a response (or a stream) has begun.
2. ``stream``: the generation's events (``proxy.turns.generate``), and the turn recorded
   and committed (``proxy.turns.record``) before the last of them goes out.
3. ``settle_delivery``: whether the reply reached the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from proxy.coalesce import StreamCoalescer
from proxy.exceptions import ProxyError, StorageError, UpstreamError
from proxy.limits import Limits, check_message_count
from proxy.models import ModelRegistry, ServedModel
from proxy.sessions.model import Session, TurnNode
from proxy.turns.attempt import Live, PreparedTurn
from proxy.turns.generate import Generation, dispatch, no_routing, replay, served_model
from proxy.turns.plan import TurnPlan, large_render, locate_request, plan, plan_prompt
from proxy.turns.record import Recorder
from proxy.turns.request import TurnDone, TurnEvent, TurnRequest, TurnResult
from relay.pool import WorkerPool

__all__ = ["TurnService", "no_routing"]  # no_routing: the sessions API refuses with it

log = logging.getLogger(__name__)


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
        self.recorder = Recorder()  # its store and metrics are set by the app
        self.limits = Limits()
        # Attempts in flight by (trial, request hash): a retry of one waits for it.
        self._live: dict[tuple[str, str], Live] = {}
        self._detached: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ 1. start

    async def served_model(self, session: Session, requested: str) -> ServedModel:
        """The model a request of ``session`` naming ``requested`` is served by."""
        return await served_model(
            self.pool, self.models, session, requested, self.retry_after_seconds
        )

    async def start(self, session: Session, request: TurnRequest) -> PreparedTurn:
        """Plan the turn and dispatch it (or answer a retry from the record)."""
        try:
            received = time.perf_counter()
            session.require_active()
            check_message_count(self.limits, len(request.messages))
            served = await self.served_model(session, request.requested_model)
            planned = await self._plan(session, request, served)
            if planned.prompt.parent is not None:
                # The agent continues that reply: it had it, whatever its delivery said.
                self.recorder.delivered(session, session.nodes[planned.prompt.parent])
            turn = PreparedTurn(session, request, served, planned, None, 0.0, received)
            turn.replay = planned.replay
            if turn.replay is not None:
                turn.started = time.perf_counter()
                return turn
            # A sub-agent's first request holds its spawning call from its plan on (another
            # starting at once takes another call), until it is refused or its turn ends.
            turn.reserved = session.spawning.hold(turn.agent)
            try:
                if planned.budget_spent is not None:
                    self.recorder.budget_spent(session, planned.budget_spent)
                await self._dispatch(turn)
            except BaseException:
                self._settled(turn)
                raise
            return turn
        except ProxyError as exc:
            self.recorder.server_error(session, exc)
            raise

    async def _plan(self, session: Session, request: TurnRequest, served: ServedModel) -> TurnPlan:
        """The plan. A large render goes to a thread so it does not stall other sessions;
        the rest is decided after it, on the event loop, against the session and the
        attempts in flight as they are then. A marked retry of an attempt still in flight
        waits for it to be recorded, then plans again."""
        while True:
            located = locate_request(session, request)
            if large_render(session, request, located):
                prompt = await asyncio.to_thread(plan_prompt, session, request, served, located)
            else:
                prompt = plan_prompt(session, request, served, located)
            marks = request.marks
            live = self._live.get((session.trial_id, marks.request_hash)) if marks else None
            planned = plan(
                session,
                request,
                served,
                limits=self.limits,
                global_max_tokens=self.global_max_tokens,
                prompt=prompt,
                live_request_id=live.client_request_id if live is not None else None,
            )
            if not planned.join:
                return planned
            assert live is not None
            await live.done.wait()

    async def _dispatch(self, turn: PreparedTurn) -> None:
        """The plan to a worker; the attempt is live from now on (retries of its body wait
        for it)."""
        marks = turn.request.marks
        if marks is not None:
            turn.live = Live(marks.client_request_id)
            self._live[(turn.session.trial_id, marks.request_hash)] = turn.live
        turn.call = await dispatch(self.pool, turn, self.retry_after_seconds)

    # ------------------------------------------------------------------ 2. generate, record

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
        is not streamed). If the consumer goes away (the agent disconnected), the
        generation is cancelled on the worker and what was sampled so far is recorded as
        a truncated turn."""
        if prepared.replay is not None:
            self.recorder.replayed(prepared, prepared.replay)
            async for out in replay(prepared, prepared.replay):
                yield out
            return
        generation = Generation(
            prepared,
            coalescer=self.coalescer,
            retry_after=self.retry_after_seconds,
            on_call=self.recorder.spawn_sender(prepared),
        )
        events = generation.events(incremental=incremental, stream_interval=self.stream_interval)
        try:
            async with contextlib.aclosing(events):
                async for out in events:
                    yield out
        except ProxyError as exc:
            self.recorder.server_error(prepared.session, exc)
            generation.take_waiting()
            if generation.decoding.detok.ids:
                # The worker failed mid-turn: what it sampled is kept as a truncated turn.
                self.recorder.cut(prepared, generation.decoding)
            self._settled(prepared)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            await self._abandoned(prepared, generation, whole=not incremental)
            raise
        finished = generation.finished
        assert finished is not None
        last, parsed = generation.decoding.finish()
        result = self.recorder.whole(prepared, generation.decoding, finished, parsed)
        await self.recorder.commit(prepared.session, result.node)
        self._settled(prepared)
        for out in last:
            yield out
        yield TurnDone(result)

    async def _abandoned(
        self, prepared: PreparedTurn, generation: Generation, *, whole: bool
    ) -> None:
        """The consumer stopped reading. A whole reply whose client stopped waiting (an
        SDK's timeout) is finished anyway, so the client's retry joins it or gets it from
        the record instead of starting over; anything else is cut where it is."""
        call = generation.call
        if whole and prepared.live is not None and not call.cancelled:
            prepared.detached = True
            task = asyncio.get_running_loop().create_task(self._finish_detached(generation))
            self._detached.add(task)
            task.add_done_callback(self._detached.discard)
            return
        await call.cancel()
        generation.take_waiting()
        self.recorder.cut(prepared, generation.decoding)
        self._settled(prepared)

    async def _finish_detached(self, generation: Generation) -> None:
        """Sample the rest of a non-streamed reply whose client left, and record it whole
        and undelivered (or cut, if the worker fails): a retry is answered with it."""
        prepared, recorder = generation.prepared, self.recorder
        try:
            await generation.rest(self.stream_interval)
            if generation.finished is None:
                generation.take_waiting()
                recorder.cut(prepared, generation.decoding)
                return
            _, parsed = generation.decoding.finish()
            result = recorder.whole(prepared, generation.decoding, generation.finished, parsed)
            if recorder.metrics is not None:
                recorder.metrics.undelivered_turns.labels(prepared.request.api).inc()
            recorder.commit_later(prepared.session, result.node)
        except asyncio.CancelledError:  # the proxy stops
            await generation.call.cancel()
            generation.take_waiting()
            recorder.cut(prepared, generation.decoding)
            raise
        except StorageError as exc:  # the store closed first: the proxy is stopping
            log.warning("a reply finished after its client left could not be saved: %s", exc)
        finally:
            self._settled(prepared, detached=True)

    def _settled(self, prepared: PreparedTurn, *, detached: bool = False) -> None:
        """The attempt is over (recorded, or ended without a turn): retries stop waiting,
        and what it held in the session for others (its streamed spawning calls, its
        sub-agent's call) is let go unless its turn recorded it."""
        if prepared.detached and not detached:
            return  # the background task that finishes it settles it
        session = prepared.session
        session.spawning.drop(prepared.sent_spawns)
        prepared.sent_spawns = []
        session.spawning.release(prepared.reserved, prepared.agent.id)
        prepared.reserved = None
        live, marks = prepared.live, prepared.request.marks
        if live is None:
            return
        prepared.live = None
        if marks is not None:
            key = (session.trial_id, marks.request_hash)
            if self._live.get(key) is live:
                del self._live[key]
        live.done.set()

    # ------------------------------------------------------------------ 3. delivery

    def settle_delivery(
        self, session: Session, nodes: Sequence[TurnNode], delivered: bool, *, replay: bool = False
    ) -> None:
        """After a reply's last write: ``delivered`` when its last byte was handed to the
        client. Recorded on each turn the reply carried."""
        self.recorder.settle_delivery(session, nodes, delivered, replay=replay)
