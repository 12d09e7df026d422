"""`rollout-relay demo` (what `make demo` runs), as a user runs it: a separate process on
the tiny model telling its story without log noise, an episode with a rewrite and a
resume, a passing fidelity check, and with --keep a viewer that stays up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.processes import ignoring_sigint, reap, stop


def _demo(tiny_model_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollout_relay.cli",
        "demo",
        "--port",
        "0",
        "--model",
        str(tiny_model_dir),
        *extra,
    ]


def test_demo_tells_the_episode_and_passes_the_fidelity_check(tiny_model_dir: Path) -> None:
    done = subprocess.run(
        _demo(tiny_model_dir),
        capture_output=True,
        text=True,
        timeout=300 * TIMEOUT_FACTOR,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    steps = [line[:5] for line in done.stdout.splitlines() if line.startswith("[")]
    assert steps == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    assert "replaced its history with a summary" in out
    assert "went back to an earlier point" in out
    assert "fidelity PASS" in out
    assert "no authentication: a local demo on loopback" in out
    assert "viewer: http://127.0.0.1:" in out
    # The story only: access logs, library progress bars and warnings go to the log file.
    assert "proxy.access" not in out
    assert "Loading weights" not in out
    assert "WARNING" not in out
    assert done.stderr == ""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_demo_keep_leaves_the_viewer_up(tiny_model_dir: Path, signum: signal.Signals) -> None:
    """With --keep the demo ends by printing the viewer's URL and stays up: the page and
    the episode's data are there until Ctrl-C or SIGTERM, which stop it cleanly (exit
    128 + the signal's number), even when it was started as a background job is (SIGINT
    ignored)."""
    process = subprocess.Popen(
        _demo(tiny_model_dir, "--keep"),
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=ignoring_sigint,
    )
    try:
        assert process.stdout is not None
        url = next(line.split()[1] for line in process.stdout if line.startswith("viewer: "))
        base, trial = url.split("/ui/#")
        with urllib.request.urlopen(f"{base}/ui/", timeout=10) as page:
            assert "viewer.js" in page.read().decode()
        with urllib.request.urlopen(f"{base}/ui/api/sessions/{trial}", timeout=10) as data:
            assert len(json.load(data)["turns"]) >= 3
        assert stop(process, signum) == 128 + signum
        assert process.stdout.read().strip() == "stopped"
    finally:
        reap(process)
        if process.stdout is not None:
            process.stdout.close()
