"""Which experts a transformers mixture-of-experts model routes each token to, read from its
routers while it runs (rollout routing replay, R3, records these at rollout).

A router of a transformers MoE (``Qwen3MoeTopKRouter`` and its kin) returns
``(router_logits, scores, indices)``, ``indices`` of shape ``[tokens, top_k]``.
``generate()`` drops router outputs, so ``RoutingCapture`` hooks every router and keeps the
indices of each forward pass, layer by layer. The rows come out as one array
``[positions, layers, top_k]``, ``uint8`` when the model has at most 256 experts, else
``uint16``: row ``i`` is the position whose hidden state the routers saw in the ``i``-th
token run forward (a prompt's tokens, then each sampled token but the last, which is never
run forward).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker_client.exceptions import EngineError

# A decoder layer's MoE router, e.g. ``model.layers.3.mlp.gate``.
_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


@dataclass(slots=True, frozen=True)
class RoutingShape:
    """What routing rows of one model look like: MoE layers, experts per token, experts."""

    layers: int
    top_k: int
    experts: int

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(np.uint8 if self.experts <= 256 else np.uint16)


def find_routers(model: Any) -> list[Any]:
    """The model's MoE routers in layer order (empty for a dense model): modules named
    ``layers.<i>.mlp.gate`` that pick ``top_k`` of ``num_experts``."""
    found: list[tuple[int, Any]] = []
    for name, module in model.named_modules():
        match = _ROUTER_NAME.search(name)
        if match and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            found.append((int(match.group(1)), module))
    return [module for _, module in sorted(found, key=lambda pair: pair[0])]


def routing_shape(model: Any) -> RoutingShape | None:
    """The model's routing shape, or None when it has no routers."""
    routers = find_routers(model)
    if not routers:
        return None
    return RoutingShape(len(routers), int(routers[0].top_k), int(routers[0].num_experts))


class RoutingCapture:
    """Hooks every router of ``model`` while active (``with``); ``rows()`` is every token
    run forward since, in order."""

    def __init__(self, model: Any) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise EngineError("the model has no mixture-of-experts routers to capture")
        shape = routing_shape(model)
        assert shape is not None
        self.shape = shape
        self._steps: list[list[Any]] = [[] for _ in self.routers]
        self._hooks: list[Any] = []

    def __enter__(self) -> RoutingCapture:
        for layer, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(self._keeper(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _keeper(self, layer: int) -> Any:
        def keep(module: Any, args: Any, output: Any) -> None:
            self._steps[layer].append(output[2].detach().to("cpu"))

        return keep

    def rows(self) -> np.ndarray[Any, Any]:
        """``[positions, layers, top_k]`` in the shape's dtype."""
        import torch

        counts = {len(steps) for steps in self._steps}
        if len(counts) != 1:
            raise EngineError("the routers ran a different number of times")
        if not self._steps[0]:
            return np.zeros((0, self.shape.layers, self.shape.top_k), self.shape.dtype)
        layers = [torch.cat(steps, dim=0) for steps in self._steps]
        stacked = torch.stack(layers, dim=1)  # [positions, layers, top_k]
        return stacked.numpy().astype(self.shape.dtype)

    def clear(self) -> None:
        for steps in self._steps:
            steps.clear()


@contextmanager
def capture_routing(model: Any) -> Iterator[RoutingCapture]:
    with RoutingCapture(model) as capture:
        yield capture
