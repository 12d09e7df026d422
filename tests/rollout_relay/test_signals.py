"""Every long-running command stops cleanly on SIGTERM and on SIGINT, whatever signal
dispositions it inherited: each runs here as a non-interactive shell starts a background
job, with SIGINT ignored (Python then installs no KeyboardInterrupt handler)."""

from __future__ import annotations

import concurrent.futures
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
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


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
    """The worker leaves the pool and exits 128 + the signal's number; the proxy then
    drains and exits 0."""
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
    assert stop(worker, signum) == 128 + signum
    _poll(lambda: not _ready(url), proxy, 30, "the proxy still counts the worker")
    assert stop(proxy, signum) == 0


@SIGNALS
def test_up_stops_on_a_signal(
    tiny_model_dir: Path, processes: list[subprocess.Popen[str]], signum: signal.Signals
) -> None:
    """`rollout-relay up` (proxy and in-process worker) exits 128 + the signal's number."""
    up = _start("up", "--port", str(_free_port()), "--model", str(tiny_model_dir))
    processes.append(up)
    _until_line(up, "rollout-relay is up")
    assert stop(up, signum) == 128 + signum


@SIGNALS
def test_task_server_stops_on_a_signal(
    processes: list[subprocess.Popen[str]], signum: signal.Signals
) -> None:
    """`rollout-relay task-server` exits 0."""
    server = _start("task-server", "--port", str(_free_port()), "--token", "t")
    processes.append(server)
    _until_line(server, "rollout-relay task server listening on")
    assert stop(server, signum) == 0


# A command whose cleanup (its ``finally``) waits, in a thread as an engine's close does,
# for a line on its stdin; it says when it starts cleaning up and when it is done.
SLOW_CLEANUP = """
import asyncio, sys
from rollout_relay import cli

cli.CUT_SECONDS = float(sys.argv[1])

async def command():
    print("started", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        print("cleaning", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print("cleaned", flush=True)

try:
    cli._run_loop(command())
except cli.Stopped as stopped:
    sys.exit(stopped.exit_status)
"""


def _line_within(process: subprocess.Popen[str], starts: str, seconds: float = 30) -> str:
    """``_until_line`` with a bound (scaled by the suite's factor): a process that prints
    neither the line nor exits within it is killed, and the test fails."""
    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        line = reader.submit(_until_line, process, starts)
        try:
            return line.result(seconds * TIMEOUT_FACTOR)
        except concurrent.futures.TimeoutError:
            process.kill()
            pytest.fail(f"no line starting {starts!r} within {seconds}s; killed")


def _slow_cleanup(cut_seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_CLEANUP, str(cut_seconds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ignoring_sigint,
    )


def test_a_second_signal_lets_the_cleanup_finish(
    processes: list[subprocess.Popen[str]],
) -> None:
    """SIGTERM, then SIGINT during the cleanup: the cleanup still finishes, the second
    signal is acknowledged on stderr, and the exit status is 128 + SIGTERM's number."""
    command = _slow_cleanup(cut_seconds=600)
    processes.append(command)
    _line_within(command, "started")
    command.send_signal(signal.SIGTERM)
    _line_within(command, "cleaning")
    command.send_signal(signal.SIGINT)
    _line_within(command, "rollout-relay: SIGINT again")
    assert command.stdin is not None
    command.stdin.write("done\n")
    command.stdin.flush()
    _line_within(command, "cleaned")
    assert command.wait(30 * TIMEOUT_FACTOR) == 128 + signal.SIGTERM


def test_a_third_signal_cuts_the_cleanup_within_a_bound(
    processes: list[subprocess.Popen[str]],
) -> None:
    """A third signal cuts a cleanup that does not end, saying so on stderr; the process
    exits 128 + the first signal's number within the bound even though the cleanup's
    thread is still blocked."""
    command = _slow_cleanup(cut_seconds=1)
    processes.append(command)
    _line_within(command, "started")
    command.send_signal(signal.SIGINT)
    _line_within(command, "cleaning")
    command.send_signal(signal.SIGTERM)
    _line_within(command, "rollout-relay: SIGTERM again")
    command.send_signal(signal.SIGTERM)
    _line_within(command, "rollout-relay: SIGTERM a third time")
    assert command.wait(30 * TIMEOUT_FACTOR) == 128 + signal.SIGINT
