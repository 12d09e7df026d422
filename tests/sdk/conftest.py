"""A real, minimal ``TaskServer`` for the SDK tests: it runs the agent as a local
subprocess with the trial's endpoint in its environment, then the task's ``tests/test.sh``,
and reads the reward from ``reward.txt`` (Harbor's verifier convention)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.exceptions import TaskServerError, TaskServerTimeoutError
from sdk.taskserver.base import RunHandle, RunId, RunResult, RunSpec, RunStatus
from tests.e2e.conftest import TIMEOUT_FACTOR, proxy_client, stack

__all__ = ["proxy_client", "stack"]

AGENTS = Path(__file__).parent / "agents"


@dataclass(slots=True)
class _Run:
    spec: RunSpec
    directory: Path
    task: asyncio.Task[RunResult] | None = None
    process: asyncio.subprocess.Process | None = None


class LocalTaskServer:
    """Runs ``spec.agent`` (a Python script path) as a subprocess per run."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.runs: dict[RunId, _Run] = {}
        self.submitted: list[RunSpec] = []

    async def submit(self, spec: RunSpec) -> RunHandle:
        run_id = RunId(f"run-{len(self.runs) + 1}")
        directory = self.root / run_id
        (directory / "logs" / "verifier").mkdir(parents=True)
        self.submitted.append(spec)
        run = _Run(spec, directory)
        run.task = asyncio.create_task(self._execute(run_id, run))
        self.runs[run_id] = run
        return RunHandle(run_id, "local")

    async def _execute(self, run_id: RunId, run: _Run) -> RunResult:
        env = {
            **os.environ,
            "OPENAI_BASE_URL": run.spec.base_url,
            "OPENAI_API_KEY": run.spec.api_key,
            "OPENAI_MODEL": run.spec.model,
            "TASK_DIR": str(run.spec.task),
            "RUN_DIR": str(run.directory),
            **{k: str(v) for k, v in run.spec.agent_settings.items()},
        }
        log = (run.directory / "agent.log").open("wb")
        try:
            run.process = await asyncio.create_subprocess_exec(
                sys.executable,
                run.spec.agent,
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
            code = await run.process.wait()
        finally:
            log.close()
        if code != 0:
            return RunResult(run_id, RunStatus.FAILED, error=f"agent exited with {code}")
        verifier = await asyncio.create_subprocess_exec(
            "bash", str(run.spec.task / "tests" / "test.sh"), env=env
        )
        await verifier.wait()
        reward_file = run.directory / "logs" / "verifier" / "reward.txt"
        if not reward_file.is_file():
            return RunResult(run_id, RunStatus.FAILED, error="the verifier wrote no reward")
        reward = float(reward_file.read_text().strip())
        return RunResult(run_id, RunStatus.SUCCEEDED, {"reward": reward}, logs=str(run.directory))

    async def wait(self, handle: RunHandle, *, timeout_seconds: float | None = None) -> RunResult:
        run = self.runs.get(handle.run_id)
        if run is None or run.task is None:
            raise TaskServerError(f"unknown run {handle.run_id}")
        try:
            return await asyncio.wait_for(asyncio.shield(run.task), timeout_seconds)
        except TimeoutError:
            raise TaskServerTimeoutError(f"{handle.run_id} still running") from None

    async def cancel(self, handle: RunHandle) -> None:
        run = self.runs.get(handle.run_id)
        if run is None or run.task is None or run.task.done():
            return
        if run.process is not None and run.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.process.pid, signal.SIGKILL)
            await run.process.wait()
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.task

    async def aclose(self) -> None:
        for run_id in list(self.runs):
            await self.cancel(RunHandle(run_id, "local"))


@pytest.fixture
def harbor_task(tmp_path: Path) -> Path:
    """A Harbor-format task whose verifier rewards an answer file with 1.0."""
    task = tmp_path / "task"
    (task / "tests").mkdir(parents=True)
    (task / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 60\n')
    (task / "instruction.md").write_text("Say hello.")
    (task / "tests" / "test.sh").write_text(
        'if [ -f "$RUN_DIR/answer.txt" ]; then echo 1.0; else echo 0.0; fi'
        ' > "$RUN_DIR/logs/verifier/reward.txt"\n'
    )
    return task


@pytest.fixture
async def local_task_server(tmp_path: Path) -> AsyncIterator[LocalTaskServer]:
    server = LocalTaskServer(tmp_path / "runs")
    yield server
    await server.aclose()


@pytest.fixture
async def own_stack(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    """A proxy and an hf worker of the test's own, for tests that move the served weights
    version (the shared ``stack`` must stay at version 0)."""
    running = await start_proxy(
        ProxyConfig(port=0, max_tokens=24, cache_dir=tmp_path / "own-proxy-cache")
    )
    start_hf_worker(running, tiny_model_dir, worker_id="own-hf")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()
