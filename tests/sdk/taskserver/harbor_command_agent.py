"""A Harbor agent (loaded through ``agent.import_path``) that runs one shell command in the
trial's environment with the agent's ``env`` (the trial's endpoint) and the instruction.
Runs in Harbor's Python 3.12 venv."""

from __future__ import annotations

from typing import Any

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext


class CommandAgent(BaseAgent):
    def __init__(self, *args: Any, command: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._command = command

    @staticmethod
    def name() -> str:
        return "command"

    def version(self) -> str:
        return "1"

    async def setup(self, environment: BaseEnvironment) -> None:
        return None

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        env = {
            **self._extra_env,
            "TASK_MODEL": self.model_name or "",
            "TASK_INSTRUCTION": instruction,
        }
        result = await environment.exec(command=self._command, env=env, cwd="/app")
        (self.logs_dir / "command.txt").write_text(f"{result.stdout}\n{result.stderr}")
        if result.return_code != 0:
            raise RuntimeError(
                f"agent command exited with {result.return_code}: {result.stderr[-500:]}"
            )
