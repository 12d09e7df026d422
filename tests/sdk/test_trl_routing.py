"""Routing replay in TRL's GRPOTrainer: the rollout registers a batch's sequences with
their recorded experts, and TRL's own per-token logprob code (its fused LM head, its
padding and chunking) then runs under the replay and reproduces the sampled logprobs; the
gap is measured with and without it. (The episodes come from the tiny MoE directly; the
proxy's recording is exercised by ``rollout-relay train --moe --routed-experts``.)"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from sdk.exceptions import RoutingReplayError
from sdk.samples import BranchPolicy, Sample, build_samples
from sdk.trl import RelayRollout, RolloutBatch
from tests.moe import chat_prompt, load_moe, padded_batch, two_turn_episode
from worker_client.tiny_moe import EXPERTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rollout() -> RelayRollout:
    """A rollout whose agent loop asks for routing (nothing else of it is used here)."""
    agent_loop: Any = SimpleNamespace(
        config=SimpleNamespace(branch_policy=BranchPolicy.LONGEST, routed_experts=True)
    )
    return RelayRollout(loop=Any, proxy=Any, agent_loop=agent_loop, checkpoint_dir=Path("."))  # type: ignore[arg-type]


def _trl_batch(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's layout, and the completions' padded width."""
    ids, mask, prompt_width = padded_batch(samples)
    return ids, mask, ids.shape[1] - prompt_width


def _trl_logprobs(model: Any, samples: list[Sample], chunk: int) -> torch.Tensor:
    """TRL's own ``_get_per_token_logps_and_entropies`` (fused LM head, chunks)."""
    ids, mask, width = _trl_batch(samples)
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
    )
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer,  # type: ignore[arg-type]
            model,
            ids,
            mask,
            width,
            batch_size=chunk,
        )
    return logps


def _gap(samples: list[Sample], logps: torch.Tensor) -> float:
    return max(
        abs(float(logps[b, i]) - r)
        for b, s in enumerate(samples)
        for i, (m, r) in enumerate(zip(s.response_mask, s.response_logprobs, strict=True))
        if m
    )


@pytest.fixture(scope="module")
def trl_model() -> Any:
    """A tiny MoE with TRL's fused LM head, as GRPOTrainer patches its model."""
    model = load_moe()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def test_trls_forward_replays_the_batchs_routing(trl_model: Any) -> None:
    export, rows = two_turn_episode(trl_model, chat_prompt())
    (whole,) = build_samples(export)
    (first,) = build_samples(export, max_response_tokens=12)
    rollout = _rollout()
    replay = rollout.replay_batch(trl_model, [whole, first])
    try:
        for batch, chunk in (([whole, first], 2), ([first, whole], 1)):
            assert _gap(batch, _trl_logprobs(trl_model, batch, chunk)) < 1e-4
        measured = RolloutBatch(step=0, results=[], samples=[whole, first], seconds=0.0)
        rollout.measure(trl_model, measured)
        assert measured.gap_r3 is not None
        assert measured.gap_r3 < 1e-4
        assert measured.gap_r3_mean is not None
        assert measured.gap_mean is not None
        assert measured.gap is not None
        # The next batch replaces the rows: shifted ones move the logprobs.
        moved = ((rows.astype(np.int64) + 1) % EXPERTS).astype(rows.dtype)
        shifted = Sample(
            **{**{k: getattr(whole, k) for k in whole.__slots__}, "routed_experts": moved}
        )
        assert rollout.replay_batch(trl_model, [shifted]) is replay
        assert _gap([whole], _trl_logprobs(trl_model, [whole], 1)) > 0.5
        # A sequence the batch does not hold (longer than any it holds) is refused.
        rollout.replay_batch(trl_model, [first])
        with pytest.raises(RoutingReplayError, match="not registered"):
            _trl_logprobs(trl_model, [whole], 1)
        unrouted = Sample(
            **{**{k: getattr(whole, k) for k in whole.__slots__}, "routed_experts": None}
        )
        with pytest.raises(RoutingReplayError, match="no routing"):
            rollout.replay_batch(trl_model, [unrouted])
    finally:
        replay.remove()
