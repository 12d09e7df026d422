"""Which experts a transformers mixture-of-experts model routes each token to, read from its
routers while it runs (rollout routing replay, R3, records these at rollout).

A router of a transformers MoE (``Qwen3MoeTopKRouter`` and its kin: Qwen2/3-MoE, Qwen3-Next,
Qwen3.5-MoE, OLMoE, Mixtral, DeepSeek-V2/V3, GLM-4.5, gpt-oss and those in ``ROUTER_KINDS``)
returns ``(router_logits, scores, indices)``, ``indices`` of shape ``[tokens, top_k]``.
``find_routers`` finds them by name and class, and refuses an MoE model whose routers are
not of a class it knows or not on the layers its config routes to experts.
``generate()`` drops router outputs, so ``RoutingCapture`` hooks every router and keeps the
indices of each forward pass, layer by layer. The rows come out as one array
``[positions, layers, top_k]``, ``uint8`` when the model has at most 256 experts, else
``uint16``: row ``i`` is the position whose hidden state the routers saw in the ``i``-th
token run forward (a prompt's tokens, then each sampled token but the last, which is never
run forward).

The shape of a model's rows is the protocol's ``RoutingShape`` (``relay.protocol``): one
type from the routers to the wire. ``moe_layers`` says which decoder layers of a Hugging
Face config route to experts (as the model builds them), for engines that report every
decoder layer (vLLM and SGLang fill a dense layer's columns with nothing meaningful);
``engine_rows`` turns an engine's rows into the ``RoutedExperts`` a request asked for.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from relay.protocol import RoutedExperts, RoutingShape
from worker_client.exceptions import EngineError

__all__ = [
    "ROUTER_KINDS",
    "RoutedExperts",
    "RoutingCapture",
    "RoutingShape",
    "capture_routing",
    "engine_rows",
    "find_routers",
    "moe_layers",
    "pack_rows",
    "router_kind",
    "routing_shape",
    "rows_dtype",
    "shape_from_config",
    "unpack_rows",
]

# A decoder layer's MoE router, e.g. ``model.layers.3.mlp.gate`` (gpt-oss: ``mlp.router``).
_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:gate|router)$")

# The routers whose routing is read and replayed, by class (transformers 5.x), with their
# kind: how the router weighs the ``top_k`` experts it picks, which replay
# (``sdk.routing``) recomputes for the recorded experts. Every one returns
# ``(router_logits, scores, indices)``; how it picks (grouped top-k, a score correction
# bias) does not matter, the picks being recorded.
#   softmax: softmax over the experts, renormalised over the picked when norm_topk_prob
#   softmax-renormalised: the same, always renormalised
#   mixtral: the same, always renormalised, the gates left in float32
#   deepseek-v2: softmax over the experts in float32, times routed_scaling_factor
#   sigmoid: sigmoid in float32, renormalised when norm_topk_prob, times
#       routed_scaling_factor
#   gpt-oss: softmax over the picked experts' logits (with the router's bias)
# The tests build a tiny model of each architecture whose router is listed first in its
# kind's group below and check capture and replay on it; the others' routers have the same
# source as one of those (tests/worker_client/test_moe_architectures.py checks that too).
ROUTER_KINDS: dict[str, str] = {
    "Qwen3MoeTopKRouter": "softmax",
    "Qwen2MoeTopKRouter": "softmax",
    "OlmoeTopKRouter": "softmax",
    "FlexOlmoTopKRouter": "softmax",
    "Qwen3NextTopKRouter": "softmax",
    "Qwen3OmniMoeThinkerTextTopKRouter": "softmax",
    "Qwen3_5MoeTopKRouter": "softmax-renormalised",
    "Qwen3VLMoeTextTopKRouter": "softmax-renormalised",
    "MixtralTopKRouter": "mixtral",
    "MiniMaxTopKRouter": "mixtral",
    "DeepseekV2TopkRouter": "deepseek-v2",
    "DeepseekV3TopkRouter": "sigmoid",
    "DeepseekV32TopkRouter": "sigmoid",
    "Dots1TopkRouter": "sigmoid",
    "ExaoneMoeTopkRouter": "sigmoid",
    "Glm4MoeTopkRouter": "sigmoid",
    "Glm4MoeLiteTopkRouter": "sigmoid",
    "Glm4vMoeTextTopkRouter": "sigmoid",
    "GlmMoeDsaTopkRouter": "sigmoid",
    "BailingHybridTopkRouter": "sigmoid",
    "Glm5NextTextTopkRouter": "sigmoid",
    "GptOssTopKRouter": "gpt-oss",
}


def rows_dtype(shape: RoutingShape) -> np.dtype[Any]:
    """The numpy type of the shape's rows on the wire (little-endian)."""
    return np.dtype(shape.dtype).newbyteorder("<")


