"""Routing capture and replay across transformers' mixture-of-experts architectures, each on
a tiny model built from its config (random weights, no download): its routers are found on
the layers its config routes to experts (DeepSeek's and GLM-4.5's dense first layers and
Qwen2-MoE's ``mlp_only_layers`` leave gaps), the experts captured while it generates are
teacher forcing's on every (position, layer), and replaying them (``sdk.routing``)
reproduces the logprobs of its own routing while another routing moves them. An MoE model
whose routers are not read is refused by name, and a dense one has none."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from sdk.exceptions import RoutingReplayError
from sdk.routing import BatchReplay, ReplayScorer, replay_routing
from worker_client.backends.hf import HFEngine
from worker_client.exceptions import EngineError
from worker_client.routing import (
    ROUTER_KINDS,
    RoutingCapture,
    find_routers,
    moe_layers,
    routing_shape,
    shape_from_config,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXPERTS = 8
TOP_K = 2
BASE: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "num_experts_per_tok": TOP_K,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": None,
}
# DeepSeek's multi-head latent attention: as many key/value heads as heads.
MLA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
HYBRID: dict[str, Any] = {  # Qwen3-Next's and Qwen3.5's gated delta net layers
    "layer_types": ["linear_attention", "full_attention"],
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
# Architecture: (config class, its settings over BASE, the router's class).
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": EXPERTS, "moe_intermediate_size": 16, "norm_topk_prob": True},
        "Qwen3MoeTopKRouter",
    ),
    "qwen2_moe": (  # shared expert; layer 0 dense
        "Qwen2MoeConfig",
        {
            "num_experts": EXPERTS,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "num_hidden_layers": 3,
            "mlp_only_layers": [0],
        },
        "Qwen2MoeTopKRouter",
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": EXPERTS}, "MixtralTopKRouter"),
    "olmoe": ("OlmoeConfig", {"num_experts": EXPERTS}, "OlmoeTopKRouter"),
    "deepseek_v2": (  # grouped top-k, shared expert, layer 0 dense
        "DeepseekV2Config",
        {
            **MLA,
            "n_routed_experts": EXPERTS,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "q_lora_rank": None,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
        "DeepseekV2TopkRouter",
    ),
    "deepseek_v3": (  # sigmoid, grouped top-k with a correction bias, layer 0 dense
        "DeepseekV3Config",
        {
            **MLA,
            "n_routed_experts": EXPERTS,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "q_lora_rank": 16,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
        },
        "DeepseekV3TopkRouter",
    ),
    "glm4_moe": (  # GLM-4.5
        "Glm4MoeConfig",
        {
            "n_routed_experts": EXPERTS,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
        },
        "Glm4MoeTopkRouter",
    ),
    "gpt_oss": (  # mlp.router, with a bias
        "GptOssConfig",
        {"num_local_experts": EXPERTS, "sliding_window": 16},
        "GptOssTopKRouter",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            **HYBRID,
            "num_experts": EXPERTS,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
        "Qwen3NextTopKRouter",
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        {
            **HYBRID,
            "num_experts": EXPERTS,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
        "Qwen3_5MoeTopKRouter",
    ),
}
# Routers in ROUTER_KINDS not built here, by their model: each has a built one's source.
SAME_SOURCE: dict[str, tuple[str, str]] = {
    "FlexOlmoTopKRouter": ("flex_olmo", "qwen3_moe"),
    "Qwen3OmniMoeThinkerTextTopKRouter": ("qwen3_omni_moe", "qwen3_moe"),
    "Qwen3VLMoeTextTopKRouter": ("qwen3_vl_moe", "qwen3_5_moe"),
    "MiniMaxTopKRouter": ("minimax", "mixtral"),
    "DeepseekV32TopkRouter": ("deepseek_v32", "glm4_moe"),
    "Dots1TopkRouter": ("dots1", "deepseek_v3"),
    "ExaoneMoeTopkRouter": ("exaone_moe", "deepseek_v3"),
    "Glm4MoeLiteTopkRouter": ("glm4_moe_lite", "glm4_moe"),
    "Glm4vMoeTextTopkRouter": ("glm4v_moe", "glm4_moe"),
    "GlmMoeDsaTopkRouter": ("glm_moe_dsa", "glm4_moe"),
    "BailingHybridTopkRouter": ("bailing_hybrid", "deepseek_v3"),
    "Glm5NextTextTopkRouter": ("glm5_next", "deepseek_v3"),
}
PROMPT = [5, 17, 33, 9, 41, 8, 60, 2]


def tiny(config_class: str, settings: dict[str, Any]) -> Any:
    """A tiny model from its config, its routers', experts' and embeddings' random weights
    scaled up so that tokens spread over the experts and which ones they go to matters."""
    config = getattr(transformers, config_class)(**{**BASE, **settings})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for router in find_routers(model):
            router.weight.mul_(30.0)
        for name, module in model.named_modules():
            if name.endswith("mlp.experts"):
                for weight in module.parameters():
                    weight.mul_(10.0)
        model.get_input_embeddings().weight.mul_(4.0)
    return model


def router_layers(model: Any) -> list[int]:
    routers = {id(router) for router in find_routers(model)}
    return [
        int(name.split("layers.")[1].split(".")[0])
        for name, module in model.named_modules()
        if id(module) in routers
    ]


def logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_capture_equals_teacher_forcing_and_replay_reproduces(architecture: str) -> None:
    config_class, settings, router_class = ARCHITECTURES[architecture]
    model = tiny(config_class, settings)
    assert {type(router).__name__ for router in find_routers(model)} == {router_class}
    assert router_layers(model) == moe_layers(model.config)
    shape = routing_shape(model)
    assert shape is not None
    assert shape == shape_from_config(model.config)
    assert (shape.top_k, shape.experts) == (TOP_K, EXPERTS)

    # Generation: prefill, then one token a step; the last sampled token is never run.
    torch.manual_seed(1)
    prompt = torch.tensor([PROMPT])
    with RoutingCapture(model) as during, torch.no_grad():
        out = model.generate(
            input_ids=prompt, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=0
        )
    ran = out[:, :-1]
    with RoutingCapture(model) as forced:
        own = logprobs(model, ran)
    rows = during.rows()
    assert rows.shape == (ran.shape[1], shape.layers, TOP_K)
    # The same experts (DeepSeek's and GLM's routers pick them unsorted).
    np.testing.assert_array_equal(np.sort(rows, -1), np.sort(forced.rows(), -1))

    with replay_routing(model, rows):
        replayed = logprobs(model, ran)
    assert torch.allclose(replayed, own, atol=1e-5, rtol=0)
    with BatchReplay(model) as batch:
        batch.add(out[0].tolist(), rows)
        batched = logprobs(model, ran)
    assert torch.allclose(batched, own, atol=1e-5, rtol=0)
    shifted = ((rows.astype(np.int64) + 1) % EXPERTS).astype(rows.dtype)
    with replay_routing(model, shifted):
        moved = logprobs(model, ran)
    assert float((moved - own).abs().max()) > 0.05


def router_source(model_type: str, router_class: str) -> tuple[str, set[str]]:
    """A router class's forward and the attributes its constructor sets."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    router = getattr(module, router_class)
    attributes = set(re.findall(r"self\.(\w+) = ", inspect.getsource(router.__init__)))
    return inspect.getsource(router.forward), attributes


