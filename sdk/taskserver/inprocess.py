"""``InProcessTaskServer``: the agent is an async Python callable in the trainer's process.

For agents written as Python code against the official clients (a tool loop over the
``openai`` client, say) and for small local training runs, where starting a process and a
verifier per episode would cost more than the episode itself. The callable gets the run's
``RunSpec`` (the trial's ``base_url`` and ``api_key``, the task, the agent settings) and
returns the run's rewards; it must reach the model only through ``spec.base_url``, exactly
as an agent in a sandbox would, so that every call is recorded.

An exception raised by the callable fails the run (``RunStatus.FAILED`` with the error, its
fault not said, so ``RemoteAgentLoop`` retries it as the infrastructure's), a cancel or
timeout cancels its task. A run is forgotten once its finished result has been
handed out by ``wait``, or once it is cancelled (``RemoteAgentLoop`` never waits on a run
it cancelled): the result of a cancelled run stays for ``wait`` only among the last
``ENDED_KEPT`` cancelled ones, so a long training run holds no more than its running runs
and that many results.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from sdk.exceptions import TaskServerError, TaskServerTimeoutError
from sdk.taskserver.base import RunHandle, RunId, RunResult, RunSpec, RunStatus

# The agent: runs one episode against spec.base_url and returns its rewards.
AgentFn = Callable[[RunSpec], Awaitable[Mapping[str, float]]]

SERVER_NAME = "in-process"
ENDED_KEPT = 64  # results of cancelled runs kept for a later ``wait``


@dataclass(slots=True)
class _Run:
    spec: RunSpec
    task: asyncio.Task[Mapping[str, float]]


def run_result(run_id: RunId, task: asyncio.Task[Mapping[str, float]]) -> RunResult:
    """The result of a finished agent task: its rewards, its error, or its cancellation."""
    if task.cancelled():
        return RunResult(run_id, RunStatus.CANCELLED, error="cancelled")
    error = task.exception()
    if error is not None:
        return RunResult(run_id, RunStatus.FAILED, error=f"{type(error).__name__}: {error}")
    rewards = {str(k): float(v) for k, v in task.result().items()}
    return RunResult(run_id, RunStatus.SUCCEEDED, rewards)


class InProcessTaskServer:
    """A ``TaskServer`` (``sdk.taskserver.base``) whose agent is ``agent(spec)``."""

    def __init__(self, agent: AgentFn, *, max_concurrent_runs: int | None = None) -> None:
        if max_concurrent_runs is not None and max_concurrent_runs < 1:
            raise ValueError("max_concurrent_runs must be at least 1")
        self.agent = agent
        self._slots = asyncio.Semaphore(max_concurrent_runs) if max_concurrent_runs else None
        self._runs: dict[RunId, _Run] = {}
        self._ended: OrderedDict[RunId, RunResult] = OrderedDict()  # cancelled, not waited
        self._numbers = itertools.count(1)

    def __repr__(self) -> str:
        return f"<InProcessTaskServer runs={len(self._runs)} ended={len(self._ended)}>"

    @property
    def held_runs(self) -> int:
        """Runs this server still holds: running or finished but not yet handed out."""
        return len(self._runs) + len(self._ended)

    async def _execute(self, spec: RunSpec) -> Mapping[str, float]:
        if self._slots is None:
            return await self.agent(spec)
        async with self._slots:
            return await self.agent(spec)

    async def submit(self, spec: RunSpec) -> RunHandle:
        run_id = RunId(f"run-{next(self._numbers)}")
        task = asyncio.get_running_loop().create_task(self._execute(spec), name=run_id)
        self._runs[run_id] = _Run(spec, task)
        return RunHandle(run_id, SERVER_NAME)

    async def wait(self, handle: RunHandle, *, timeout_seconds: float | None = None) -> RunResult:
        ended = self._ended.pop(handle.run_id, None)
        if ended is not None:
            return ended
        run = self._runs.get(handle.run_id)
        if run is None:
            raise TaskServerError(f"unknown run {handle.run_id}")
        # asyncio.wait neither raises the task's error nor cancels it on a timeout.
        await asyncio.wait({run.task}, timeout=timeout_seconds)
        if not run.task.done():
            raise TaskServerTimeoutError(f"{handle.run_id} still running")
        del self._runs[handle.run_id]
        return run_result(handle.run_id, run.task)

    async def cancel(self, handle: RunHandle) -> None:
        run = self._runs.pop(handle.run_id, None)
        if run is None:
            return
        if not run.task.done():
            run.task.cancel()
            # asyncio.wait raises nothing: awaiting the task would raise its cancellation
            # here, and that exception's traceback would keep this frame (and the run)
            # alive as long as the task.
            await asyncio.wait({run.task})
        self._ended[handle.run_id] = run_result(handle.run_id, run.task)
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    async def aclose(self) -> None:
        for run_id in list(self._runs):
            await self.cancel(RunHandle(run_id, SERVER_NAME))
        self._runs.clear()
        self._ended.clear()
