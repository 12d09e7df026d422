"""Weight updates across the pool's workers, all or nothing.

A trainer that took an optimizer step writes a checkpoint and asks the proxy to serve it
as the next policy version. ``WeightSync.update`` drives every connected worker through
the protocol's three phases (``relay.protocol``: ``Pause``, ``Load``, then ``Commit`` or
``Rollback``); only these control messages travel, the weights are read by each worker
from the path. The update's own state (``UpdateState``) makes "all or nothing" a property
of the state machine, not of timing::

    PAUSING --every worker paused--> LOADING --every worker loaded--> COMMITTING --> COMMITTED
       |                                |
       +--a worker failed or timed out--+--> ROLLING_BACK --> ROLLED_BACK

While it runs the pool is held: new requests wait in its queue, never refused. ``wait``
lets running requests finish on the old weights first (no reply spans two versions);
``abort`` stops them, and the pool continues each from its tokens once the new weights
serve (one reply, two versions). A worker that leaves during an update is no longer part
of it (it rolls back on its side when its connection ends); when it comes back, or when
any worker joins behind the pool's version, it loads the current weights before it serves
anything (``WeightSync`` is the pool's ``on_behind``). A worker that cannot commit, or
cannot be brought up to the current version, is taken out of service: never left serving
other weights under the new version number.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relay import protocol
from relay.exceptions import (
    RelayError,
    UpdateFailedError,
    UpdateRefusedError,
    WorkerFailedError,
)
from relay.pool import WorkerHandle, WorkerPool, WorkerState

log = logging.getLogger(__name__)


class UpdateState(enum.Enum):
    PAUSING = "pausing"
    LOADING = "loading"
    COMMITTING = "committing"
    ROLLING_BACK = "rolling_back"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"


_ALLOWED = {
    UpdateState.PAUSING: {UpdateState.LOADING, UpdateState.ROLLING_BACK},
    UpdateState.LOADING: {UpdateState.COMMITTING, UpdateState.ROLLING_BACK},
    UpdateState.COMMITTING: {UpdateState.COMMITTED},
    UpdateState.ROLLING_BACK: {UpdateState.ROLLED_BACK},
    UpdateState.COMMITTED: set(),
    UpdateState.ROLLED_BACK: set(),
}


@dataclass(slots=True)
class WeightsUpdate:
    update_id: str
    version: int
    path: str | None
    mode: protocol.PauseMode
    state: UpdateState = UpdateState.PAUSING

    def __repr__(self) -> str:
        return f"<WeightsUpdate {self.update_id} v{self.version} {self.state.value}>"

    def advance(self, state: UpdateState) -> None:
        if state not in _ALLOWED[self.state]:
            raise RelayError(f"update {self.update_id} is {self.state.value}; cannot be {state}")
        self.state = state


def check_request(current: int, version: int, updating: WeightsUpdate | None) -> None:
    """Refuse an update before anything is asked of a worker."""
    if updating is not None:
        raise UpdateRefusedError(
            "update_in_progress",
            f"weights version {updating.version} is being loaded; try again when it is done",
        )
    if version <= current:
        raise UpdateRefusedError(
            "version_not_newer",
            f"version {version} is not newer than the current version {current}",
        )


# What a phase's answers were: per worker, its ack, or the error that stood in for it.
Answers = dict[str, protocol.UpdateAck | RelayError]


class WeightSync:
    """Drives weight updates through one pool (see the module docstring)."""

    def __init__(self, pool: WorkerPool, *, phase_seconds: float = 600.0) -> None:
        self.pool = pool
        self.phase_seconds = phase_seconds
        self.current: WeightsUpdate | None = None
        self._lock = asyncio.Lock()  # one update, or one worker's catching up, at a time
        self._background: set[asyncio.Task[None]] = set()
        pool.on_behind = self._behind

    def __repr__(self) -> str:
        return f"<WeightSync v{self.pool.version} {self.current!r}>"

    # ------------------------------------------------------------------ reading

    def report(self) -> dict[str, Any]:
        """The version served, each worker's, and the update running (if any)."""
        return {
            "version": self.pool.version,
            "path": self.pool.weights_path,
            "updating": None
            if self.current is None
            else {"version": self.current.version, "state": self.current.state.value},
            "workers": [
                {
                    "worker_id": h.worker_id,
                    "version": h.version,
                    "state": h.state.value,
                    "path": h.weights_path,
                }
                for h in sorted(self.pool.workers.values(), key=lambda h: h.worker_id)
            ],
        }

    # ------------------------------------------------------------------ an update

    async def update(
        self,
        version: int,
        path: str | None = None,
        mode: protocol.PauseMode = protocol.PauseMode.WAIT,
    ) -> dict[str, Any]:
        """Every connected worker serves ``version`` (loaded from ``path``) when this
        returns; on any error every worker still serves what it served before."""
        check_request(self.pool.version, version, self.current)
        old = [h for h in self.pool.workers.values() if not h.endpoint.can_update]
        if old:
            raise UpdateRefusedError(
                "worker_cannot_update",
                f"worker {old[0].worker_id} speaks protocol {old[0].endpoint.version}, "
                f"weight updates need {protocol.WEIGHTS_VERSION}",
            )
        update = WeightsUpdate(f"wu-{secrets.token_hex(6)}", version, path, mode)
        self.current = update
        self.pool.hold()
        try:
            async with self._lock:
                await self._run(update)
        finally:
            self.current = None
            self.pool.release()
        return self.report()

    async def _run(self, update: WeightsUpdate) -> None:
        handles = [h for h in self.pool.workers.values() if h.state is WorkerState.SERVING]
        for handle in handles:
            handle.state = WorkerState.UPDATING
        log.info(
            "weight update %s: version %d from %s on %d workers (%s)",
            update.update_id,
            update.version,
            update.path or "no checkpoint",
            len(handles),
            update.mode.value,
        )
        try:
            answers = await self._phase(
                handles, protocol.Pause(update.update_id, update.mode), protocol.UpdatePhase.PAUSED
            )
            failed = _failures(answers)
            if not failed:
                update.advance(UpdateState.LOADING)
                load = protocol.Load(update.update_id, update.version, update.path)
                answers = await self._phase(handles, load, protocol.UpdatePhase.LOADED)
                failed = _failures(answers)
            if failed:
                update.advance(UpdateState.ROLLING_BACK)
                await self._phase(
                    handles, protocol.Rollback(update.update_id), protocol.UpdatePhase.ROLLED_BACK
                )
                update.advance(UpdateState.ROLLED_BACK)
                self.pool.stats.updates_rolled_back += 1
                # A worker that said no explains more than one that did not answer.
                refused = [w for w in failed if isinstance(answers[w], protocol.UpdateAck)]
                worker = refused[0] if refused else next(iter(failed))
                raise UpdateFailedError(
                    "weights_load_failed" if refused else "update_timeout",
                    f"worker {worker} could not load weights version {update.version}: "
                    f"{failed[worker]} (every worker still serves the previous version)",
                )
            update.advance(UpdateState.COMMITTING)
            answers = await self._phase(
                handles, protocol.Commit(update.update_id), protocol.UpdatePhase.COMMITTED
            )
            # A stamp-only update keeps the weights, and so the checkpoint they came from.
            path = update.path or self.pool.weights_path
            self.pool.version, self.pool.weights_path = update.version, path
            update.advance(UpdateState.COMMITTED)
            self.pool.stats.updates_committed += 1
            for handle in handles:
                answer = answers.get(handle.worker_id)
                if isinstance(answer, protocol.UpdateAck) and answer.ok:
                    handle.version = update.version
                    handle.weights_path = update.path or handle.weights_path
                elif answer is not None:  # it did not commit: its weights are unknown
                    await self._out_of_service(handle, _reason(answer))
            log.info("weight update %s: version %d serves", update.update_id, update.version)
        finally:
            for handle in handles:
                if handle.state is WorkerState.UPDATING:
                    self.pool.serve(handle)

    async def _phase(
        self,
        handles: Sequence[WorkerHandle],
        message: protocol.UpdateMessage,
        phase: protocol.UpdatePhase,
    ) -> Answers:
        """Send one phase to every worker still connected and wait for their answers.
        A worker that left is dropped from the answers (it rolls back by itself)."""
        waits: dict[str, asyncio.Future[protocol.UpdateAck]] = {}
        loop = asyncio.get_running_loop()
        for handle in handles:
            if self.pool.workers.get(handle.worker_id) is not handle:
                continue  # it left
            ack: asyncio.Future[protocol.UpdateAck] = loop.create_future()
            handle.acks[(message.update_id, phase)] = ack
            try:
                await handle.link.send(handle.endpoint.update(message))
            except (ConnectionError, RuntimeError, RelayError) as exc:
                handle.acks.pop((message.update_id, phase), None)
                log.warning("weight update: worker %s unreachable: %s", handle.worker_id, exc)
                continue
            waits[handle.worker_id] = ack
        answers: Answers = {}
        if waits:
            await asyncio.wait(waits.values(), timeout=self.phase_seconds)
        for handle in handles:  # an answer after the deadline is not awaited any more
            handle.acks.pop((message.update_id, phase), None)
        for worker_id, ack in waits.items():
            if not ack.done():
                ack.cancel()
                answers[worker_id] = UpdateFailedError(
                    "update_timeout", f"no answer to {phase.value} in {self.phase_seconds:g}s"
                )
            elif isinstance(ack.exception(), WorkerFailedError):
                continue  # it left during the phase
            else:
                answers[worker_id] = ack.result()
        return answers

    async def _out_of_service(self, handle: WorkerHandle, reason: str) -> None:
        log.error("worker %s taken out of service: %s", handle.worker_id, reason)
        self.pool.stats.out_of_service += 1
        handle.state = WorkerState.OUT_OF_SERVICE
        with contextlib.suppress(ConnectionError, RuntimeError):
            await handle.link.close(f"out of service: {reason}")
        await self.pool.remove_worker(handle, f"out of service: {reason}")

    # ------------------------------------------------------------------ catching up

    def _behind(self, handle: WorkerHandle) -> None:
        task = asyncio.get_running_loop().create_task(self._catch_up(handle))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _catch_up(self, handle: WorkerHandle) -> None:
        """Bring a worker that joined (or fell) behind to the pool's version before it
        serves anything."""
        async with self._lock:
            if self.pool.workers.get(handle.worker_id) is not handle:
                return
            target, path = self.pool.version, self.pool.weights_path
            if handle.version >= target:
                self.pool.serve(handle)
                return
            if not handle.endpoint.can_update:
                await self._out_of_service(
                    handle, f"it serves version {handle.version} and cannot load {target}"
                )
                return
            update_id = f"wu-{secrets.token_hex(6)}"
            steps: list[tuple[protocol.UpdateMessage, protocol.UpdatePhase]] = [
                (protocol.Pause(update_id), protocol.UpdatePhase.PAUSED),
                (protocol.Load(update_id, target, path), protocol.UpdatePhase.LOADED),
                (protocol.Commit(update_id), protocol.UpdatePhase.COMMITTED),
            ]
            for i, (message, phase) in enumerate(steps):
                answer = (await self._phase([handle], message, phase)).get(handle.worker_id)
                if answer is None:
                    return  # it left
                if isinstance(answer, protocol.UpdateAck) and answer.ok:
                    continue
                if i == 0 and await self._reaches(handle, target):
                    # Paused by another replica's update of the same weights.
                    self.pool.serve(handle)
                    return
                if i == 1:
                    rollback = protocol.Rollback(update_id)
                    await self._phase([handle], rollback, protocol.UpdatePhase.ROLLED_BACK)
                await self._out_of_service(
                    handle, f"could not load weights version {target}: {_reason(answer)}"
                )
                return
            handle.version, handle.weights_path = target, path or handle.weights_path
            log.info("worker %s caught up to weights version %d", handle.worker_id, target)
            self.pool.serve(handle)

    async def _reaches(self, handle: WorkerHandle, version: int) -> bool:
        """Whether the worker reports ``version`` (or newer) within a phase's time."""
        deadline = asyncio.get_running_loop().time() + self.phase_seconds
        while handle.version < version:
            if self.pool.workers.get(handle.worker_id) is not handle:
                return False
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def _failures(answers: Answers) -> dict[str, str]:
    return {
        worker_id: _reason(answer)
        for worker_id, answer in answers.items()
        if not (isinstance(answer, protocol.UpdateAck) and answer.ok)
    }


def _reason(answer: protocol.UpdateAck | RelayError) -> str:
    if isinstance(answer, protocol.UpdateAck):
        return answer.message or f"{answer.phase.value} failed"
    return str(answer)