def router_kind(router: Any) -> str:
    """The kind of a router ``find_routers`` found (``ROUTER_KINDS``)."""
    return ROUTER_KINDS[type(router).__name__]


def find_routers(model: Any) -> list[Any]:
    """The model's MoE routers in layer order (empty for a dense model): the modules
    ``layers.<i>.mlp.gate`` (or ``.router``) that pick ``top_k`` of ``num_experts``.

    Raises ``EngineError`` rather than return routers that may be wrong: a router of a
    class not in ``ROUTER_KINDS``, routers of differing shapes, or routers on other layers
    than those the model's config says route to experts (``moe_layers``), none included.
    """
    found: list[tuple[int, Any]] = []
    for name, module in model.named_modules():
        match = _ROUTER_NAME.search(name)
        if match and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            found.append((int(match.group(1)), module))
    found.sort(key=lambda pair: pair[0])
    config = getattr(model, "config", None)
    expected = moe_layers(config) if config is not None else None
    what = type(model).__name__
    if not found and expected is None:
        return []
    unknown = sorted({type(m).__name__ for _, m in found} - ROUTER_KINDS.keys())
    if unknown:
        raise EngineError(
            f"{what}: routing is not supported for routers of class {', '.join(unknown)} "
            "(worker_client.routing.ROUTER_KINDS lists those it is)"
        )
    layers = [layer for layer, _ in found]
    if config is not None and layers != (expected or []):
        raise EngineError(
            f"{what}: its config routes layers {expected or []} to experts, but routers "
            f"were found on layers {layers}: routing is not supported for this architecture"
        )
    if len({(int(m.top_k), int(m.num_experts)) for _, m in found}) > 1:
        raise EngineError(f"{what}: its routers pick differing numbers of experts")
    return [module for _, module in found]


def routing_shape(model: Any) -> RoutingShape | None:
    """The model's routing shape, or None when it has no routers."""
    routers = find_routers(model)
    return _shape_of(routers) if routers else None


def _shape_of(routers: Sequence[Any]) -> RoutingShape:
    return RoutingShape(len(routers), int(routers[0].top_k), int(routers[0].num_experts))


class RoutingCapture:
    """Hooks every router of ``model`` while active (``with``); ``rows()`` is every token
    run forward since, in order."""

    def __init__(self, model: Any, routers: Sequence[Any] | None = None) -> None:
        """``routers``: the model's, found already (``find_routers``)."""
        self.routers = list(routers) if routers is not None else find_routers(model)
        if not self.routers:
            raise EngineError("the model has no mixture-of-experts routers to capture")
        self.shape = _shape_of(self.routers)
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
            return np.zeros((0, self.shape.layers, self.shape.top_k), rows_dtype(self.shape))
        layers = [torch.cat(steps, dim=0) for steps in self._steps]
        stacked = torch.stack(layers, dim=1)  # [positions, layers, top_k]
        return stacked.numpy().astype(rows_dtype(self.shape))

    def clear(self) -> None:
        for steps in self._steps:
            steps.clear()


@contextmanager
def capture_routing(model: Any) -> Iterator[RoutingCapture]:
    with RoutingCapture(model) as capture:
        yield capture


# --------------------------------------------------------------------------- engines' rows


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _text_config(config: Any) -> Any:
    """A vision-language config's language model part (``text_config``), else itself."""
    text = _get(config, "text_config")
    return text if text is not None and _get(config, "num_hidden_layers") is None else config


