"""Fidelity with rollout routing replay on the tiny mixture-of-experts model: a two-turn
episode's routing, captured while it was generated, replayed by the trainer reproduces
every sampled logprob; another routing does not; and the batched replay a trainer's
padded, shuffled, chunked forward passes use (TRL's GRPOTrainer) gives the same."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from sdk.exceptions import RoutingReplayError
from sdk.fidelity import check_fidelity, check_samples
from sdk.routing import BatchReplay, ReplayScorer
from sdk.samples import Sample, build_samples, encode_routing
from tests.moe import padded_batch, two_turn_episode
from worker_client.tiny_moe import EXPERTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def episode(tiny_moe: Any, tiny_moe_prompt: torch.Tensor) -> tuple[dict[str, Any], Any]:
    return two_turn_episode(tiny_moe, tiny_moe_prompt)


def _shifted(export: dict[str, Any], rows: np.ndarray[Any, Any]) -> dict[str, Any]:
    moved = ((rows.astype(np.int64) + 1) % EXPERTS).astype(rows.dtype)
    traj = {**export["trajectories"][0], "routed_experts": encode_routing(moved)}
    return {**export, "trajectories": [traj]}


def test_replayed_routing_reproduces_every_sampled_logprob(
    tiny_moe: Any, episode: tuple[dict[str, Any], Any]
) -> None:
    """Samples built from the export, re-scored with their rows replayed, match within
    1e-4 on all 24 sampled tokens; the export itself too; with each token's experts
    shifted by one they are off by more than half a nat."""
    export, rows = episode
    scorer = ReplayScorer(tiny_moe)
    samples = build_samples(export)
    assert samples[0].routed_experts is not None
    report = check_samples(samples, scorer)
    assert report.sampled_tokens == 24
    assert report.ok(1e-4), report
    assert check_fidelity(export, scorer).ok(1e-4)
    shifted = check_samples(build_samples(_shifted(export, rows)), scorer)
    assert shifted.max_abs_error > 0.5


def test_a_scorer_that_cannot_replay_is_not_used_silently(
    episode: tuple[dict[str, Any], Any],
) -> None:
    """A scorer without ``routed_experts=`` fails on a sample with routing."""
    samples = build_samples(episode[0])

    def text_only(prompt_ids: Any, response_ids: Any) -> list[float]:
        return [0.0] * len(response_ids)

    with pytest.raises(TypeError, match="routed_experts"):
        check_samples(samples, text_only)


def _batch_logprobs(model: Any, samples: list[Sample], **forward: Any) -> list[list[float]]:
    ids, mask, width = padded_batch(samples)
    logits = model(input_ids=ids, attention_mask=mask, **forward).logits.float()
    scores = logits[:, width - 1 : -1].log_softmax(-1)
    picked = scores.gather(-1, ids[:, width:, None])[..., 0]
    return [picked[b, : len(s.response_ids)].tolist() for b, s in enumerate(samples)]


def _gap(samples: list[Sample], scored: list[list[float]]) -> float:
    return max(
        abs(r - a)
        for s, row in zip(samples, scored, strict=True)
        for m, r, a in zip(s.response_mask, s.response_logprobs, row, strict=True)
        if m
    )


def test_batch_replay_forces_a_padded_shuffled_batch(
    tiny_moe: Any, episode: tuple[dict[str, Any], Any]
) -> None:
    """Two sequences of different lengths (the episode, and its first turn alone with
    its own rows), padded as TRL pads them and run in either order, in one forward or in
    chunks of one: every sampled logprob within 1e-4 under replay; shifted rows move them;
    paused, the model's own routing; an unregistered sequence is refused."""
    export, rows = episode
    (whole,) = build_samples(export)
    (first,) = build_samples(export, max_response_tokens=12)
    assert first.routed_experts is not None
    replay = BatchReplay(tiny_moe)
    for s in (whole, first):
        assert s.routed_experts is not None
        replay.add([*s.prompt_ids, *s.response_ids], s.routed_experts)
    with torch.no_grad(), replay:
        for batch in ([whole, first], [first, whole]):
            assert _gap(batch, _batch_logprobs(tiny_moe, batch)) < 1e-4
        assert _gap([first], _batch_logprobs(tiny_moe, [first])) < 1e-4
        with replay.paused():
            own = _batch_logprobs(tiny_moe, [whole])
        moved = ((rows.astype(np.int64) + 1) % EXPERTS).astype(rows.dtype)
        replay.add([*whole.prompt_ids, *whole.response_ids], moved)
        assert _gap([whole], _batch_logprobs(tiny_moe, [whole])) > 0.5
        replay.clear()
        with pytest.raises(RoutingReplayError, match="not registered"):
            _batch_logprobs(tiny_moe, [whole])
    # The tiny MoE's own routing agrees with its rollout's on CPU: unforced it is faithful.
    assert _gap([whole], own) < 1e-4
    assert "forward" not in vars(tiny_moe.model.layers[0].mlp.gate)


def test_batch_replay_survives_gradient_checkpointing(
    tiny_moe: Any, episode: tuple[dict[str, Any], Any]
) -> None:
    """The backward pass of a checkpointed forward runs the routers again: they replay
    the same rows, and the gradient reaches the routers' weights."""
    (whole,) = build_samples(episode[0])
    assert whole.routed_experts is not None
    tiny_moe.gradient_checkpointing_enable()
    tiny_moe.train()
    gate = tiny_moe.model.layers[0].mlp.gate.weight
    try:
        with BatchReplay(tiny_moe) as replay:
            replay.add([*whole.prompt_ids, *whole.response_ids], whole.routed_experts)
            scored = _batch_logprobs(tiny_moe, [whole])
            ids, mask, _ = padded_batch([whole])
            tiny_moe(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).sum().backward()
        assert _gap([whole], scored) < 1e-4
        assert gate.grad is not None
        assert gate.grad.abs().sum() > 0
    finally:
        tiny_moe.zero_grad(set_to_none=True)
        tiny_moe.gradient_checkpointing_disable()
        tiny_moe.eval()
