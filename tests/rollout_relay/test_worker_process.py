"""A worker in a process of its own (``rollout-relay train --backend vllm``): it is waited
for until it joins or exits, and stopping it leaves none of its processes, whether it
exits on SIGTERM or a process it started ignores SIGTERM."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import start_proxy
from rollout_relay.worker_process import (
    WorkerProcess,
    WorkerProcessError,
    group_alive,
    vllm_worker_command,
    vllm_worker_env,
)

# A parent that exits on SIGTERM, and a child of it that ignores SIGTERM, as an engine
# process that was never told to close would; the child's pid is printed.
STUBBORN_CHILD = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _pid_from(log: Path) -> int:
    deadline = time.monotonic() + 30
    while not log.read_text().strip():
        assert time.monotonic() < deadline, "the stand-in worker printed nothing"
        time.sleep(0.05)
    return int(log.read_text().split()[0])


def test_stop_ends_a_worker_that_exits_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM alone ends it: stop says it was clean and its process group is gone."""
    worker = WorkerProcess.start(
        [sys.executable, "-c", "import time; time.sleep(600)"], {}, tmp_path / "worker.log"
    )
    assert worker.stop(grace_seconds=10) is True
    assert worker.process.returncode is not None
    assert not group_alive(worker.process.pid)


def test_stop_kills_what_outlives_sigterm(tmp_path: Path) -> None:
    """A process of the worker's that ignores SIGTERM is killed after the grace period,
    and stop says it was not clean."""
    log = tmp_path / "worker.log"
    worker = WorkerProcess.start([sys.executable, "-c", STUBBORN_CHILD], {}, log)
    child = _pid_from(log)
    assert worker.stop(grace_seconds=1) is False
    assert not group_alive(worker.process.pid)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()


async def test_a_worker_that_exits_before_joining_is_reported(tmp_path: Path) -> None:
    """Waiting for the worker to join ends when its process exits, naming its log."""
    running = await start_proxy(ProxyConfig(port=0))
    try:
        worker = WorkerProcess.start(
            [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "worker.log"
        )
        with pytest.raises(WorkerProcessError, match=r"exited \(3\).*worker\.log"):
            await worker.joined(running, within_seconds=30)
    finally:
        await running.stop()


def test_the_vllm_worker_serves_float32_eagerly_with_the_token_out_of_argv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker command asks vLLM for float32 (never its CPU bfloat16) and eager mode,
    the worker token goes through the environment only, and vLLM's compile caches sit
    beside the side environment."""
    python = Path("/repo/.cache/vllm-venv/bin/python")
    command = vllm_worker_command(python, "ws://127.0.0.1:1/ws/worker", Path("/m"), name="m")
    assert command[:3] == [str(python), "-m", "rollout_relay.cli"]
    assert command[command.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in command
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    env = vllm_worker_env(python, "secret")
    assert "secret" not in command
    assert env["RELAY_WORKER_TOKEN"] == "secret"
    assert env["VLLM_CACHE_ROOT"] == "/repo/.cache/vllm-compile"