def moe_layers(config: Any) -> list[int] | None:
    """The decoder layers of a Hugging Face config (a ``config.json`` dict or a
    ``PretrainedConfig``) that route to experts, in order, as the model builds them; None
    for a dense model. Qwen2/Qwen3-MoE: every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers``; DeepSeek-V2/V3 and kin: from ``first_k_dense_replace`` on, every
    ``moe_layer_freq``-th; Mixtral, gpt-oss and the rest with experts: every layer."""
    config = _text_config(config)
    total = int(_get(config, "num_hidden_layers") or 0)
    experts = _experts(config)
    if total <= 0 or not experts:
        return None
    if _get(config, "n_routed_experts") is not None:  # DeepSeek-V2/V3, Kimi-K2, GLM-4.5
        first = int(_get(config, "first_k_dense_replace") or 0)
        freq = int(_get(config, "moe_layer_freq") or 1)
        layers = [i for i in range(first, total) if i % freq == 0]
    else:
        step = int(_get(config, "decoder_sparse_step") or 1)
        dense = {int(i) for i in _get(config, "mlp_only_layers") or ()}
        layers = [i for i in range(total) if i not in dense and (i + 1) % step == 0]
    return layers or None


def _experts(config: Any) -> int:
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = _get(config, key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _top_k(config: Any) -> int:
    for key in ("num_experts_per_tok", "experts_per_token", "moe_topk"):
        value = _get(config, key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def shape_from_config(config: Any) -> RoutingShape | None:
    """The routing shape of the model a Hugging Face config describes (None: dense, or a
    config that says too little: no experts per token)."""
    layers = moe_layers(config)
    text = _text_config(config)
    top_k = _top_k(text)
    if layers is None or top_k <= 0:
        return None
    return RoutingShape(len(layers), top_k, _experts(text))


def pack_rows(rows: np.ndarray[Any, Any], start: int, shape: RoutingShape) -> RoutedExperts:
    """Rows ``[n, layers, top_k]`` of positions ``[start, start + n)`` as sent."""
    if rows.ndim != 3 or rows.shape[1:] != (shape.layers, shape.top_k):
        raise EngineError(
            f"routing rows of shape {rows.shape} do not fit the model's "
            f"[positions, {shape.layers}, {shape.top_k}]"
        )
    data = np.ascontiguousarray(rows, dtype=rows_dtype(shape)).tobytes()
    return RoutedExperts(start, int(rows.shape[0]), data)


def unpack_rows(routed: RoutedExperts, shape: RoutingShape) -> np.ndarray[Any, Any]:
    """The rows a ``RoutedExperts`` carries, ``[rows, layers, top_k]``."""
    flat = np.frombuffer(routed.data, dtype=rows_dtype(shape))
    return flat.reshape(routed.rows, shape.layers, shape.top_k)


def engine_rows(
    rows: np.ndarray[Any, Any],
    shape: RoutingShape,
    *,
    end: int,
    start_from: int,
    layers: Sequence[int] | None = None,
    engine: str = "the engine",
) -> RoutedExperts:
    """An engine's rows as the request asked for them. ``rows`` ``[n, L, top_k]`` end at
    position ``end`` (prompt plus generated tokens, less the last one, never run forward),
    so they start at ``end - n``; ``L`` is the model's MoE layers, or every decoder layer
    (``layers`` then picks the MoE ones). Rows before ``start_from`` are dropped; an engine
    whose rows start later than asked is an error, and so is an expert id the model has
    not."""
    if rows.ndim != 3 or rows.shape[2] != shape.top_k:
        raise EngineError(
            f"{engine} returned routing of shape {rows.shape}, not [positions, layers, "
            f"{shape.top_k}]"
        )
    if rows.shape[1] != shape.layers:
        if layers is None or len(layers) != shape.layers or rows.shape[1] <= max(layers):
            raise EngineError(
                f"{engine} returned routing of {rows.shape[1]} layers; the model has "
                f"{shape.layers} mixture-of-experts layers"
            )
        rows = rows[:, list(layers)]
    start = end - int(rows.shape[0])
    if start < 0:
        raise EngineError(
            f"{engine} returned {rows.shape[0]} routing rows for {end} positions run forward"
        )
    if start > start_from:
        raise EngineError(
            f"{engine} returned routing from position {start}; it was asked from {start_from}"
        )
    rows = rows[start_from - start :]
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= shape.experts):
        raise EngineError(f"{engine} returned an expert id outside 0..{shape.experts - 1}")
    return pack_rows(rows, start_from, shape)
