"""A worker in a process of its own (``rollout-relay train --backend vllm``): it is waited
for until it joins or exits, and stopping it leaves none of its processes, whether it
exits on SIGTERM or a process it started ignores SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from proxy.config import ProxyConfig
from rollout_relay import worker_process
from rollout_relay.embedded import start_proxy
from rollout_relay.train import _sigterm_exits
from rollout_relay.worker_process import (
    WorkerProcess,
    WorkerProcessError,
    group_alive,
    vllm_worker_command,
    vllm_worker_env,
)
from tests.e2e.conftest import TIMEOUT_FACTOR

# A parent that exits on SIGTERM, and a child of it that ignores SIGTERM, as an engine
# process that was never told to close would; the child's pid is printed.
STUBBORN_CHILD = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


# A worker that exits at once, leaving in its group a child that ignores SIGTERM.
LEAVES_STUBBORN_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
"""

# A worker that says it is up, and says SIGTERM but goes on when it gets one.
SAYS_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM", flush=True))
print("up", flush=True)
while True:
    time.sleep(600)
"""


def _logged(log: Path, line: str, seconds: float = 30) -> None:
    """Until ``log`` holds ``line`` (a bound scaled by the suite's factor)."""
    deadline = time.monotonic() + seconds * TIMEOUT_FACTOR
    while line not in log.read_text().splitlines():
        assert time.monotonic() < deadline, f"the stand-in worker never said {line!r}"
        time.sleep(0.02)


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


def _sigterm_then_stop(worker: WorkerProcess, then: threading.Thread) -> None:
    """A run's SIGTERM (its handler runs before the next line) and the ``finally`` that
    stops its worker, with ``then`` started as that begins."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        then.start()
        worker.stop(grace_seconds=3 * TIMEOUT_FACTOR)


def test_a_second_sigterm_while_stopping_the_worker_still_kills_its_group(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM ends a run through its cleanup; a second SIGTERM while that cleanup waits
    for the worker to stop neither cuts the wait nor leaves the worker's process group."""
    log = tmp_path / "worker.log"
    worker = WorkerProcess.start([sys.executable, "-c", SAYS_SIGTERM], {}, log)
    _logged(log, "up")

    def sigterm_again() -> None:
        _logged(log, "SIGTERM")  # the worker was told to stop: stop now waits for it
        os.kill(os.getpid(), signal.SIGTERM)

    again = threading.Thread(target=sigterm_again, daemon=True)
    try:
        with pytest.raises(SystemExit) as caught, _sigterm_exits():
            _sigterm_then_stop(worker, again)
        again.join(30 * TIMEOUT_FACTOR)
        assert not group_alive(worker.process.pid)
        assert caught.value.code == 143
        assert "SIGTERM again" in capfd.readouterr().err
    finally:
        if worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGKILL)
            worker.process.wait(30)


def test_stop_signals_no_group_once_the_worker_was_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reaped before stop has a pid any new process group may take: stop then
    signals no group at all."""
    worker = WorkerProcess.start([sys.executable, "-c", "pass"], {}, tmp_path / "worker.log")
    worker.process.wait(30 * TIMEOUT_FACTOR)  # reaped: its pid is free
    sent: list[tuple[int, int]] = []
    # Another session took the pid as its group id.
    monkeypatch.setattr(worker_process, "group_alive", lambda group: True)
    monkeypatch.setattr(worker_process, "KILL_SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(os, "killpg", lambda group, signum: sent.append((group, signum)))
    worker.stop(grace_seconds=0)
    assert sent == []


def test_a_worker_seen_exited_still_has_its_group_killed(tmp_path: Path) -> None:
    """Noticing that the worker exited (as waiting for it to join does) does not reap it,
    so stop still owns its group and kills what the worker left in it."""
    log = tmp_path / "worker.log"
    worker = WorkerProcess.start([sys.executable, "-c", LEAVES_STUBBORN_CHILD], {}, log)
    child = _pid_from(log)
    try:
        deadline = time.monotonic() + 30 * TIMEOUT_FACTOR
        while worker.exit_status() is None:
            assert time.monotonic() < deadline, "the stand-in worker did not exit"
            time.sleep(0.02)
        assert worker.exit_status() == 0
        assert worker.stop(grace_seconds=1) is False
        assert not group_alive(worker.group)
        stat = Path(f"/proc/{child}/stat")
        assert not stat.parent.exists() or "Z" in stat.read_text()
    finally:
        if group_alive(worker.process.pid):  # only when the test failed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.process.pid, signal.SIGKILL)


async def test_a_worker_that_exits_before_joining_is_reported(tmp_path: Path) -> None:
    """Waiting for the worker to join ends when its process exits, naming its log."""
    running = await start_proxy(ProxyConfig(port=0))
    try:
        worker = WorkerProcess.start(
            [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "worker.log"
        )
        with pytest.raises(WorkerProcessError, match=r"exited \(3\).*worker\.log"):
            await worker.joined(running, within_seconds=30)
        # Not reaped by noticing it (its group is still its own): stop reaps it.
        assert worker.process.returncode is None
        assert worker.stop(grace_seconds=1) is True
        assert worker.process.returncode == 3
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
