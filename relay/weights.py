"""Weight updates across the pool's workers, all or nothing.

A trainer that took an optimizer step writes a checkpoint and asks the proxy to serve it
as the next policy version. ``WeightSync.update`` drives every connected worker through
the protocol's three phases (``relay.protocol``: ``Pause``, ``Load``, then ``Commit`` or
``Rollback``); only these control messages travel, the weights are read by each worker
from the path. The update's own state (``UpdateState``) makes "all or nothing" a property
of the state machine, not of timing::

    PAUSING --every worker paused--> LOADING --every worker loaded--> COMMITTING --> COMMITTED
       |                                |                                  |
       +--a worker failed, timed out,---+--> ROLLING_BACK --> ROLLED_BACK  +--no worker
          or the update was stopped                                           committed-->
                                                                              COMMIT_FAILED

The update belongs to the proxy, not to the request that asked for it: it runs as a task
of its own, which the caller awaits through ``asyncio.shield``, so a trainer that hangs up
(its timeout, a load balancer closing the connection) cannot stop it between phases. It
ends committed or rolled back whoever waits for it, and its cleanup (the rollback, workers
serving again) runs where cancellation cannot skip it. The same update asked again
(version and path; ``admit``) waits for the running one, or gets the answer of the last
finished one, so a trainer may retry a dropped request safely; one asking for exactly the
version and checkpoint the pool serves (it committed before the proxy restarted, or through
another replica) is answered as a success. At most
``3 * phase_seconds`` pass once the update runs (pause, load, then commit or rollback,
each bounded), after any catching up of joining workers that was running when it came.

An update answers only when every worker it started with serves the new version. A worker
that cannot commit has unknown weights: it is taken out of service, and the update fails
with ``commit_failed`` naming it; the others serve the new version, which is the pool's
only when at least one worker (or none at all, with none failing) committed it. The
pool's version never moves backwards: one adopted from another replica meanwhile stays.

While it runs the pool is held: new requests wait in its queue, never refused. ``wait``
lets running requests finish on the old weights first (no reply spans two versions);
``abort`` stops them, and the pool continues each from its tokens once the new weights
serve (one reply, two versions). A worker that leaves during an update is no longer part
of it (it rolls back on its side when its connection ends); when it comes back, or when
any worker joins behind the pool's version, it loads the current weights before it serves
anything (``WeightSync`` is the pool's ``on_behind``). A version stamped without a
checkpoint cannot be loaded: a worker behind it waits, serving nothing, until it reports
that version itself (the trainer syncs its engines). A worker that cannot be brought up
to the current version, or does not answer a rollback, is taken out of service: never
left serving other weights under the new version number, nor paused. A worker that
serves only teachers (``relay.pool.serves_policy``) is no part of any update: its weights
are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from relay import protocol
from relay.exceptions import (
    RelayError,
    UpdateFailedError,
    UpdateRefusedError,
    WeightsUpdateError,
    WorkerFailedError,
)
from relay.pool import WorkerHandle, WorkerPool, WorkerState, serves_policy

log = logging.getLogger(__name__)


class UpdateState(enum.Enum):
    PAUSING = "pausing"
    LOADING = "loading"
    COMMITTING = "committing"
    ROLLING_BACK = "rolling_back"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    COMMIT_FAILED = "commit_failed"  # no worker committed: the version did not move


_ALLOWED = {
    UpdateState.PAUSING: {UpdateState.LOADING, UpdateState.ROLLING_BACK},
    UpdateState.LOADING: {UpdateState.COMMITTING, UpdateState.ROLLING_BACK},
    UpdateState.COMMITTING: {UpdateState.COMMITTED, UpdateState.COMMIT_FAILED},
    UpdateState.ROLLING_BACK: {UpdateState.ROLLED_BACK},
    UpdateState.COMMITTED: set(),
    UpdateState.ROLLED_BACK: set(),
    UpdateState.COMMIT_FAILED: set(),
}

# What makes two requests the same update: the version and the checkpoint it serves. The
# pause mode is not part of it (it only says how replies running at the time are treated),
# so a retry that asks another mode still gets the update's outcome.
UpdateKey = tuple[int, str | None]


@dataclass(slots=True)
class WeightsUpdate:
    update_id: str
    version: int
    path: str | None
    mode: protocol.PauseMode
    state: UpdateState = UpdateState.PAUSING

    def __repr__(self) -> str:
        return f"<WeightsUpdate {self.update_id} v{self.version} {self.state.value}>"

    @property
    def key(self) -> UpdateKey:
        return (self.version, self.path)

    def advance(self, state: UpdateState) -> None:
        if state not in _ALLOWED[self.state]:
            raise RelayError(f"update {self.update_id} is {self.state.value}; cannot be {state}")
        self.state = state


class Admission(enum.Enum):
    START = "start"  # a new update: run it
    JOIN = "join"  # the same update runs: wait for its outcome
    REPLAY = "replay"  # the same update finished last: answer its outcome again
    SERVED = "served"  # what it asks is served already: answer as a success


def admit(
    served: UpdateKey, asked: UpdateKey, running: UpdateKey | None, last: UpdateKey | None
) -> Admission:
    """What to do with an update request, before anything is asked of a worker: join or
    replay the same update (a trainer's retry), or refuse a version that is not newer and
    a second update while one runs (retryable: it may start once that one is done).

    ``served`` is the pool's version and the checkpoint that holds it (None: stamped
    without one). Asking for exactly that is a retry of an update that committed but
    whose answer was lost, here before this proxy restarted or through another replica
    (the workers brought the version here): it succeeds, as its first answer would have.
    """
    if running == asked:
        return Admission.JOIN
    if last == asked:
        return Admission.REPLAY
    if served == asked:
        return Admission.SERVED
    if running is not None:
        raise UpdateRefusedError(
            "update_in_progress",
            f"weights version {running[0]} is being loaded; try again when it is done",
            retryable=True,
        )
    current = served[0]
    if asked[0] <= current:
        raise UpdateRefusedError(
            "version_not_newer",
            f"version {asked[0]} is not newer than the current version {current}",
        )
    return Admission.START


@dataclass(slots=True, frozen=True)
class Outcome:
    """How a finished update ended: the report it answered, or its error."""

    key: UpdateKey
    report: dict[str, Any] | None
    error: WeightsUpdateError | None

    def answer(self) -> dict[str, Any]:
        """The answer again: the same report, or an equal error (a new exception object:
        one raised twice would carry both tracebacks)."""
        if self.error is not None:
            e = self.error
            raise type(e)(e.code, e.message, workers=e.workers, retryable=e.retryable)
        assert self.report is not None
        return self.report


# What a phase's answers were: per worker, its ack, or the error that stood in for it.
Answers = dict[str, protocol.UpdateAck | RelayError]

T = TypeVar("T")


async def finish_anyway(step: Awaitable[T]) -> T:
    """Run ``step`` to its end even if the caller is cancelled meanwhile (the cancellation
    is raised once it is done): cleanup that must not stop halfway."""
    task = asyncio.ensure_future(step)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise
            if not task.done():
                cancelled = True
                continue
            raise
        if cancelled:
            raise asyncio.CancelledError
        return result


class WeightSync:
    """Drives weight updates through one pool (see the module docstring)."""

    def __init__(self, pool: WorkerPool, *, phase_seconds: float = 600.0) -> None:
        self.pool = pool
        self.phase_seconds = phase_seconds
        self.current: WeightsUpdate | None = None
        self._task: asyncio.Task[dict[str, Any]] | None = None  # the running update
        self._last: Outcome | None = None  # the last update that finished
        self._lock = asyncio.Lock()  # one update, or one worker's catching up, at a time
        self._background: set[asyncio.Task[None]] = set()
        pool.on_behind = self._behind

    def __repr__(self) -> str:
        return f"<WeightSync v{self.pool.version} {self.current!r}>"

    @property
    def worst_case_seconds(self) -> float:
        """The longest an update runs once it started: pause, load, commit or rollback."""
        return 3 * self.phase_seconds

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
        returns. On ``UpdateFailedError`` every worker serves what it served before, except
        with ``commit_failed``: the workers it names are out of service, the others serve
        ``version``. Cancelling the caller does not stop the update (see the module
        docstring); the same update asked again gets its outcome."""
        running = self.current
        last = self._last
        admission = admit(
            (self.pool.version, self.pool.weights_path),
            (version, path),
            running.key if running is not None else None,
            last.key if last is not None else None,
        )
        if admission is Admission.JOIN:
            assert self._task is not None
            return await asyncio.shield(self._task)
        if admission is Admission.REPLAY:
            assert last is not None
            return last.answer()
        if admission is Admission.SERVED:
            return self.report()
        old = [
            h for h in self.pool.workers.values() if serves_policy(h) and not h.endpoint.can_update
        ]
        if old:
            raise UpdateRefusedError(
                "worker_cannot_update",
                f"worker {old[0].worker_id} speaks protocol {old[0].endpoint.version}, "
                f"weight updates need {protocol.WEIGHTS_VERSION}",
            )
        update = WeightsUpdate(f"wu-{secrets.token_hex(6)}", version, path, mode)
        self.current = update
        self.pool.hold()
        task = asyncio.get_running_loop().create_task(self._own(update))
        task.add_done_callback(_observed)
        task.add_done_callback(lambda _: self._let_go(update))
        self._task = task
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Stop a running update (the proxy shuts down): it is rolled back, unless it was
        committing already, which runs to its end."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RelayError):
                await task
        for background in list(self._background):
            background.cancel()
        with contextlib.suppress(asyncio.CancelledError, RelayError):
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _own(self, update: WeightsUpdate) -> dict[str, Any]:
        """The update's task: runs it, keeps its outcome for retries, lets the pool go."""
        try:
            async with self._lock:
                await self._run(update)
            report = self.report()
            report["updating"] = None
            self._last = Outcome(update.key, report, None)
            return report
        except WeightsUpdateError as exc:
            # A retryable failure is not kept: the same update asked again runs again.
            self._last = None if exc.retryable else Outcome(update.key, None, exc)
            raise
        finally:
            self._let_go(update)

    def _let_go(self, update: WeightsUpdate) -> None:
        """The update is over: release the pool, once (also for a task cancelled before
        it ran, whose ``finally`` never did)."""
        if self.current is update:
            self.current = None
            self.pool.release()

    async def _run(self, update: WeightsUpdate) -> None:
        # A teacher's worker keeps its own weights: the policy's checkpoint is not its.
        handles = [
            h
            for h in self.pool.workers.values()
            if h.state is WorkerState.SERVING and serves_policy(h)
        ]
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
        failure: UpdateFailedError | None = None
        try:
            failure = await self._pause_and_load(update, handles)
            if failure is None:
                update.advance(UpdateState.COMMITTING)
                # Once a commit is sent, the workers' weights depend on its answers: it
                # settles even if the update is stopped meanwhile.
                await finish_anyway(self._commit(update, handles))
        finally:
            if update.state in (UpdateState.PAUSING, UpdateState.LOADING):
                # Failed, or stopped (the proxy shuts down), before anything committed.
                update.advance(UpdateState.ROLLING_BACK)
                await finish_anyway(self._roll_back(update, handles))
            for handle in handles:
                if handle.state is WorkerState.UPDATING:
                    self.pool.serve(handle)
        if failure is not None:
            raise failure

    async def _pause_and_load(
        self, update: WeightsUpdate, handles: Sequence[WorkerHandle]
    ) -> UpdateFailedError | None:
        """The first two phases; the error that stops the update, if any."""
        pause = protocol.Pause(update.update_id, update.mode)
        answers = await self._phase(handles, pause, protocol.UpdatePhase.PAUSED)
        failed = _failures(answers)
        busy = sorted(
            w
            for w in failed
            if isinstance(a := answers[w], protocol.UpdateAck) and a.code == protocol.ACK_BUSY
        )
        if busy:
            return UpdateFailedError(
                "worker_busy",
                f"worker {busy[0]} is in another weight update (another proxy replica's); "
                "every worker still serves the previous version: try again when it is done",
                workers=tuple(busy),
                retryable=True,
            )
        if not failed:
            update.advance(UpdateState.LOADING)
            load = protocol.Load(update.update_id, update.version, update.path)
            answers = await self._phase(handles, load, protocol.UpdatePhase.LOADED)
            failed = _failures(answers)
        if not failed:
            return None
        # A worker that said no explains more than one that did not answer.
        refused = sorted(w for w in failed if isinstance(answers[w], protocol.UpdateAck))
        worker = refused[0] if refused else min(failed)
        return UpdateFailedError(
            "weights_load_failed" if refused else "update_timeout",
            f"worker {worker} could not load weights version {update.version}: "
            f"{failed[worker]} (every worker still serves the previous version)",
            workers=tuple(sorted(failed)),
        )

    async def _roll_back(self, update: WeightsUpdate, handles: Sequence[WorkerHandle]) -> None:
        rollback = protocol.Rollback(update.update_id)
        answers = await self._phase(handles, rollback, protocol.UpdatePhase.ROLLED_BACK)
        update.advance(UpdateState.ROLLED_BACK)
        self.pool.stats.updates_rolled_back += 1
        for handle in handles:
            answer = answers.get(handle.worker_id)
            if answer is not None and not (isinstance(answer, protocol.UpdateAck) and answer.ok):
                # It may still hold its requests: not left paused in the pool.
                await self._out_of_service(handle, f"could not roll back: {_reason(answer)}")

    async def _commit(self, update: WeightsUpdate, handles: Sequence[WorkerHandle]) -> None:
        commit = protocol.Commit(update.update_id)
        answers = await self._phase(handles, commit, protocol.UpdatePhase.COMMITTED)
        committed = [
            h
            for h in handles
            if isinstance(a := answers.get(h.worker_id), protocol.UpdateAck) and a.ok
        ]
        failed = _failures(answers)
        if committed or not failed:
            # Some worker serves it (or no worker was there to fail): the pool's version,
            # unless a newer one was adopted meanwhile. Stamped, no checkpoint holds it.
            if update.version > self.pool.version:
                self.pool.version, self.pool.weights_path = update.version, update.path
            update.advance(UpdateState.COMMITTED)
            self.pool.stats.updates_committed += 1
        else:
            update.advance(UpdateState.COMMIT_FAILED)
        for handle in committed:
            handle.version = update.version
            handle.weights_path = update.path
            if handle.version < self.pool.version:
                handle.state = WorkerState.JOINING  # catches up once this update is done
                self._behind(handle)
        for worker_id in sorted(failed):
            handle = next(h for h in handles if h.worker_id == worker_id)
            await self._out_of_service(handle, f"could not commit: {failed[worker_id]}")
        if failed:
            self.pool.stats.updates_commit_failed += 1
            serving = (
                f"the others serve version {update.version}"
                if committed
                else f"no worker committed; the version stays {self.pool.version}"
            )
            first = min(failed)
            raise UpdateFailedError(
                "commit_failed",
                f"worker {', '.join(sorted(failed))} could not commit weights version "
                f"{update.version} ({first}: {failed[first]}) and is out of service; {serving}",
                workers=tuple(sorted(failed)),
            )
        log.info("weight update %s: version %d serves", update.update_id, update.version)

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
            if path is not None:
                await self._load_checkpoint(handle, target, path)
                return
        # No checkpoint holds the target: loading nothing and committing would call the
        # weights the worker has by the new number. Only whoever stamped the version can
        # bring the worker to it (a Ray group's resume); waited for without the lock, so
        # that updates go on meanwhile.
        await self._await_stamp(handle, target)

    async def _load_checkpoint(self, handle: WorkerHandle, target: int, path: str) -> None:
        """Catching up a worker by loading ``path``, which holds version ``target``."""
        if not handle.endpoint.can_update:
            await self._out_of_service(
                handle, f"it serves version {handle.version} and cannot load {target}"
            )
            return
        update_id = f"wu-{secrets.token_hex(6)}"
        pause = protocol.Pause(update_id)
        answer = (await self._phase([handle], pause, protocol.UpdatePhase.PAUSED)).get(
            handle.worker_id
        )
        if answer is None:
            return  # it left
        if not (isinstance(answer, protocol.UpdateAck) and answer.ok):
            if await self._reaches(handle, target):
                # Paused by another replica's update of the same weights.
                self.pool.serve(handle)
            else:
                await self._out_of_service(
                    handle, f"could not load weights version {target}: {_reason(answer)}"
                )
            return
        # Paused: from here on it is resumed whatever happens, cancellation included.
        await finish_anyway(self._load_paused(handle, update_id, answer.version, target, path))

    async def _await_stamp(self, handle: WorkerHandle, target: int) -> None:
        """A worker behind a version that no checkpoint holds serves nothing until it
        reports that version itself, within a phase's time; otherwise it is taken out of
        service, never served under a number that does not describe its weights."""
        if await self._reaches(handle, target):
            if self.pool.workers.get(handle.worker_id) is not handle:
                return
            if handle.version < self.pool.version:
                self._behind(handle)  # the pool moved on meanwhile
            else:
                self.pool.serve(handle)
            return
        if self.pool.workers.get(handle.worker_id) is handle:
            await self._out_of_service(
                handle,
                f"it serves version {handle.version}; version {target} was stamped without "
                "a checkpoint, so it cannot be loaded here",
            )

    async def _load_paused(
        self, handle: WorkerHandle, update_id: str, serves: int, target: int, path: str | None
    ) -> None:
        """Catching up a paused worker that serves ``serves``: load and commit ``target``,
        or roll back (it reached the target meanwhile, or could not load it)."""
        failure: str | None = None
        if serves < target:
            for message, phase in (
                (protocol.Load(update_id, target, path), protocol.UpdatePhase.LOADED),
                (protocol.Commit(update_id), protocol.UpdatePhase.COMMITTED),
            ):
                answer = (await self._phase([handle], message, phase)).get(handle.worker_id)
                if answer is None:
                    return  # it left (and rolls back by itself)
                if not (isinstance(answer, protocol.UpdateAck) and answer.ok):
                    failure = _reason(answer)
                    break
            else:
                handle.version, handle.weights_path = target, path
                log.info("worker %s caught up to weights version %d", handle.worker_id, target)
                self.pool.serve(handle)
                return
        # Its own notice crossed this catching up (it committed the target through another
        # replica or its Ray group), or it could not load: the pause ends either way.
        rollback = protocol.Rollback(update_id)
        answer = (await self._phase([handle], rollback, protocol.UpdatePhase.ROLLED_BACK)).get(
            handle.worker_id
        )
        if answer is None:
            return  # it left
        if failure is None and isinstance(answer, protocol.UpdateAck) and answer.ok:
            handle.version = max(handle.version, serves)
            self.pool.serve(handle)
            return
        await self._out_of_service(
            handle, f"could not load weights version {target}: {failure or _reason(answer)}"
        )

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


def _observed(task: asyncio.Task[dict[str, Any]]) -> None:
    """Retrieve an update's error: every caller may have gone away before it ended."""
    if not task.cancelled():
        task.exception()


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
