"""Workers as Ray actors, placed with the GPUs of a training job.

``WorkerActor`` runs one engine and one ``WorkerClient`` that dials OUT to the proxy, in the
actor's own event loop. ``WorkerActorGroup.start`` reserves one placement-group bundle per
actor (``gpus_per_worker`` GPUs and ``cpus_per_worker`` CPUs each; ``strategy`` ``PACK``
keeps them together, ``STRICT_SPREAD`` gives one per node) and starts the actors there.

Weight sync across the group, in process (the same phases a proxy drives over the relay,
``worker_client.policy``): ``update_weights(version, path, mode)`` pauses every actor (new
requests wait; running ones finish, or with ``mode="abort"`` stop and are continued by the
proxy on the new weights), has every actor read and check the checkpoint at ``path``, then
commits on all of them, or rolls all of them back if any could not pause or load. Every
proxy the actors serve is told the new version. For a trainer that updates the engines
itself (verl does), ``pause`` and ``resume(version)`` only hold the requests and stamp the
version.

No actor is left paused by a group call that fails: a pause that fails on some actors
resumes the others; a commit that fails on some actors leaves those serving their old
version (the engine resumes them) and the others the new one, and raises ``WeightsError``
naming them; each proxy then hears the new version from the actors that committed and
brings the others up to it (or takes them out of service), as for any worker behind.

An update belongs to the group, not to the caller awaiting it: it runs as a task of its
own, awaited through ``asyncio.shield``, so a trainer whose step is cancelled (a timeout,
a signal) does not stop it between pause and commit; it ends committed or rolled back,
and the rollback runs in a ``finally`` that cancellation cannot skip. The same update asked
again while it runs waits for it.

Ray is imported lazily: it is an optional dependency (``rollout-relay[ray]``). Ray's own
errors are translated to ``WorkerError`` subclasses here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from relay.protocol import PauseMode
from worker_client.client import ServedModel, WorkerClient
from worker_client.engine import Engine, LogprobsMode
from worker_client.exceptions import (
    EngineUnavailableError,
    WeightsBusyError,
    WeightsError,
    WorkerError,
)
from worker_client.policy import VersionedEngine


def load_engine(backend: str, model: str, **options: Any) -> Engine:
    """Build an engine by backend name (``hf``, ``vllm``, ``instant``, ``openai``)."""
    name = options.pop("name", None)
    if backend == "hf":
        from worker_client.backends.hf import HFEngine

        return HFEngine.load(model, name=name, **options)
    if backend == "vllm":
        from worker_client.backends.vllm import VLLMEngine

        return VLLMEngine.load(model, name=name, **options)
    if backend == "instant":
        from worker_client.backends.instant import InstantEngine

        return InstantEngine.load(model, name=name, **options)
    if backend == "openai":
        from worker_client.backends.openai import OpenAIEngine

        return OpenAIEngine.load(model, name=name, **options)
    raise EngineUnavailableError(f"unknown backend {backend!r}")


class WorkerActor:
    """One worker process (use through ``WorkerActorGroup`` or ``ray.remote``)."""

    def __init__(
        self,
        proxy_url: str,
        backend: str,
        model: str,
        *,
        tokenizer_dir: str | None = None,
        token: str = "",
        worker_id: str | None = None,
        max_concurrency: int = 8,
        version: int = 0,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        self.engine = VersionedEngine(
            load_engine(backend, model, **(engine_options or {})), version=version
        )
        self.client = WorkerClient(
            proxy_url,
            {self.engine.card.name: ServedModel(self.engine, Path(tokenizer_dir or model))},
            token=token,
            worker_id=worker_id,
            max_concurrency=max_concurrency,
        )
        self._task: asyncio.Task[None] | None = None
        self._update: str | None = None  # the update this actor was paused for

    async def start(self, within_seconds: float = 60.0) -> str:
        """Dial the proxy; return this worker's id once connected."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.client.run())
        # Polled: inside a Ray actor, a wait on the client's Event was seen to sleep through
        # the connection until its timeout.
        deadline = time.monotonic() + within_seconds
        while not self.client.connected.is_set():
            if self._task.done():
                self._task.result()  # the refusal or connection error
                raise WorkerError(
                    f"the worker stopped before connecting to {self.client.proxy_url}"
                )
            if time.monotonic() > deadline:
                raise WorkerError(f"not connected to {self.client.proxy_url} in {within_seconds}s")
            await asyncio.sleep(0.05)
        return self.client.worker_id

    async def pause(self, abort_in_flight: bool = False) -> None:
        """Hold new requests; return once none runs (an update's first phase)."""
        if self._update is not None:
            raise WeightsBusyError(f"this actor is paused for update {self._update} already")
        update = f"ray-{time.monotonic_ns()}"
        mode = PauseMode.ABORT if abort_in_flight else PauseMode.WAIT
        self._update = update
        try:
            await self.client.policy.pause(update, mode)
        except BaseException:
            # Refused (another update holds the worker) or rolled back meanwhile: this
            # actor has no update of its own to roll back.
            if self._update == update:
                self._update = None
            raise

    async def load(self, version: int, path: str | None = None) -> None:
        """Read and check the checkpoint (second phase); raises ``WeightsError``."""
        if self._update is None:
            raise WeightsError("load needs pause first")
        await self.client.policy.load(self._update, version, path)

    async def commit(self) -> int:
        """Serve what ``load`` read as its version; returns it."""
        if self._update is None:
            raise WeightsError("commit needs pause and load first")
        update, self._update = self._update, None
        return await self.client.policy.commit(update)

    async def rollback(self) -> None:
        if self._update is not None:
            update, self._update = self._update, None
            await self.client.policy.rollback(update)

    async def resume(self, version: int | None = None) -> int:
        """Serve again after ``pause``, stamped ``version`` (default: the next one); a
        version that cannot be stamped serves the old one again and raises."""
        target = self.client.policy.version + 1 if version is None else version
        if self._update is None:
            await self.pause()
        try:
            await self.load(target)
        except BaseException:
            await self.rollback()
            raise
        return await self.commit()

    async def status(self) -> dict[str, Any]:
        return {
            "worker_id": self.client.worker_id,
            "connected": self.client.connected.is_set(),
            "model": self.engine.card.name,
            "version": self.engine.version,
            "state": self.engine.state.value,
            "in_flight": self.engine.in_flight,
        }

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self.engine.close()