@pytest.mark.parametrize("router_class", SAME_SOURCE)
def test_a_router_not_built_here_has_a_built_ones_source(router_class: str) -> None:
    """Such a router weighs its experts as the built one does (transformers' modular
    copies): if transformers changes one, this says so before replay goes wrong."""
    model_type, built = SAME_SOURCE[router_class]
    built_class = ARCHITECTURES[built][2]
    assert ROUTER_KINDS[router_class] == ROUTER_KINDS[built_class]
    assert router_source(model_type, router_class) == router_source(built, built_class)


def test_every_router_kind_is_built_or_has_a_built_ones_source() -> None:
    built = {router for _, _, router in ARCHITECTURES.values()}
    assert ROUTER_KINDS.keys() == built | SAME_SOURCE.keys()


UNSUPPORTED: dict[str, tuple[str, dict[str, Any], str]] = {
    # A router of another kind, where the others are.
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        {"moe_num_experts": EXPERTS, "moe_k": TOP_K, "moe_intermediate_size": 16},
        "class Ernie4_5_MoeTopKRouter",
    ),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        {"num_experts": EXPERTS, "moe_topk": TOP_K},
        "class HunYuanMoEV1Gate",
    ),
    # Routers elsewhere (block_sparse_moe.router, feed_forward.router): none found.
    "granitemoe": (
        "GraniteMoeConfig",
        {"num_local_experts": EXPERTS},
        r"routes layers \[0, 1\] to experts, but routers were found on layers \[\]",
    ),
    "llama4": (
        "Llama4TextConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 64},
        r"routes layers \[0, 1\] to experts, but routers were found on layers \[\]",
    ),
}


@pytest.mark.parametrize("architecture", UNSUPPORTED)
async def test_an_unsupported_architecture_is_refused(architecture: str) -> None:
    """Neither an empty router set (a dense model's) nor a set that may be wrong: a clear
    refusal, in capture and in replay; the hf backend serves it without routing."""
    config_class, settings, says = UNSUPPORTED[architecture]
    config = getattr(transformers, config_class)(**{**BASE, **settings})
    assert shape_from_config(config) is not None  # its config names experts
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for refused in (find_routers, routing_shape, RoutingCapture):
        with pytest.raises(EngineError, match=says):
            refused(model)
    for replayer in (BatchReplay, ReplayScorer):
        with pytest.raises(RoutingReplayError, match=says):
            replayer(model)
    rows = np.zeros((1, 2, TOP_K), np.uint8)
    with pytest.raises(RoutingReplayError, match=says), replay_routing(model, rows):
        pass
    engine = HFEngine(model, name=architecture, max_model_len=64, eos_token_ids=())
    try:
        assert engine.card.routing is None
    finally:
        await engine.close()


def test_routers_on_other_layers_than_the_config_says_are_refused() -> None:
    config_class, settings, _ = ARCHITECTURES["qwen3_moe"]
    model = tiny(config_class, settings)
    model.config.mlp_only_layers = [1]
    with pytest.raises(EngineError, match=r"routes layers \[0\] to experts, but routers"):
        find_routers(model)


def test_a_dense_model_has_no_routers() -> None:
    config = transformers.Qwen3Config(**{k: v for k, v in BASE.items() if "experts" not in k})
    model = AutoModelForCausalLM.from_config(config)
    assert find_routers(model) == []
    assert routing_shape(model) is None
    assert shape_from_config(config) is None
