"""`rollout-relay demo` (what `make demo` runs), as a user runs it: a separate process on
the tiny model, an episode with a rewrite and a resume, and a passing fidelity check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import TIMEOUT_FACTOR


def test_demo_runs_an_episode_and_passes_the_fidelity_check(tiny_model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "demo", "--port", "0", "--model", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300 * TIMEOUT_FACTOR,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "branches made on purpose: history_rewritten, resumed_older_point" in out
    assert "fidelity PASS" in out
    assert "no auth: local demo only" in out  # the demo says loudly that it runs open
