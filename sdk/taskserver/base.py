"""The task-server protocol shared by every implementation and by ``RemoteAgentLoop``."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NewType, Protocol

RunId = NewType("RunId", str)


class RunStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # the agent ran and the task's tests produced a reward
    FAILED = "failed"  # the agent or the verifier failed; ``error`` says why
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def finished(self) -> bool:
        return self not in {RunStatus.QUEUED, RunStatus.RUNNING}


class Fault(enum.Enum):
    """Whose doing a failed run was (``RunResult.fault``): what decides whether its
    episode is the policy's to train on or is retried."""

    AGENT = "agent"  # the agent failed (exited with an error, its context overflowed)
    INFRA = "infra"  # the task's set-up, the sandbox, the verifier, the model API or the server


@dataclass(slots=True, frozen=True)
class RunSpec:
    """One agent run: the task, which agent, and the trial's endpoint."""

    task: Path  # a Harbor-format task directory (task.toml, instruction.md, tests/)
    agent: str  # e.g. "mini-swe-agent", "claude-code", "codex", or an import path
    model: str  # the model name the agent sends (the proxy maps it to the served model)
    base_url: str  # the trial's <proxy>/<trial_id>/v1
    api_key: str  # the trial's key
    timeout_seconds: float = 1800.0
    agent_settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class RunHandle:
    run_id: RunId
    server: str  # which task server (for logs)


@dataclass(slots=True, frozen=True)
class RunResult:
    run_id: RunId
    status: RunStatus
    rewards: Mapping[str, float] = field(default_factory=dict)  # {} when none was produced
    error: str | None = None
    logs: str | None = None  # where the run's logs are (a path or URL)
    # A FAILED run: whose doing (None: not said, taken as the infrastructure's).
    fault: Fault | None = None

    @property
    def reward(self) -> float | None:
        """The single reward: "reward" if present, else the only value, else None."""
        if "reward" in self.rewards:
            return float(self.rewards["reward"])
        if len(self.rewards) == 1:
            return float(next(iter(self.rewards.values())))
        return None


class TaskServer(Protocol):
    async def submit(self, spec: RunSpec) -> RunHandle: ...

    async def wait(self, handle: RunHandle, *, timeout_seconds: float | None = None) -> RunResult:
        """The run's result once finished; raises ``TaskServerTimeoutError`` (sdk.exceptions)
        when ``timeout_seconds`` passes first (the run is left running: call ``cancel``)."""
        ...

    async def cancel(self, handle: RunHandle) -> None:
        """Stop the run (idempotent; a finished run stays as it was)."""
        ...

    async def aclose(self) -> None: ...
