"""Every long-running command stops cleanly on SIGTERM and on SIGINT, whatever signal
dispositions it inherited: each runs here as a non-interactive shell starts a background
job, with SIGINT ignored (Python then installs no KeyboardInterrupt handler)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.processes import ignoring_sigint, reap, stop

SIGNALS = pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"]
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_relay.cli", "--log-level", "WARNING", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ignoring_sigint,
    )


def _until_line(process: subprocess.Popen[str], starts: str) -> str:
    """The first line of ``process``'s output that starts with ``starts``."""
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        if line.startswith(starts):
            return line
        seen.append(line)
    raise AssertionError(f"exited ({process.wait(10)}) before printing {starts!r}: {seen}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        reap(process)
        if process.stdout is not None:
            process.stdout.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _poll(
    condition: Callable[[], bool], process: subprocess.Popen[str], seconds: float, why: str
) -> None:
    """Until ``condition`` holds, while ``process`` runs, ``seconds`` at most."""
    deadline = time.monotonic() + seconds * TIMEOUT_FACTOR
    while not condition():
        assert process.poll() is None, f"exited with {process.returncode}"
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


@SIGNALS
def test_proxy_and_worker_stop_on_a_signal(
    tiny_model_dir: Path, processes: list[subprocess.Popen[str]], signum: signal.Signals
) -> None:
    """The worker leaves the pool and exits 0; the proxy then drains and exits 0."""
    port = _free_port()
    proxy = _start("proxy", "--no-auth", "--port", str(port), "--drain-seconds", "5")
    processes.append(proxy)
    _until_line(proxy, "rollout-relay proxy listening on")
    url = f"http://127.0.0.1:{port}"
    worker = _start(
        "worker", "--proxy", f"ws://127.0.0.1:{port}/ws/worker", "--model", str(tiny_model_dir)
    )
    processes.append(worker)
    _poll(lambda: _ready(url), worker, 120, "the worker did not join")
    assert stop(worker, signum) == 0
    _poll(lambda: not _ready(url), proxy, 30, "the proxy still counts the worker")
    assert stop(proxy, signum) == 0


@SIGNALS
def test_up_stops_on_a_signal(
    tiny_model_dir: Path, processes: list[subprocess.Popen[str]], signum: signal.Signals
) -> None:
    """`rollout-relay up` (proxy and in-process worker) exits 0."""
    up = _start("up", "--port", str(_free_port()), "--model", str(tiny_model_dir))
    processes.append(up)
    _until_line(up, "rollout-relay is up")
    assert stop(up, signum) == 0


@SIGNALS
def test_task_server_stops_on_a_signal(
    processes: list[subprocess.Popen[str]], signum: signal.Signals
) -> None:
    """`rollout-relay task-server` exits 0."""
    server = _start("task-server", "--port", str(_free_port()), "--token", "t")
    processes.append(server)
    _until_line(server, "rollout-relay task server listening on")
    assert stop(server, signum) == 0