async def _each(ray: Any, refs: list[Any]) -> list[Any]:
    """Every ref's result, or the exception that stands in for it (its cause, for a Ray
    task error): ``ray.get`` of the list would raise at the first and hide the others."""

    def get_each() -> list[Any]:
        results: list[Any] = []
        for ref in refs:
            try:
                results.append(ray.get(ref))
            except Exception as exc:
                results.append(getattr(exc, "cause", None) or exc)
        return results

    return await asyncio.get_running_loop().run_in_executor(None, get_each)


def _failed(results: list[Any]) -> list[int]:
    return [i for i, r in enumerate(results) if isinstance(r, BaseException)]


T = TypeVar("T")


async def _to_the_end(step: Awaitable[T]) -> T:
    """Await ``step`` until it is done even if the caller is cancelled meanwhile (that
    cancellation is raised afterwards): a phase whose outcome decides the cleanup, or the
    cleanup itself, must not stop halfway."""
    task = asyncio.ensure_future(step)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


def _observed(task: asyncio.Task[int]) -> None:
    """Retrieve an update's error: its caller may have gone away before it ended."""
    if not task.cancelled():
        task.exception()


async def _get(ray: Any, refs: Any, within_seconds: float | None = None) -> Any:
    """Wait for Ray object refs without blocking the event loop (``ray.get`` in a thread:
    awaiting refs directly depends on which loop Ray's callbacks find)."""
    get = functools.partial(ray.get, refs, timeout=within_seconds)
    return await asyncio.get_running_loop().run_in_executor(None, get)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise EngineUnavailableError(
            f"Ray workers need the 'ray' package: pip install 'rollout-relay[ray]' ({exc})"
        ) from exc
    return ray


