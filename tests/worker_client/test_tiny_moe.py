"""The tiny mixture-of-experts model, and routing read from its routers: what the project
ships is what the generator writes, the experts captured while it generates are the ones
teacher forcing routes to on every (token, layer), and a dense model has no routers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout_relay.cli import main
from tests.moe import generate
from worker_client.exceptions import EngineError
from worker_client.routing import RoutingCapture, find_routers, routing_shape
from worker_client.tiny_moe import EXPERTS, LAYERS, SHIPPED_TINY_MOE, TOP_K, write_tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_shipped_moe_is_the_generators_output(tmp_path: Path) -> None:
    """The shipped tiny MoE is what ``write_tiny_moe`` writes for seed 0: the same
    tokenizer, template and configuration, and weights of the same names and shapes,
    trained from the seed's scaled initialisation (their values come from training, which
    rounds differently on each processor). A change to the generator fails here until
    ``rollout-relay tiny-model --moe worker_client/assets/tiny-moe`` writes it again."""
    fresh = write_tiny_moe(tmp_path / "fresh", seed=0, imprint=False)
    assert sorted(p.name for p in SHIPPED_TINY_MOE.iterdir()) == sorted(
        p.name for p in fresh.iterdir()
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (SHIPPED_TINY_MOE / name).read_bytes() == (fresh / name).read_bytes(), name
    for name in ("config.json", "generation_config.json"):
        ours, theirs = (
            json.loads((d / name).read_text()) | {"transformers_version": None}
            for d in (SHIPPED_TINY_MOE, fresh)
        )
        assert ours == theirs, name
    shipped = load_file(SHIPPED_TINY_MOE / "model.safetensors")
    initial = load_file(fresh / "model.safetensors")
    assert {k: v.shape for k, v in shipped.items()} == {k: v.shape for k, v in initial.items()}
    # Trained, not the seed's scaled initialisation.
    assert any(not torch.equal(shipped[k], initial[k]) for k in shipped)


def test_an_untrained_moe_is_the_seeds_alone(tmp_path: Path) -> None:
    """Without imprinting, the same seed writes the same weights; another seed others."""
    a = load_file(write_tiny_moe(tmp_path / "a", seed=3, imprint=False) / "model.safetensors")
    b = load_file(write_tiny_moe(tmp_path / "b", seed=3, imprint=False) / "model.safetensors")
    c = load_file(write_tiny_moe(tmp_path / "c", seed=4, imprint=False) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_its_routers_are_found_in_layer_order(tiny_moe: Any, tiny_model_dir: Path) -> None:
    """Each MoE layer's router is found, in order, with its experts per token; a dense
    model has none, and capturing it is refused."""
    routers = find_routers(tiny_moe)
    assert routers == [layer.mlp.gate for layer in tiny_moe.model.layers]
    shape = routing_shape(tiny_moe)
    assert shape is not None
    assert (shape.layers, shape.top_k, shape.experts) == (LAYERS, TOP_K, EXPERTS)
    assert shape.dtype == "uint8"
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert find_routers(dense) == []
    assert routing_shape(dense) is None
    with pytest.raises(EngineError, match="no mixture-of-experts routers"):
        RoutingCapture(dense)


def test_routing_captured_in_generation_equals_teacher_forcing(
    tiny_moe: Any, tiny_moe_prompt: torch.Tensor
) -> None:
    """The experts captured while the model generates (prefill, then one sampled token per
    step) are the ones a teacher-forced forward of the same tokens routes to, on every
    position run forward (all but the last sampled token) and every layer."""
    with RoutingCapture(tiny_moe) as during:
        sampled, _ = generate(tiny_moe, tiny_moe_prompt)
    rows = during.rows()
    length = tiny_moe_prompt.shape[1] + len(sampled) - 1
    assert rows.shape == (length, LAYERS, TOP_K)
    assert rows.dtype == np.uint8
    full = torch.cat([tiny_moe_prompt[0], sampled])[None, :-1]
    with RoutingCapture(tiny_moe) as forced, torch.no_grad():
        tiny_moe(input_ids=full)
    assert np.array_equal(rows, forced.rows())
    # The routers do route: tokens spread over the experts.
    assert len(np.unique(rows)) > EXPERTS // 2


def test_the_cli_writes_one(tmp_path: Path) -> None:
    """``rollout-relay tiny-model --moe DIR`` writes a model with routers (untrained with
    --no-imprint, which takes seconds instead of minutes)."""
    assert main(["tiny-model", "--moe", "--no-imprint", str(tmp_path / "moe")]) == 0
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_the_cli_writes_one_vllm_runs(tmp_path: Path) -> None:
    """``--head-dim 32`` gives the MoE heads vLLM's CPU attention takes."""
    command = ["tiny-model", "--moe", "--no-imprint", "--head-dim", "32", str(tmp_path / "moe")]
    assert main(command) == 0
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["head_dim"] == 32
