"""A Harbor environment (loaded through ``environment.import_path``) that runs a trial as
local processes, standing in for the container runtime this machine lacks. The container's
absolute paths (/logs, /tests, /solution, /app, ...) live under one directory per trial,
and commands are rewritten to address them there. Runs in Harbor's Python 3.12 venv."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

from harbor.environments.base import BaseEnvironment, ExecResult

_ROOTS = ("logs", "tests", "solution", "app", "installed-agent", "oracle", "workspace")


class LocalEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "local-processes"

    def _validate_definition(self) -> None:
        return None

    @property
    def _root(self) -> Path:
        root = getattr(self, "_local_root", None)
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="harbor-local-"))
            self._local_root = root
        return root

    def _map(self, text: str) -> str:
        pattern = re.compile(r"(?<![\w./-])/(" + "|".join(map(re.escape, _ROOTS)) + r")(?![\w.-])")
        return pattern.sub(lambda m: str(self._root / m.group(1)), text)

    def _path(self, container_path: str | Path) -> Path:
        return Path(self._map(str(container_path)))

    async def start(self, force_build: bool) -> None:
        for name in _ROOTS:
            (self._root / name).mkdir(parents=True, exist_ok=True)
        for sub in ("agent", "verifier", "artifacts"):
            (self._root / "logs" / sub).mkdir(parents=True, exist_ok=True)

    async def stop(self, delete: bool) -> None:
        if delete:
            shutil.rmtree(self._root, ignore_errors=True)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, target)
        self._rewrite(target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        target = self._path(target_dir)
        shutil.copytree(source_dir, target, dirs_exist_ok=True)
        for path in target.rglob("*"):
            if path.is_file():
                self._rewrite(path)

    def _rewrite(self, path: Path) -> None:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            return
        mapped = self._map(text)
        if mapped != text:
            path.write_text(mapped)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self._path(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        source = self._path(source_dir)
        if source.is_dir():
            shutil.copytree(source, target_dir, dirs_exist_ok=True)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        workdir = self._path(cwd) if cwd else self._root / "app"
        workdir.mkdir(parents=True, exist_ok=True)
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            self._map(command),
            cwd=workdir,
            env={**os.environ, **(self._merge_env(env) or {})},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_sec)
        except BaseException:  # its own timeout, or Harbor's (the agent's time is up)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the command and what it started
            await process.wait()
            raise
        return ExecResult(
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            return_code=process.returncode or 0,
        )
