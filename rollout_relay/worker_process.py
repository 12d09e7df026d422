"""A ``rollout-relay worker`` in a process of its own, dialing a proxy of this process.

``rollout-relay train --backend vllm`` serves the policy with the real vLLM engine. vLLM
pins its own torch and transformers, so it lives in a side environment
(``scripts/vllm-env.sh``, ``.cache/vllm-venv``) while the trainer (TRL) lives in the
project's; the worker therefore runs from the side environment's Python, and dials the
proxy's worker URL with the worker token exactly as a worker on another machine would.

The process starts a session of its own: a Ctrl-C at the console reaches the trainer
only, which then stops the worker with SIGTERM (the worker closes vLLM's engine core on
it). Whatever of that session outlives the grace period is killed, so no process of the
worker's is left, engine core included.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.appkeys import POOL

if TYPE_CHECKING:
    from rollout_relay.embedded import RunningProxy

# The side environment ``scripts/vllm-env.sh`` makes, relative to the repository root.
DEFAULT_VLLM_PYTHON = Path(".cache/vllm-venv/bin/python")
# How long killed processes get to be gone before stop returns.
KILL_SETTLE_SECONDS = 10.0


class WorkerProcessError(RuntimeError):
    """The worker process exited, or did not join the proxy in time."""


def vllm_worker_command(
    python: Path, proxy_worker_url: str, model_dir: Path, *, name: str
) -> list[str]:
    """The ``rollout-relay worker`` command serving ``model_dir`` on vLLM as a float32
    trainer computes it: float32 (never vLLM's bfloat16 on CPU), eager (a third of the
    start-up; nothing to gain from compiling a tiny model)."""
    return [
        *(str(python), "-m", "rollout_relay.cli", "--log-level", "INFO", "worker"),
        *("--proxy", proxy_worker_url, "--model", str(model_dir), "--name", name),
        *("--backend", "vllm", "--dtype", "float32", "--enforce-eager"),
    ]


def vllm_worker_env(python: Path, token: str) -> dict[str, str]:
    """This process's environment for the worker: the worker token (not on the command
    line, where ``ps`` shows it), a KV cache that fits a tiny model on a laptop, and vLLM's
    compile caches beside the side environment (``.cache/vllm-compile``, as the tests use),
    unless already set."""
    env = dict(os.environ)
    env["RELAY_WORKER_TOKEN"] = token
    compile_cache = python.absolute().parent.parent.parent / "vllm-compile"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(compile_cache))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
    return env


@dataclass(slots=True)
class WorkerProcess:
    """A worker process started by ``start``; ``stop`` leaves none of its processes.

    Nothing here reaps the worker before ``stop`` has dealt with its process group: the
    group's id is the worker's pid, and only while the worker is unreaped (running, or a
    zombie) is that id sure not to name another process's group. So ``exit_status`` looks
    without reaping; whoever else reaps ``process`` (``poll``, ``wait``) leaves ``stop``
    unable to signal the group."""

    process: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    # Its own session: the group id is its pid, kept from the start.
    group: int = field(init=False)

    def __post_init__(self) -> None:
        self.group = self.process.pid

    @classmethod
    def start(cls, command: list[str], env: dict[str, str], log_path: Path) -> WorkerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(process, log_path)

    def __repr__(self) -> str:
        status = self.exit_status()
        state = "running" if status is None else f"exited {status}"
        return f"<WorkerProcess pid={self.process.pid} {state}>"

    def exit_status(self) -> int | None:
        """The worker's exit status as ``Popen.returncode`` gives it (negative: the signal
        that ended it), None while it runs; without reaping it, so that its pid, and with
        it the group id, stays this worker's until ``stop``."""
        if self.process.returncode is not None:
            return self.process.returncode
        try:
            state = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped by someone else: its status is lost
            return self.process.poll()
        if state is None or state.si_pid == 0:
            return None
        if state.si_code == os.CLD_EXITED:
            return state.si_status
        return -state.si_status

    async def joined(self, proxy: RunningProxy, within_seconds: float) -> float:
        """Wait until a worker is in the proxy's pool; the seconds since the start.
        Raises ``WorkerProcessError`` when the process exits or the time runs out."""
        deadline = time.monotonic() + within_seconds
        while not proxy.app[POOL].workers:
            status = self.exit_status()
            if status is not None:
                raise WorkerProcessError(
                    f"the worker process exited ({status}) before it joined; its log: "
                    f"{self.log_path}"
                )
            if time.monotonic() > deadline:
                raise WorkerProcessError(
                    f"the worker process did not join within {within_seconds:.0f}s; "
                    f"its log: {self.log_path}"
                )
            await asyncio.sleep(0.2)
        return time.monotonic() - self.started

    def stop(self, grace_seconds: float = 60.0) -> bool:
        """SIGTERM, then wait up to ``grace_seconds`` for the worker to close its engine
        and exit; whatever of its session is still alive then is killed, also when an
        exception (a second signal to this process) cuts the wait short. True when nothing
        had to be killed; False too when the worker had been reaped by someone else before:
        its group id may name another group by then, so no group is signalled."""
        if self.process.returncode is not None:
            return False
        clean = False
        try:
            clean = self._terminate(grace_seconds)
        finally:
            # The worker is unreaped until the wait below, so the group is still its own.
            if group_alive(self.group):
                clean = False
                self._kill_group()
            self.process.wait()
        return clean

    def _terminate(self, grace_seconds: float) -> bool:
        """SIGTERM and wait; whether the worker and its whole group were gone in time."""
        deadline = time.monotonic() + grace_seconds
        if self.exit_status() is None:
            # Not ``process.send_signal``: it reaps a worker that has exited.
            os.kill(self.process.pid, signal.SIGTERM)
            while self.exit_status() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.exit_status() is None:
            return False
        # The engine core exits when the worker closes it; give it the grace again.
        deadline = time.monotonic() + grace_seconds
        while group_alive(self.group) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not group_alive(self.group)

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.group, signal.SIGKILL)
        # SIGKILL is delivered, not yet acted on, when killpg returns: a member can
        # still be running for a moment (longer on a busy machine).
        deadline = time.monotonic() + KILL_SETTLE_SECONDS
        while group_alive(self.group) and time.monotonic() < deadline:
            time.sleep(0.05)


def group_alive(group: int) -> bool:
    """Whether a live (not zombie) process of process group ``group`` is left. A member
    that exited after its parent did waits for init to reap it and still counts for
    ``killpg``, so /proc is read where there is one."""
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - not Linux
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            return True
    return False
