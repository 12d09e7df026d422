"""A Harbor environment (loaded by Harbor through ``environment.import_path``) whose start
never finishes: it keeps a launched ``harbor run`` alive so that status and cancellation
can be tested without a container runtime. Runs in Harbor's own Python 3.12 environment."""

from __future__ import annotations

import asyncio
from pathlib import Path

from harbor.environments.base import BaseEnvironment, ExecResult


class HoldEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "hold"

    def _validate_definition(self) -> None:
        return None

    async def start(self, force_build: bool) -> None:
        await asyncio.sleep(3600)

    async def stop(self, delete: bool) -> None:
        return None

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        return None

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        return None

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        return None

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        return None

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        return ExecResult(stdout="", stderr="", return_code=0)