@dataclass(slots=True)
class WorkerActorGroup:
    actors: list[Any]  # Ray actor handles of WorkerActor
    worker_ids: list[str]
    placement_group: Any
    # The update running: (version, path) and its task.
    _running: tuple[tuple[int, str | None], asyncio.Task[int]] | None = field(
        default=None, repr=False
    )

    @classmethod
    async def start(
        cls,
        proxy_url: str,
        *,
        backend: str,
        model: str,
        num_workers: int = 1,
        gpus_per_worker: float = 1.0,
        cpus_per_worker: float = 1.0,
        strategy: str = "PACK",
        tokenizer_dir: str | None = None,
        token: str = "",
        max_concurrency: int = 8,
        version: int = 0,
        logprobs_mode: LogprobsMode | None = None,
        engine_options: dict[str, Any] | None = None,
        within_seconds: float = 300.0,
    ) -> WorkerActorGroup:
        """Reserve the bundles, start ``num_workers`` actors and wait until all connect.
        ``ray.init`` must have been called."""
        ray = _import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_workers < 1:
            raise ValueError("num_workers must be at least 1")
        bundle = {"CPU": cpus_per_worker, "GPU": gpus_per_worker}
        bundle = {k: v for k, v in bundle.items() if v > 0}
        group = ray.util.placement_group([dict(bundle) for _ in range(num_workers)], strategy)
        try:
            await _get(ray, group.ready(), within_seconds)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise EngineUnavailableError(
                f"Ray could not place {num_workers} x {bundle} ({strategy}) in {within_seconds}s"
            ) from None
        options = dict(engine_options or {})
        if logprobs_mode is not None:
            options["logprobs_mode"] = logprobs_mode
        remote = ray.remote(WorkerActor)
        actors = [
            remote.options(
                num_cpus=cpus_per_worker,
                num_gpus=gpus_per_worker,
                max_concurrency=max(max_concurrency, 1) + 4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i
                ),
            ).remote(
                proxy_url,
                backend,
                model,
                tokenizer_dir=tokenizer_dir,
                token=token,
                max_concurrency=max_concurrency,
                version=version,
                engine_options=options,
            )
            for i in range(num_workers)
        ]
        try:
            ids = await _get(ray, [a.start.remote(within_seconds) for a in actors])
        except Exception as exc:
            for actor in actors:
                ray.kill(actor)
            ray.util.remove_placement_group(group)
            raise WorkerError(f"Ray worker actors did not start: {exc}") from exc
        return cls(actors, list(ids), group)

    async def pause(self, *, abort_in_flight: bool = False) -> None:
        """Pause every worker; returns once none of them runs a request. When an actor
        cannot pause (another update holds it), the others serve again and
        ``WeightsError`` names it."""
        ray = _import_ray()
        results = await _each(ray, [a.pause.remote(abort_in_flight) for a in self.actors])
        failed = _failed(results)
        if failed:
            # Only the pauses this call made: an actor that refused is held by another
            # update, which is not this call's to end.
            paused = [a for i, a in enumerate(self.actors) if i not in failed]
            await _each(ray, [a.rollback.remote() for a in paused])
            raise WeightsError(
                f"{self._names(failed)} could not pause: {results[failed[0]]}; every actor "
                "serves as before"
            )

    async def resume(self, version: int) -> None:
        """Serve again after ``pause``, as ``version``; raises ``WeightsError`` naming the
        actors that could not (they serve their old version, none stays paused)."""
        ray = _import_ray()
        results = await _each(ray, [a.resume.remote(version) for a in self.actors])
        failed = _failed(results)
        if failed:
            raise WeightsError(
                f"{self._names(failed)} could not resume as version {version}: {results[failed[0]]}"
            )

    async def update_weights(
        self, version: int, path: str | None = None, mode: str = "wait"
    ) -> int:
        """Every actor serves ``version``, loaded from ``path`` (None: stamped only), or
        ``WeightsError`` is raised: a checkpoint any actor cannot load (or an actor that
        cannot pause) rolls every actor back; a commit that fails on some actors leaves
        them on their old version and the others on ``version`` (see the module
        docstring). No actor is left paused, also when the caller is cancelled: the update
        runs on to its end, and the same update asked again waits for it."""
        pause_mode = PauseMode(mode)
        running = self._running
        if running is not None and not running[1].done() and running[0] == (version, path):
            return await asyncio.shield(running[1])
        task = asyncio.get_running_loop().create_task(self._update(version, path, pause_mode))
        task.add_done_callback(_observed)
        self._running = ((version, path), task)
        return await asyncio.shield(task)

    async def _update(self, version: int, path: str | None, mode: PauseMode) -> int:
        """The update's task: pause, load, then commit or roll back."""
        ray = _import_ray()
        pausing = asyncio.ensure_future(self.pause(abort_in_flight=mode is PauseMode.ABORT))
        committing = False
        try:
            # A pause that fails resumed what it paused; one stopped halfway is let finish,
            # so that what it paused is rolled back below.
            await _to_the_end(pausing)
            results = await _each(ray, [a.load.remote(version, path) for a in self.actors])
            failed = _failed(results)
            if failed:
                raise WeightsError(
                    f"weights version {version} did not load: {results[failed[0]]} "
                    f"({self._names(failed)}); every actor serves the version before"
                )
            committing = True  # from here on each actor's weights depend on its commit
            results = await _to_the_end(_each(ray, [a.commit.remote() for a in self.actors]))
        finally:
            paused = pausing.done() and not pausing.cancelled() and pausing.exception() is None
            if paused and not committing:
                await _to_the_end(_each(ray, [a.rollback.remote() for a in self.actors]))
        failed = _failed(results)
        if failed:
            raise WeightsError(
                f"weights version {version} did not commit on {self._names(failed)}: "
                f"{results[failed[0]]}; they serve their version before, "
                f"{len(self.actors) - len(failed)} of {len(self.actors)} serve {version}"
            )
        return version

    def _names(self, indexes: list[int]) -> str:
        ids = [self.worker_ids[i] if i < len(self.worker_ids) else f"#{i}" for i in indexes]
        return ("actor " if len(ids) == 1 else "actors ") + ", ".join(ids)

    async def weights(self) -> dict[str, Any]:
        """The version each actor serves."""
        states = await self.status()
        return {
            "version": min(s["version"] for s in states),
            "workers": [{"worker_id": s["worker_id"], "version": s["version"]} for s in states],
        }

    async def status(self) -> list[dict[str, Any]]:
        return list(await _get(_import_ray(), [a.status.remote() for a in self.actors]))

    async def stop(self) -> None:
        ray = _import_ray()
        with contextlib.suppress(Exception):
            await _get(ray, [a.stop.remote() for a in self.actors])
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement_group)
        self.actors = []
