"""`rollout-relay train` (what `make train` runs) as a user runs it: a separate process
that starts its proxy and worker, trains, prints a line per step and a verdict, and
writes the plot and the figures; bad settings are refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_relay.cli import main
from tests.e2e.conftest import TIMEOUT_FACTOR


@pytest.mark.e2e
def test_train_runs_end_to_end_and_reports_each_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two steps: a line each with reward, gap and versions, the on-policy verdict, exit
    0, and train.json / train.png in --out."""
    out = tmp_path / "train"
    command = [sys.executable, "-m", "rollout_relay.cli", "train", "--model", str(tiny_model_dir)]
    command += ["--steps", "2", "--generations", "2", "--prompts-per-step", "2"]
    command += ["--out", str(out)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300 * TIMEOUT_FACTOR, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step   0", "step   1"]
    assert "versions [0]" in steps[0]
    assert "versions [1]" in steps[1]
    assert any(line.startswith("on-policy: largest gap") for line in lines)
    figures = json.loads((out / "train.json").read_text())
    assert figures["on_policy"] is True
    assert [s["versions"] for s in figures["steps"]] == [[0], [1]]
    assert (out / "train.png").read_bytes()[:4] == b"\x89PNG"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--generations", "1", "--generations must be at least 2"),
        ("--steps", "0", "--steps must be at least 1"),
        ("--learning-rate", "0", "--learning-rate must be positive"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(
    flag: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group of one, no steps or a learning rate of zero exit 2 with the reason."""
    assert main(["train", "--out", str(tmp_path / "out"), flag, value]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--backend", "vllm", "--moe"], "vLLM's CPU build returns no routed experts"),
        (["--backend", "vllm", "--routed-experts"], "vLLM's CPU build returns no routed experts"),
        (["--backend", "vllm", "--vllm-python", "/nowhere/python"], "run scripts/vllm-env.sh"),
        (["--backend", "vllm", "--proxy", "http://127.0.0.1:1"], "--proxy trains through"),
    ],
)
def test_vllm_settings_that_cannot_run_are_refused(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--backend vllm with the MoE or routing replay, without vLLM's side environment, or
    beside --proxy exits 2 with the reason before anything starts."""
    assert main(["train", "--out", str(tmp_path / "out"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sigterm_ends_a_vllm_run_through_its_cleanup() -> None:
    """While a run with a worker process is on, SIGTERM raises SystemExit(143) in the main
    thread, so the run's finally blocks stop the worker (it runs in a session of its own);
    the previous handler is back afterwards."""
    import os
    import signal

    from rollout_relay.train import _sigterm_exits

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as caught, _sigterm_exits():
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next line
    assert caught.value.code == 143
    assert signal.getsignal(signal.SIGTERM) == before
