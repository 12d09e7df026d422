"""Policy versions and weight updates on the worker side.

``VersionedEngine`` wraps any ``Engine`` (``ServedModel`` does it for every served model):

* ``pause(abort_in_flight=...)``: requests that arrive from now on wait (they are not
  refused, so agents see only a slower reply); requests already running finish, or with
  ``abort_in_flight=True`` are aborted: they end with ``FinishReason.ABORT`` and
  ``extra["preempted"]``, and the proxy continues each from its tokens on the new weights.
  ``pause`` returns once nothing runs: the engine is idle and its weights can be replaced.
* ``load(path)`` reads and checks a checkpoint without serving it (engines that can load
  weights implement ``WeightLoader``), ``commit(version)`` serves it as ``version``,
  ``rollback()`` drops it and serves the old weights again.

Every reply's last chunk carries the version that sampled it, as
``extra["policy_version"]`` (a backend that knows the version itself, the ``verl`` backend
with verl's ``global_steps``, sets it first and is not overridden).

``WorkerPolicy`` is one worker process's weights, shared by every connection (every proxy
replica) and every served model. A proxy drives an update through it in three phases
(``relay.protocol``: ``Pause``, ``Load``, ``Commit`` or ``Rollback``), one update at a time:

    IDLE --pause--> PAUSED --load--> LOADED --commit--> IDLE (new version)
                       \\               \\--rollback--> IDLE (old version)
                        \\--rollback------------------> IDLE (old version)

A connection that drops in the middle of its update rolls it back, so a proxy that dies
never leaves the worker paused. ``update`` runs the three phases at once (Ray actors,
tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol, runtime_checkable

from relay.protocol import POLICY_VERSION, PREEMPTED, PauseMode
from worker_client.engine import (
    Engine,
    FinishReason,
    ImageSpan,
    ModelCard,
    PromptScorer,
    SamplingParams,
    TokenChunk,
    refuse_routing,
)
from worker_client.exceptions import EngineError, WeightsBusyError, WeightsError

log = logging.getLogger(__name__)

__all__ = [
    "POLICY_VERSION",
    "PolicyState",
    "StagedPath",
    "UpdateState",
    "VersionedEngine",
    "WeightLoader",
    "WorkerPolicy",
]


@runtime_checkable
class WeightLoader(Protocol):
    """An engine that can replace its weights in place, in two steps so that a set of
    workers can load all or nothing: ``stage_weights`` reads and checks a checkpoint
    without serving it (it raises on anything wrong and then changes nothing),
    ``commit_weights`` swaps it in as ``version`` (called only on an idle engine),
    ``discard_weights`` forgets a staged checkpoint."""

    async def stage_weights(self, path: str) -> None: ...

    async def commit_weights(self, version: int) -> None: ...

    async def discard_weights(self) -> None: ...


class StagedPath:
    """For engines whose server reads the checkpoint itself when the update commits
    (vLLM's reload, an upstream's update route): staging keeps the checked path, commit
    takes it, discarding forgets it."""

    _staged: str | None = None

    def _take_staged(self) -> str:
        path, self._staged = self._staged, None
        if path is None:
            raise WeightsError("no checkpoint was staged")
        return path

    async def discard_weights(self) -> None:
        self._staged = None


class PolicyState(enum.Enum):
    SERVING = "serving"
    PAUSING = "pausing"  # new requests wait; running ones are finishing or aborting
    PAUSED = "paused"  # nothing runs: weights may be swapped


class VersionedEngine:
    def __init__(self, engine: Engine, *, version: int = 0) -> None:
        self.engine = engine
        self.version = version
        self.state = PolicyState.SERVING
        self._changed = asyncio.Condition()
        self._running: set[str] = set()
        self._preempted: set[str] = set()
        self._staged = False

    def __repr__(self) -> str:
        return (
            f"<VersionedEngine {self.card.name} v{self.version} {self.state.value} "
            f"running={len(self._running)}>"
        )

    @property
    def card(self) -> ModelCard:
        return self.engine.card

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        # Refused before it waits: a model without routing cannot answer it on any weights.
        refuse_routing(self.card, routed_experts_from)
        async with self._changed:
            await self._changed.wait_for(lambda: self.state is PolicyState.SERVING)
            self._running.add(request_id)
            version = self.version
        # aclosing: when this stream is closed, the engine's is closed now too (an engine may
        # hold a lock or a slot across its yields), not later by the garbage collector.
        # Only a request with images passes them, and only one asking for routing asks it:
        # an engine of text alone need not know either.
        if routed_experts_from is not None:
            stream = self.engine.generate(
                request_id, prompt_ids, sampling, images, routed_experts_from=routed_experts_from
            )
        elif images:
            stream = self.engine.generate(request_id, prompt_ids, sampling, images)
        else:
            stream = self.engine.generate(request_id, prompt_ids, sampling)
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if chunk.finish_reason is not None:
                        chunk.extra.setdefault(POLICY_VERSION, version)
                        if chunk.finish_reason is FinishReason.ABORT and (
                            request_id in self._preempted
                        ):
                            chunk.extra[PREEMPTED] = 1
                    yield chunk
        finally:
            async with self._changed:
                self._running.discard(request_id)
                self._preempted.discard(request_id)
                self._changed.notify_all()

    async def prompt_logprobs(
        self,
        request_id: str,
        ids: Sequence[int],
        start: int,
        images: Sequence[ImageSpan] = (),
    ) -> list[float]:
        """Teacher forcing (``PromptScorer``) on the engine's weights: it waits out a
        pause, as a generation does, and a pause waits for it."""
        engine = self.engine
        if not isinstance(engine, PromptScorer):
            raise EngineError(f"model {self.card.name} ({self.card.backend} backend) cannot score")
        async with self._changed:
            await self._changed.wait_for(lambda: self.state is PolicyState.SERVING)
            self._running.add(request_id)
        try:
            return await engine.prompt_logprobs(request_id, ids, start, images)
        finally:
            async with self._changed:
                self._running.discard(request_id)
                self._changed.notify_all()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def close(self) -> None:
        await self.engine.close()

    async def pause(self, *, abort_in_flight: bool = False) -> None:
        """Stop starting requests and return once none runs (see the module docstring)."""
        async with self._changed:
            if self.state is PolicyState.SERVING:
                self.state = PolicyState.PAUSING
            running = list(self._running)
            if abort_in_flight:
                self._preempted.update(running)
        if abort_in_flight:
            for request_id in running:
                await self.engine.abort(request_id)
        async with self._changed:
            # A resume while running requests drain (the update was rolled back) ends the
            # pause: the engine serves on rather than staying paused for nobody.
            await self._changed.wait_for(
                lambda: not self._running or self.state is PolicyState.SERVING
            )
            if self.state is PolicyState.PAUSING:
                self.state = PolicyState.PAUSED

    async def load(self, path: str | None) -> None:
        """Read and check the checkpoint at ``path`` (None: nothing to load)."""
        if path is None:
            return
        if not isinstance(self.engine, WeightLoader):
            raise WeightsError(f"the {self.card.backend} backend cannot load weights")
        await self.engine.stage_weights(path)
        self._staged = True

    async def commit(self, version: int) -> None:
        """Serve what ``load`` read (if anything) as ``version``. An engine that cannot
        swap the weights in serves again on its old version number (never left paused)
        and the error is raised: the caller reports it, and the proxy takes the worker
        out of service."""
        if self._staged:
            assert isinstance(self.engine, WeightLoader)
            self._staged = False
            try:
                await self.engine.commit_weights(version)
            except BaseException:
                await self.resume(self.version)
                raise
        await self.resume(version)

    async def rollback(self) -> None:
        """Forget what ``load`` read and serve the old weights again."""
        if self._staged:
            assert isinstance(self.engine, WeightLoader)
            self._staged = False
            await self.engine.discard_weights()
        await self.resume(self.version)

    async def resume(self, version: int | None = None) -> int:
        """Serve again, on ``version`` (default: the current one plus one). Returns it."""
        async with self._changed:
            self.version = self.version + 1 if version is None else version
            self.state = PolicyState.SERVING
            self._changed.notify_all()
            return self.version


class UpdateState(enum.Enum):
    IDLE = "idle"
    PAUSED = "paused"
    LOADED = "loaded"


# Told of every new version this worker serves: (version, checkpoint path).
VersionListener = Callable[[int, str | None], None]


class WorkerPolicy:
    """The weights of one worker process (see the module docstring)."""

    def __init__(self, engines: Sequence[VersionedEngine], *, path: str | None = None) -> None:
        if not engines:
            raise ValueError("a worker policy needs at least one engine")
        self.engines = list(engines)
        self.path = path  # the checkpoint the engines serve (None: the startup model, or stamped)
        self.state = UpdateState.IDLE
        self.update_id: str | None = None
        self._pending: tuple[int, str | None] | None = None
        self._listeners: list[VersionListener] = []
        self._lock = asyncio.Lock()  # one phase at a time

    def __repr__(self) -> str:
        return f"<WorkerPolicy v{self.version} {self.state.value} update={self.update_id}>"

    @property
    def version(self) -> int:
        return self.engines[0].version

    def listen(self, listener: VersionListener) -> Callable[[], None]:
        """Call ``listener`` on every new version; returns what stops it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _require(self, update_id: str, *states: UpdateState) -> None:
        if self.update_id != update_id:
            raise WeightsError(
                f"update {update_id!r} is not the one in progress ({self.update_id!r})"
            )
        if self.state not in states:
            raise WeightsError(f"update {update_id!r} is {self.state.value}")

    async def pause(self, update_id: str, mode: PauseMode) -> None:
        """Phase 1: hold new requests; return once none runs on any engine."""
        async with self._lock:
            if self.state is not UpdateState.IDLE:
                raise WeightsBusyError(f"another weight update ({self.update_id}) is in progress")
            self.update_id = update_id
            self.state = UpdateState.PAUSED
        abort = mode is PauseMode.ABORT
        await asyncio.gather(*(e.pause(abort_in_flight=abort) for e in self.engines))
        if self.update_id != update_id:
            raise WeightsError(f"update {update_id!r} was rolled back while pausing")

    async def load(self, update_id: str, version: int, path: str | None) -> None:
        """Phase 2: read and check ``path`` on every engine; nothing is served from it yet.
        On failure the update stays paused, to be rolled back."""
        async with self._lock:
            self._require(update_id, UpdateState.PAUSED)
            if version <= self.version:
                raise WeightsError(f"version {version} is not newer than {self.version}")
            if path is not None and len(self.engines) > 1:
                raise WeightsError(
                    f"this worker serves {len(self.engines)} models; one checkpoint cannot "
                    "replace them all"
                )
            for engine in self.engines:
                await engine.load(path)
            self._pending = (version, path)
            self.state = UpdateState.LOADED

    async def commit(self, update_id: str) -> int:
        """Phase 3: serve the loaded weights as the new version; returns it. An engine
        that cannot commit raises ``WeightsError``; every engine serves again (those not
        committed on the old version) and the update is over either way."""
        async with self._lock:
            self._require(update_id, UpdateState.LOADED)
            assert self._pending is not None
            version, path = self._pending
            failure: Exception | None = None
            try:
                for engine in self.engines:
                    if failure is not None:
                        await engine.rollback()
                        continue
                    try:
                        await engine.commit(version)
                    except Exception as exc:
                        failure = exc
            finally:
                self._finish()
            if failure is not None:
                log.error("weights version %d did not commit: %s", version, failure)
                raise WeightsError(
                    f"weights version {version} did not commit: "
                    f"{type(failure).__name__}: {failure}; serving version {self.version}"
                ) from failure
            # Stamped without a checkpoint: no checkpoint is known to hold this version's
            # weights (the trainer may have changed them in place), so none is reported:
            # a proxy that hears of the version from this worker (restarted, or another
            # replica) must not load the old checkpoint into a late worker under it.
            self.path = path
        log.info("serving weights version %d (%s)", version, path or "no checkpoint")
        for listener in list(self._listeners):
            listener(version, self.path)
        return version

    async def rollback(self, update_id: str) -> None:
        """Drop the update: the old weights serve again, as the old version."""
        async with self._lock:
            if self.update_id != update_id or self.state is UpdateState.IDLE:
                return  # nothing of this update is left: rolling back is idempotent
            try:
                for engine in self.engines:
                    await engine.rollback()
            finally:
                self._finish()
        log.info("weight update %s rolled back; serving version %d", update_id, self.version)

    def _finish(self) -> None:
        self.state = UpdateState.IDLE
        self.update_id = None
        self._pending = None

    async def update(
        self, version: int, path: str | None = None, mode: PauseMode = PauseMode.WAIT
    ) -> int:
        """All three phases in this process (rolled back if loading fails)."""
        update_id = f"local-{version}"
        await self.pause(update_id, mode)
        try:
            await self.load(update_id, version, path)
        except BaseException:
            await self.rollback(update_id)
            raise
        return await self.commit(update_id)
