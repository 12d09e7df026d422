"""``examples/image_turn.py`` runs as its docstring says: two image turns through the real
proxy and worker, and a fidelity check that passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import TIMEOUT_FACTOR

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "image_turn.py"


def test_the_image_example_runs_and_its_fidelity_passes() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=300 * TIMEOUT_FACTOR,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 turns, one chain" in done.stdout
    assert done.stdout.count("(60 image tokens)") == 2
    assert "fidelity PASS" in done.stdout
