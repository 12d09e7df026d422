"""Rollout routing replay (R3) for a transformers mixture-of-experts model: a forward pass
whose routers send each token to the experts the rollout engine chose for it.

The trainer's router still computes its own logits, so the gate weights of the chosen
experts, and their gradients, come from the trainer: only *which* experts is forced. For a
router that returns ``(router_logits, scores, indices)`` (Qwen3-MoE and its kin), replaying
means ``indices`` = the recorded experts and ``scores`` = the softmax of the router's own
logits gathered at them (renormalised over the chosen experts when the model sets
``norm_topk_prob``).

``replay_routing(model, rows)`` forces the routers for the forward passes run inside it:
``rows`` is ``[positions, layers, top_k]`` (the export's ``routed_experts``, or a sample's),
consumed in order, a forward of ``n`` tokens taking the next ``n`` rows. One sequence at a
time (batch size 1): the rows of a batch's sequences differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from sdk.exceptions import RoutingReplayError
from worker_client.routing import find_routers


@contextmanager
def replay_routing(model: Any, rows: np.ndarray[Any, Any]) -> Iterator[None]:
    """Within the block, ``model``'s routers route each token to its recorded experts."""
    import torch

    routers = find_routers(model)
    if not routers:
        raise RoutingReplayError("the model has no mixture-of-experts routers to replay")
    if rows.ndim != 3 or rows.shape[1] != len(routers) or rows.shape[2] != routers[0].top_k:
        raise RoutingReplayError(
            f"routing rows of shape {tuple(rows.shape)} do not fit a model of "
            f"{len(routers)} MoE layers with {routers[0].top_k} experts per token"
        )
    if rows.size and int(rows.max()) >= int(routers[0].num_experts):
        raise RoutingReplayError(
            f"routing names expert {int(rows.max())} of {routers[0].num_experts}"
        )
    recorded = torch.from_numpy(rows.astype(np.int64))
    at = [0] * len(routers)

    def forced(layer: int, router: Any) -> Any:
        def forward(hidden_states: Any) -> tuple[Any, Any, Any]:
            hidden = hidden_states.reshape(-1, router.weight.shape[1])
            start, count = at[layer], hidden.shape[0]
            if start + count > recorded.shape[0]:
                raise RoutingReplayError(
                    f"the forward runs {start + count} positions; the routing has "
                    f"{recorded.shape[0]}"
                )
            at[layer] = start + count
            logits = torch.nn.functional.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            indices = recorded[start : start + count, layer].to(logits.device)
            scores = probs.gather(1, indices)
            if getattr(router, "norm_topk_prob", False):
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), indices

        return forward

    for layer, router in enumerate(routers):
        router.forward = forced(layer, router)  # the instance's, over its class's
    try:
        yield
    finally:
        for router in routers:
            del router.forward
