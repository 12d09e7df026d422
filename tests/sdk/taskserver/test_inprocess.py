"""The in-process task server: an async agent callable run as a task-server run."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest

from sdk.exceptions import TaskServerError, TaskServerTimeoutError
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
