"""Running a Harbor-format task as local processes, without a container.

One run lives in its own directory::

    <run>/task/         the task as submitted (task.toml, instruction.md, tests/, ...)
    <run>/workspace/    the agent's working directory: a copy of the task's environment/
                        build context (its Dockerfile is not executed)
    <run>/tests/        tests/ with container paths mapped into the run (see below)
    <run>/solution/     solution/, mapped the same way (the ``oracle`` agent runs solve.sh)
    <run>/logs/agent/   the agent's output (``output.txt``) and whatever it writes there
    <run>/logs/verifier/ test.sh's output (``test-output.txt``) and reward.txt/reward.json
    <run>/result.json   the final status, rewards and error

Harbor's scripts address the container's paths (``/logs/verifier/reward.txt``,
``/tests/...``, the Dockerfile's ``WORKDIR`` such as ``/app``). Without a container those
paths cannot be mounted, so the text files of tests/ and solution/ are copied with each
such absolute path rewritten to its place in the run directory.

The agent command runs with the trial's endpoint in its environment (``OPENAI_BASE_URL``,
``ANTHROPIC_BASE_URL`` and friends, see ``agent_environment``); then ``tests/test.sh``
runs without the trial's key. Each runs in its own process group so that a timeout or a
cancel ends everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sdk.exceptions import TaskDefinitionError
from sdk.taskserver.base import Fault, RunId, RunStatus
from sdk.taskserver.tasks import HarborTask, read_rewards

log = logging.getLogger(__name__)

ORACLE_AGENT = "oracle"

# Variables of the server's own environment an agent or verifier must never see.
_SECRET_VARIABLES = ("RELAY_TASK_SERVER_TOKEN", "RELAY_ADMIN_TOKEN", "RELAY_WORKER_TOKEN")

_LEGAL: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED}),
    RunStatus.RUNNING: frozenset(
        {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMED_OUT}
    ),
}


class IllegalRunTransition(RuntimeError):
    pass


class Phase(enum.Enum):
    """Where a running run is (for status and logs)."""

    WAITING = "waiting"
    AGENT = "agent"
    VERIFIER = "verifier"
    DONE = "done"


@dataclass(slots=True, frozen=True)
class LocalRunSpec:
    agent: str
    model: str
    base_url: str
    api_key: str
    timeout_seconds: float
    command: str | None = None  # the agent command (a shell command line), if not by name
    env: Mapping[str, str] = field(default_factory=dict)  # extra agent environment


@dataclass(slots=True)
class LocalRun:
    run_id: RunId
    spec: LocalRunSpec
    task: HarborTask
    run_dir: Path
    status: RunStatus = RunStatus.QUEUED
    phase: Phase = Phase.WAITING
    rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    fault: Fault | None = None  # a failed run: whose doing
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    agent_exit_code: int | None = None
    verifier_exit_code: int | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def __repr__(self) -> str:
        return f"<LocalRun {self.run_id} {self.status.value} {self.phase.value}>"

    def transition(self, status: RunStatus) -> None:
        if status not in _LEGAL.get(self.status, frozenset()):
            raise IllegalRunTransition(f"run {self.run_id}: {self.status.value} → {status.value}")
        self.status = status
        if status is RunStatus.RUNNING:
            self.started_at = time.time()
        if status.finished:
            self.phase = Phase.DONE
            self.finished_at = time.time()
            self.finished.set()

    def fail(self, fault: Fault) -> None:
        self.fault = fault
        self.transition(RunStatus.FAILED)

    def to_json(self) -> dict[str, object]:
        return {
            "run_id": self.run_id,
            "status": self.status.value,
            "phase": self.phase.value,
            "task": self.task.name,
            "agent": self.spec.agent,
            "rewards": dict(self.rewards),
            "error": self.error,
            "fault": None if self.fault is None else self.fault.value,
            "agent_exit_code": self.agent_exit_code,
            "verifier_exit_code": self.verifier_exit_code,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


# ---------------------------------------------------------------- path mapping


def container_paths(task: HarborTask, run_dir: Path) -> dict[str, Path]:
    """Harbor's container paths and where they live in this run."""
    mapping = {
        "/logs/verifier": run_dir / "logs" / "verifier",
        "/logs/agent": run_dir / "logs" / "agent",
        "/logs": run_dir / "logs",
        "/tests": run_dir / "tests",
        "/solution": run_dir / "solution",
    }
    if task.workdir and task.workdir not in mapping and task.workdir != "/":
        mapping[task.workdir] = run_dir / "workspace"
    return mapping


