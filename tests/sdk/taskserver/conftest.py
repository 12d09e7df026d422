"""Harbor-format tasks written on the fly, and an embedded task server on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from sdk.taskserver.runs_api import RunsApiTaskServer
from sdk.taskserver.server import RunningTaskServer, TaskServerConfig, start_task_server

MakeTask = Callable[..., Path]


def write_task(
    root: Path,
    name: str,
    *,
    test_sh: str,
    solve_sh: str | None = None,
    instruction: str = "Write 42 into /app/answer.txt.\n",
    agent_timeout: float = 120.0,
    verifier_timeout: float = 120.0,
    workdir: str = "/app",
    env_files: dict[str, str] | None = None,
) -> Path:
    task = root / name
    (task / "tests").mkdir(parents=True)
    (task / "environment").mkdir()
    (task / "task.toml").write_text(
        'version = "1.0"\n\n[metadata]\ndifficulty = "easy"\n\n'
        f"[agent]\ntimeout_sec = {agent_timeout}\n\n[verifier]\ntimeout_sec = {verifier_timeout}\n"
    )
    (task / "instruction.md").write_text(instruction)
    (task / "environment" / "Dockerfile").write_text(f"FROM ubuntu:24.04\nWORKDIR {workdir}\n")
    for rel, text in (env_files or {}).items():
        (task / "environment" / rel).write_text(text)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    if solve_sh is not None:
        (task / "solution").mkdir()
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve_sh)
    return task


# A verifier in Harbor's style: it checks the container's /app and writes /logs/verifier.
ANSWER_TEST = """
if [ "$(cat /app/answer.txt 2>/dev/null)" = "42" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@pytest.fixture
def make_task(tmp_path: Path) -> MakeTask:
    counter = iter(range(1000))

    def make(**kwargs: object) -> Path:
        name = str(kwargs.pop("name", f"task-{next(counter)}"))
        kwargs.setdefault("test_sh", ANSWER_TEST)
        return write_task(tmp_path / "tasks", name, **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
async def task_server(tmp_path: Path) -> AsyncIterator[RunningTaskServer]:
    running = await start_task_server(
        TaskServerConfig(
            port=0,
            runs_dir=tmp_path / "runs",
            max_concurrent_runs=2,
            agents={"echo-agent": "echo agent says $TASK_MODEL; echo 42 > answer.txt"},
            kill_grace_seconds=1.0,
        )
    )
    yield running
    await running.stop()


@pytest.fixture
async def runs_client(task_server: RunningTaskServer) -> AsyncIterator[RunsApiTaskServer]:
    async with RunsApiTaskServer(task_server.url) as client:
        yield client
