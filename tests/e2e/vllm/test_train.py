"""``rollout-relay train`` on the real vLLM engine, in short form: TRL's GRPOTrainer (in the
project's .venv, where TRL lives; vLLM's environment has none) trains the text model for
two steps through a proxy whose worker is the shared engine, its weights pushed through
``POST /weights`` into vLLM before step 1, and every step is on-policy: the recorded
logprobs within 1e-4 of the trainer's own teacher forcing, every token of its step's
version. The reward curve is ``make train-vllm``'s, not a timed test's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.e2e.vllm.conftest import REPO, TIMEOUT_FACTOR, Served
from worker_client.client import ServedModel, WorkerClient

pytestmark = pytest.mark.e2e

GAP_LIMIT = 1e-4
STEPS = 2
# The trainer's Python: the project's environment, which has TRL (`make test` sets it up).
TRAIN_PYTHON = Path(os.environ.get("RELAY_TRAIN_PYTHON", REPO / ".venv" / "bin" / "python"))


def _trainer_missing() -> str | None:
    if not TRAIN_PYTHON.is_file():
        return f"no trainer environment at {TRAIN_PYTHON} (make test or make train sets it up)"
    probe = subprocess.run(
        [str(TRAIN_PYTHON), "-c", "import trl, matplotlib"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return f"{TRAIN_PYTHON} has no TRL (pip install -e '.[train]')"
    return None


async def _load(served: Served, checkpoint: Path) -> None:
    """Make the shared engine serve ``checkpoint`` (it is idle between tests)."""
    await served.engine.stage_weights(str(checkpoint))
    await served.engine.commit_weights(0)


@pytest.fixture
async def training_proxy(
    served: Served, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    """A proxy of its own, version 0, whose worker is the shared engine serving the text
    model; afterwards the engine serves again what the shared proxy has it serve."""
    async with ProxyClient(served.proxy.url) as shared:
        before = await shared.weights()
    restore = Path(before["path"]) if before.get("path") else served.model
    await _load(served, served.model)
    running = await start_proxy(
        ProxyConfig(
            port=0,
            worker_wait_seconds=30 * TIMEOUT_FACTOR,
            cache_dir=tmp_path_factory.mktemp("vllm-train-cache"),
        )
    )
    client = WorkerClient(
        running.worker_url, {"tiny": ServedModel(served.engine, served.model)}, worker_id="train"
    )
    running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    try:
        await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        yield running
    finally:
        await running.stop()
        await _load(served, restore)


async def test_grpo_through_vllm_is_on_policy_at_every_step(
    served: Served, training_proxy: RunningProxy, tmp_path: Path
) -> None:
    """Two GRPO steps through vLLM: each step's batch sampled by that step's weights (the
    second after a reload in vLLM), within 1e-4 of the trainer's teacher forcing."""
    missing = _trainer_missing()
    if missing is not None:
        pytest.skip(missing)
    log = tmp_path / "train.log"
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            *(str(TRAIN_PYTHON), "-m", "rollout_relay.cli", "train", "-v"),
            *("--proxy", training_proxy.url, "--model", str(served.model)),
            *("--steps", str(STEPS), "--out", str(tmp_path / "out")),
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            await asyncio.wait_for(process.wait(), 480 * TIMEOUT_FACTOR)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    said = log.read_text(errors="replace")
    assert process.returncode == 0, said[-4000:]
    report = json.loads((tmp_path / "out" / "train.json").read_text())
    assert [s["step"] for s in report["steps"]] == list(range(STEPS))
    for step in report["steps"]:
        assert step["sampled_tokens"] > 0, step
        assert step["gap"] <= GAP_LIMIT, step
        assert step["versions"] == [step["step"]], step
        assert step["off_step_tokens"] == 0, step
    async with ProxyClient(training_proxy.url) as proxy:
        weights = await proxy.weights()
    assert weights["version"] == STEPS - 1
    assert weights["path"] == str(tmp_path / "out" / "checkpoints" / f"step-{STEPS - 1}")
