"""``rollout-relay train`` in short form: TRL's GRPOTrainer takes a few steps on agent
episodes run through a real proxy and hf worker, the weights pushed to the worker after
every step; every step is on-policy and every token carries the step that sampled it."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.train import GAP_LIMIT, TrainReport, TrainSettings, train
from sdk.trl import BackgroundLoop, on_policy_gap
from tests.e2e.conftest import TIMEOUT_FACTOR

pytestmark = pytest.mark.e2e

ADMIN = "admin-secret"
WORKER = "worker-secret"
STEPS = 3


def _train(model_dir: Path, tmp_path: Path, settings: TrainSettings) -> TrainReport:
    """``rollout-relay train`` against a real proxy and an hf worker on ``model_dir``."""
    config = ProxyConfig(
        port=0, admin_token=ADMIN, worker_token=WORKER, cache_dir=tmp_path / "proxy-cache"
    )

    async def start() -> RunningProxy:
        running = await start_proxy(config)
        start_hf_worker(running, model_dir, worker_id="train-hf", token=WORKER)
        await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        return running

    with BackgroundLoop() as loop:
        running = loop.run(start())
        try:
            return train(
                running.url,
                model_dir,
                tmp_path / "out",
                loop=loop,
                admin_token=ADMIN,
                settings=settings,
                say=lambda _: None,
            )
        finally:
            loop.run(running.stop())


def test_a_short_training_run_is_on_policy_at_every_step(
    tiny_model_dir: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    """Each step's batch is sampled by exactly the trainer's weights of that step (gap and
    versions), and the pushed weights are not the ones the worker started with."""
    import torch
    from transformers import AutoModelForCausalLM

    # Six episodes per group: a step whose groups all got one reward trains nothing, and
    # that happening at every step before the last would leave the weights unchanged.
    settings = TrainSettings(steps=STEPS, prompts_per_step=2, generations=6, learning_rate=5e-3)
    report = _train(tiny_model_dir, tmp_path, settings)

    assert [s.step for s in report.steps] == list(range(STEPS))
    for figures in report.steps:
        assert figures.episodes == 12
        assert figures.sampled_tokens > 0
        assert figures.versions == [figures.step]
        assert figures.off_step_tokens == 0
        assert figures.gap <= GAP_LIMIT
    assert report.on_policy
    for batch in report.batches:
        for sample in batch.samples:
            assert sample.response_versions == [
                batch.step if m else -1 for m in sample.response_mask
            ]
    # The last batch, sampled by version STEPS - 1, under the weights of version 0.
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert on_policy_gap(original, report.batches[-1].samples) > 10 * GAP_LIMIT
    assert (tmp_path / "out" / "train.png").stat().st_size > 0
    assert (tmp_path / "out" / "train.json").is_file()


def test_the_tiny_moe_trains_with_routing_replay(tmp_path: Path, one_torch_thread: None) -> None:
    """``make train-moe`` in short form: the session records routing, the trainer's forward
    replays it, and every step is on-policy with the routers forced to the rollout's
    experts (the replayed gap is measured, not skipped). The tiny MoE calls the rewarded
    tool in some episodes and not in others: GRPO has something to learn from (an MoE that
    never called it got reward 0 in every episode, every advantage zero)."""
    from worker_client.tiny_moe import SHIPPED_TINY_MOE

    settings = TrainSettings(
        steps=2, prompts_per_step=4, generations=8, learning_rate=5e-3, routed_experts=True
    )
    report = _train(SHIPPED_TINY_MOE, tmp_path, settings)
    assert report.on_policy
    for figures in report.steps:
        assert figures.sampled_tokens > 0
        assert figures.versions == [figures.step]
        assert figures.gap_r3 <= GAP_LIMIT  # a number: NaN would fail this
    for batch in report.batches:
        assert all(sample.routed_experts is not None for sample in batch.samples)
    # The shipped MoE's own episodes (step 0; the report keeps only the last step's batch,
    # sampled after an update this large learning rate may have spoiled): ~20% call the
    # tool, so 32 episodes all alike would take odds below one in a thousand.
    assert 0.0 < report.steps[0].mean_reward < 1.0, report.steps[0]