def map_paths(text: str, mapping: Mapping[str, Path]) -> str:
    """``text`` with every absolute container path (as a whole path component) replaced by
    its run-directory path; longer prefixes first, so /logs/verifier wins over /logs."""
    if not mapping:
        return text
    prefixes = "|".join(re.escape(prefix) for prefix in sorted(mapping, key=len, reverse=True))
    pattern = re.compile(r"(?<![\w./-])(" + prefixes + r")(?![\w.-])")
    return pattern.sub(lambda match: str(mapping[match.group(1)]), text)


def _copy_mapped(source: Path, target: Path, mapping: Mapping[str, Path]) -> None:
    shutil.copytree(source, target, symlinks=True)
    for path in target.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary files are copied as they are
        mapped = map_paths(text, mapping)
        if mapped != text:
            path.write_text(mapped)


def prepare_run_dir(task: HarborTask, run_dir: Path) -> None:
    """Lay out ``run_dir`` for ``task`` (see the module docstring)."""
    mapping = container_paths(task, run_dir)
    workspace = run_dir / "workspace"
    environment = task.environment_dir
    if environment is not None:
        shutil.copytree(
            environment,
            workspace,
            symlinks=True,
            ignore=shutil.ignore_patterns(
                "Dockerfile", "docker-compose.yaml", "docker-compose.yml"
            ),
        )
    workspace.mkdir(parents=True, exist_ok=True)
    _copy_mapped(task.path / "tests", run_dir / "tests", mapping)
    if (task.path / "solution").is_dir():
        _copy_mapped(task.path / "solution", run_dir / "solution", mapping)
    for sub in ("agent", "verifier"):
        (run_dir / "logs" / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / "instruction.md").write_text(task.instruction)


# ---------------------------------------------------------------- environments


def _base_environment() -> dict[str, str]:
    env = dict(os.environ)
    for name in _SECRET_VARIABLES:
        env.pop(name, None)
    return env


def agent_environment(run: LocalRun) -> dict[str, str]:
    """What the agent process sees: the trial's endpoint under the names the common agents
    read, the task, and the run's directories."""
    spec = run.spec
    anthropic_base = spec.base_url.rstrip("/").removesuffix("/v1")
    env = _base_environment()
    env.update(
        {
            # OpenAI SDK, Codex, SWE-agent, mini-swe-agent (base URL ends in /v1)
            "OPENAI_BASE_URL": spec.base_url,
            "OPENAI_API_KEY": spec.api_key,
            # Anthropic SDK and Claude Code append /v1/messages themselves
            "ANTHROPIC_BASE_URL": anthropic_base,
            "ANTHROPIC_API_KEY": spec.api_key,
            # OpenHands
            "LLM_BASE_URL": spec.base_url,
            "LLM_API_KEY": spec.api_key,
            "LLM_MODEL": spec.model,
            "TASK_MODEL": spec.model,
            "TASK_NAME": run.task.name,
            "TASK_INSTRUCTION": run.task.instruction,
            "TASK_INSTRUCTION_FILE": str(run.run_dir / "instruction.md"),
            "TASK_WORKSPACE": str(run.run_dir / "workspace"),
            "TASK_AGENT_LOGS": str(run.run_dir / "logs" / "agent"),
        }
    )
    env.update(spec.env)
    return env


def verifier_environment(run: LocalRun) -> dict[str, str]:
    """The verifier's environment: the run's directories, never the trial's key."""
    env = _base_environment()
    env.update(
        {
            "TASK_NAME": run.task.name,
            "TASK_WORKSPACE": str(run.run_dir / "workspace"),
            "TASK_VERIFIER_LOGS": str(run.run_dir / "logs" / "verifier"),
        }
    )
    return env


def agent_command(run: LocalRun, agents: Mapping[str, str]) -> str:
    """The agent's shell command line: given with the run, configured under the agent's
    name, or the ``oracle`` (the task's own solution/solve.sh)."""
    if run.spec.command:
        return run.spec.command
    if run.spec.agent in agents:
        return agents[run.spec.agent]
    if run.spec.agent == ORACLE_AGENT:
        if run.task.solution_script is None:
            raise TaskDefinitionError(
                f"{run.task.name}: the oracle agent needs solution/solve.sh, which is missing"
            )
        return f"bash {run.run_dir / 'solution' / 'solve.sh'}"
    known = sorted({*agents, ORACLE_AGENT})
    raise TaskDefinitionError(
        f"unknown agent {run.spec.agent!r}: this task server runs {', '.join(known)} "
        "(or give agent_settings.command)"
    )


# ---------------------------------------------------------------- processes


class ProcessOutcome(enum.Enum):
    EXITED = "exited"
    TIMED_OUT = "timed_out"


