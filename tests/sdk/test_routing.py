"""Rollout routing replay: a forward whose routers are forced to the experts recorded at
rollout reproduces the sampled logprobs; forcing another routing does not; rows that do not
fit the model are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from sdk.exceptions import RoutingReplayError
from sdk.routing import replay_routing
from tests.moe import generate
from worker_client.routing import RoutingCapture
from worker_client.tiny_moe import EXPERTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def scores(model: Any, prompt: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Teacher forcing: each sampled token's logprob."""
    full = torch.cat([prompt[0], sampled])[None, :-1]
    with torch.no_grad():
        logits = model(input_ids=full).logits[0]
    start = prompt.shape[1] - 1
    return logits[start:].log_softmax(-1).gather(1, sampled[:, None])[:, 0]


def test_replayed_routing_reproduces_the_sampled_logprobs(
    tiny_moe: Any, tiny_moe_prompt: torch.Tensor
) -> None:
    """With the routers forced to the rows captured at rollout, teacher forcing gives the
    sampled logprobs within 1e-4; forced to another routing (each token's experts shifted
    by one) it does not; outside the block the routers are the model's own again."""
    with RoutingCapture(tiny_moe) as capture:
        sampled, logprobs = generate(tiny_moe, tiny_moe_prompt)
    rows = capture.rows()
    with replay_routing(tiny_moe, rows):
        replayed = scores(tiny_moe, tiny_moe_prompt, sampled)
    assert torch.allclose(replayed, logprobs, atol=1e-4)
    shifted = ((rows.astype(np.int64) + 1) % EXPERTS).astype(rows.dtype)
    with replay_routing(tiny_moe, shifted):
        moved = scores(tiny_moe, tiny_moe_prompt, sampled)
    assert (moved - logprobs).abs().max() > 0.5
    assert torch.allclose(scores(tiny_moe, tiny_moe_prompt, sampled), logprobs, atol=1e-4)
    assert "forward" not in vars(tiny_moe.model.layers[0].mlp.gate)


def test_gradients_reach_the_routers_weights_under_replay(
    tiny_moe: Any, tiny_moe_prompt: torch.Tensor
) -> None:
    """Only which experts is forced: the chosen experts' gate weights come from the
    trainer's router, so the loss has a gradient on the router's weights."""
    with RoutingCapture(tiny_moe) as capture:
        sampled, _ = generate(tiny_moe, tiny_moe_prompt)
    gate = tiny_moe.model.layers[0].mlp.gate.weight
    gate.grad = None
    full = torch.cat([tiny_moe_prompt[0], sampled])[None, :-1]
    with replay_routing(tiny_moe, capture.rows()):
        tiny_moe(input_ids=full).logits.logsumexp(-1).sum().backward()
    assert gate.grad is not None
    assert gate.grad.abs().sum() > 0
    tiny_moe.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (np.zeros((4, 3, 2), np.uint8), "do not fit"),
        (np.zeros((4, 2, 1), np.uint8), "do not fit"),
        (np.full((4, 2, 2), EXPERTS, np.uint8), "names expert 8"),
    ],
)
def test_rows_that_do_not_fit_are_refused(
    tiny_moe: Any, rows: np.ndarray[Any, Any], match: str
) -> None:
    """Rows for another number of layers or experts per token, or naming an expert the
    model lacks, are refused before anything runs."""
    with pytest.raises(RoutingReplayError, match=match), replay_routing(tiny_moe, rows):
        pass


def test_a_forward_longer_than_the_rows_is_refused(
    tiny_moe: Any, tiny_moe_prompt: torch.Tensor
) -> None:
    """Routing recorded for fewer positions than the forward runs is an error, never a
    silent reuse of other rows."""
    rows = np.zeros((2, 2, 2), np.uint8)
    rows[:, :, 1] = 1
    with (
        pytest.raises(RoutingReplayError, match="the routing has 2"),
        replay_routing(tiny_moe, rows),
    ):
        tiny_moe(input_ids=tiny_moe_prompt)


def test_a_dense_model_cannot_replay(tiny_model_dir: Path) -> None:
    """A model without routers refuses replay."""
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with (
        pytest.raises(RoutingReplayError, match="no mixture-of-experts"),
        replay_routing(dense, np.zeros((1, 1, 1), np.uint8)),
    ):
        pass
