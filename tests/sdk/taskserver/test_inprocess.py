"""The in-process task server: an async agent callable run as a task-server run."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Mapping
from pathlib import Path

import pytest

from sdk.exceptions import TaskServerError, TaskServerTimeoutError
from sdk.taskserver import inprocess
from sdk.taskserver.base import RunSpec, RunStatus
from sdk.taskserver.inprocess import InProcessTaskServer


def _spec(task: str = "task-a") -> RunSpec:
    return RunSpec(
        task=Path(task),
        agent="callable",
        model="tiny",
        base_url="http://127.0.0.1:9/trial-x/v1",
        api_key="sk-trial",
    )


async def test_the_agents_rewards_become_the_runs_result() -> None:
    """A run succeeds with what the callable returned, and it got the run's spec."""
    seen: list[RunSpec] = []

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        seen.append(spec)
        return {"reward": 0.5, "bonus": 1}

    server = InProcessTaskServer(agent)
    handle = await server.submit(_spec("task-b"))
    result = await server.wait(handle, timeout_seconds=10)
    assert result.status is RunStatus.SUCCEEDED
    assert dict(result.rewards) == {"reward": 0.5, "bonus": 1.0}
    assert seen == [_spec("task-b")]
    with pytest.raises(TaskServerError):  # a finished run is forgotten once handed out
        await server.wait(handle)


async def test_an_agent_error_fails_the_run_with_its_message() -> None:
    """An exception in the callable is a FAILED run that says what went wrong."""

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        raise RuntimeError(f"no luck with {spec.task}")

    server = InProcessTaskServer(agent)
    result = await server.wait(await server.submit(_spec()), timeout_seconds=10)
    assert result.status is RunStatus.FAILED
    assert result.error == "RuntimeError: no luck with task-a"
    assert not result.rewards


async def test_a_timeout_leaves_the_run_running_until_cancelled() -> None:
    """wait raises on timeout without stopping the agent; cancel stops it."""
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    server = InProcessTaskServer(agent)
    handle = await server.submit(_spec())
    with pytest.raises(TaskServerTimeoutError):
        await server.wait(handle, timeout_seconds=0.05)
    assert started.is_set()
    assert not cancelled.is_set()
    await server.cancel(handle)
    assert cancelled.is_set()
    result = await server.wait(handle, timeout_seconds=1)
    assert result.status is RunStatus.CANCELLED


async def test_max_concurrent_runs_bounds_the_agents_running_at_once() -> None:
    """With a limit of 2, never more than 2 callables run together; all finish."""
    running = 0
    peak = 0

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1
        return {"reward": 1.0}

    server = InProcessTaskServer(agent, max_concurrent_runs=2)
    handles = [await server.submit(_spec(f"t{i}")) for i in range(6)]
    results = [await server.wait(h, timeout_seconds=10) for h in handles]
    assert [r.status for r in results] == [RunStatus.SUCCEEDED] * 6
    assert peak == 2
    await server.aclose()


def _live_runs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is inprocess._Run)


async def test_cancelled_runs_are_forgotten_so_a_long_run_stays_flat() -> None:
    """Runs cancelled after a timeout (as RemoteAgentLoop does, never waiting on them
    again) and runs cancelled after they ended are not kept: after 300 of them the server
    holds only the one still running and the last ``ENDED_KEPT`` cancelled results."""

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        if spec.task.name == "quick":
            return {"reward": 1.0}
        await asyncio.Event().wait()
        return {}

    server = InProcessTaskServer(agent)
    before = _live_runs()
    for i in range(150):
        handle = await server.submit(_spec(f"slow-{i}"))
        with pytest.raises(TaskServerTimeoutError):
            await server.wait(handle, timeout_seconds=0)
        await server.cancel(handle)
        done = await server.submit(_spec("quick"))
        await asyncio.sleep(0)  # it ends before anyone waits for it
        await server.cancel(done)
    running = await server.submit(_spec("slow-kept"))
    assert _live_runs() - before == 1
    assert server.held_runs == 1 + inprocess.ENDED_KEPT
    await server.cancel(running)
    assert _live_runs() - before == 0
    assert server.held_runs == inprocess.ENDED_KEPT
    assert (await server.wait(running)).status is RunStatus.CANCELLED
    await server.aclose()
