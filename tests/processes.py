"""Child processes in tests, waited for with a bound.

A test that waits on a process without a bound can hang the suite for good (a process
that ignores the signal it was sent never exits). Every wait here has a deadline; a
process still running at it is killed, and the test fails saying so.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.e2e.conftest import TIMEOUT_FACTOR


def stop(
    process: subprocess.Popen[bytes] | subprocess.Popen[str],
    signum: int = signal.SIGTERM,
    timeout: float = 30,
) -> int:
    """Send ``signum`` and return the exit code, waiting at most ``timeout`` seconds
    (scaled by the suite's factor); a process still running then is killed and the test
    fails."""
    if process.poll() is None:
        process.send_signal(signum)
    try:
        return process.wait(timeout * TIMEOUT_FACTOR)
    except subprocess.TimeoutExpired:
        reap(process)
        pytest.fail(
            f"process {process.pid} ({process.args!r}) still ran {timeout}s after "
            f"{signal.Signals(signum).name}; killed"
        )


def reap(process: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 30) -> None:
    """Kill ``process`` (if it still runs) and wait for it, at most ``timeout`` seconds."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout * TIMEOUT_FACTOR)


def ignoring_sigint() -> None:
    """``preexec_fn`` that starts a child as a non-interactive shell starts a background
    job: with SIGINT ignored, so that Python installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
