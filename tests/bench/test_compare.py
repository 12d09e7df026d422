"""``python -m bench.compare`` at a tiny size: every checkout's own proxy and worker run
each mode, and the table holds a figure per round (no speed is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bench.compare import Cell, table
from tests.e2e.conftest import TIMEOUT_FACTOR

REPO = Path(__file__).resolve().parents[2]


def _compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.compare", *args],
        cwd=REPO,
        check=False,
        timeout=240 * TIMEOUT_FACTOR,
        capture_output=True,
        text=True,
    )


def test_a_checkout_compared_with_itself_gets_a_figure_per_mode_and_round(
    tiny_model_dir: Path,
) -> None:
    done = _compare(
        *(str(REPO), "."),
        *("--streams", "2", "--rounds", "1", "--pace", "200", "--tokens", "8"),
        *("--turns-per-stream", "2", "--model", str(tiny_model_dir)),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == f"| proxy CPU µs per token (worker's) | {REPO} | . |"
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| streamed, 2 streams",
        "| whole, 2 streams",
        "| grouped, 2 streams",
    ]
    for row in rows[1:]:
        cells = row.strip("| ").split(" | ")[1:]
        assert all(re.fullmatch(r"\d+ \(\d+\)", c) for c in cells), row  # no errors, no "-"


def test_a_directory_that_is_no_checkout_is_refused(tmp_path: Path) -> None:
    done = _compare(str(tmp_path))
    assert done.returncode == 2
    assert "is not a checkout of rollout-relay" in done.stderr


def test_table_keeps_rounds_in_order_and_marks_what_a_proxy_cannot_run() -> None:
    cells = [
        Cell("old", "streamed", 32, 55.4, 20.0),
        Cell("new", "streamed", 32, 40.6, 12.2),
        Cell("old", "grouped", 32, None),
        Cell("new", "grouped", 32, 25.0, 11.0, errors=1),
        Cell("old", "streamed", 32, 52.6, 19.0),
        Cell("new", "streamed", 32, 33.5, 12.0),
    ]
    assert table(cells, ["old", "new"]).splitlines() == [
        "| proxy CPU µs per token (worker's) | old | new |",
        "|---|---:|---:|",
        "| streamed, 32 streams | 55 (20), 53 (19) | 41 (12), 34 (12) |",
        "| grouped, 32 streams | - | 25 (11), 1 errors |",
    ]