async def _terminate(process: asyncio.subprocess.Process, grace_seconds: float) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``grace_seconds``."""
    if process.returncode is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # children that outlived the leader
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_seconds)
    except TimeoutError:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


async def run_process(
    command: list[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    output: Path,
    timeout_seconds: float,
    grace_seconds: float,
) -> tuple[ProcessOutcome, int | None]:
    """Run ``command`` in its own process group, stdout and stderr to ``output``.
    Cancelling the caller ends the whole group."""
    with output.open("ab") as sink:
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=cwd,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=sink,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        returncode = await asyncio.wait_for(process.wait(), max(timeout_seconds, 0.0))
    except TimeoutError:
        await _terminate(process, grace_seconds)
        return ProcessOutcome.TIMED_OUT, None
    except asyncio.CancelledError:
        await asyncio.shield(_terminate(process, grace_seconds))
        raise
    await _terminate(process, grace_seconds)  # reap background children it left behind
    return ProcessOutcome.EXITED, returncode


@dataclass(slots=True, frozen=True)
class RunnerSettings:
    agents: Mapping[str, str] = field(default_factory=dict)
    kill_grace_seconds: float = 5.0


async def execute(run: LocalRun, settings: RunnerSettings) -> None:
    """Run the agent, then the verifier, and settle ``run``'s status. The caller moved the
    run to RUNNING and cancels this coroutine to cancel the run."""
    deadline = time.monotonic() + run.spec.timeout_seconds
    logs = run.run_dir / "logs"
    try:
        command = agent_command(run, settings.agents)
        prepare_run_dir(run.task, run.run_dir)
    except (TaskDefinitionError, OSError) as exc:
        run.error = str(exc)
        run.fail(Fault.INFRA)
        return

    run.phase = Phase.AGENT
    agent_limit = min(run.task.agent_timeout_seconds, deadline - time.monotonic())
    (logs / "agent" / "command.txt").write_text(command + "\n")
    outcome, code = await run_process(
        ["/bin/sh", "-c", command],
        cwd=run.run_dir / "workspace",
        env=agent_environment(run),
        output=logs / "agent" / "output.txt",
        timeout_seconds=agent_limit,
        grace_seconds=settings.kill_grace_seconds,
    )
    run.agent_exit_code = code
    if outcome is ProcessOutcome.TIMED_OUT:
        # The run's own deadline ends it; the task's agent limit is Harbor's
        # AgentTimeoutError, after which Harbor still verifies what the agent left.
        if time.monotonic() >= deadline:
            run.error = f"the run did not finish within {run.spec.timeout_seconds:g}s (agent)"
            run.transition(RunStatus.TIMED_OUT)
            return
        agent_error: str | None = (
            f"agent timed out after the task's {run.task.agent_timeout_seconds:g}s"
        )
        agent_timed_out = True
    else:
        agent_error = None if code == 0 else f"agent exited with code {code}"
        agent_timed_out = False

    run.phase = Phase.VERIFIER
    verifier_limit = min(run.task.verifier_timeout_seconds, deadline - time.monotonic())
    outcome, code = await run_process(
        ["bash", str(run.run_dir / "tests" / "test.sh")],
        cwd=run.run_dir / "workspace",
        env=verifier_environment(run),
        output=logs / "verifier" / "test-output.txt",
        timeout_seconds=verifier_limit,
        grace_seconds=settings.kill_grace_seconds,
    )
    run.verifier_exit_code = code
    if outcome is ProcessOutcome.TIMED_OUT:
        overall = time.monotonic() >= deadline
        run.error = (
            f"the run did not finish within {run.spec.timeout_seconds:g}s (verifier)"
            if overall
            else f"verifier timed out after the task's {run.task.verifier_timeout_seconds:g}s"
        )
        run.transition(RunStatus.TIMED_OUT)
        return
    try:
        rewards = read_rewards(logs / "verifier")
    except TaskDefinitionError as exc:
        run.error = f"verifier: {exc}"
        run.fail(Fault.INFRA)
        return
    if rewards is None:
        run.error = f"verifier wrote no reward.txt or reward.json (test.sh exited with code {code})"
        if agent_error:
            run.error = f"{agent_error}; {run.error}"
        # An agent that ran out of time or failed is the first cause; a verifier that
        # graded nothing after an agent that finished is the task's own fault.
        if agent_timed_out:
            run.transition(RunStatus.TIMED_OUT)
        else:
            run.fail(Fault.AGENT if agent_error else Fault.INFRA)
        return
    run.rewards = rewards
    run.error = agent_error
    # A reward was produced: the run succeeded, unless the agent hit the task's limit.
    run.transition(RunStatus.TIMED_OUT if agent_timed_out else RunStatus.SUCCEEDED)


def write_result(run: LocalRun) -> None:
    with contextlib.suppress(OSError):
        (run.run_dir / "result.json").write_text(json.dumps(run.to_json(), indent=2))
