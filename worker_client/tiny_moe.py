"""A tiny mixture-of-experts model of Qwen3-MoE's architecture, generated locally, for tests
of routing capture and replay on CPU.

``write_tiny_moe(dir)`` writes a ``Qwen3MoeForCausalLM`` that ``AutoModelForCausalLM`` loads
offline: two decoder layers of width 64, each an MoE block of 8 experts with 2 routed per
token (``norm_topk_prob``), on the tiny text model's tokenizer and ChatML template
(``tiny_model``). Its weights are random from the seed, its routers', experts' and embeddings' scaled up so
that which experts a token goes to matters to what the model samples: forcing another
routing moves the sampled tokens' logprobs by nats. About 0.39M parameters.

Then it is trained as the tiny text model is, on the same synthetic tool-using chats, so that
it calls the tools an agent offers some of the time: ``make train-moe`` rewards one of them,
and a policy that never calls it has nothing to learn from (every advantage zero). The
project ships one, written by ``write_tiny_moe(SHIPPED_TINY_MOE)`` (seed 0);
``rollout-relay tiny-model --moe DIR`` writes a new one (a few minutes on two cores).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker_client.tiny_model import (
    CONTEXT_WINDOW,
    IMPRINT_STEPS,
    SHIPPED_TINY_MODEL,
    imprint_tool_use,
    save_atomically,
    seeded_model,
)

# The model the project ships (package data; about 1.6 MB).
SHIPPED_TINY_MOE = Path(__file__).resolve().parent / "assets" / "tiny-moe"

EXPERTS = 8
TOP_K = 2
LAYERS = 2
# How much the random weights are scaled: the routers', so that tokens spread over the
# experts; the experts' and the embeddings', so that which experts a token goes to changes
# what the model samples (forcing each token's experts one over moves logprobs by nats).
ROUTER_SCALE = 30.0
EXPERT_SCALE = 10.0
EMBEDDING_SCALE = 4.0


def write_tiny_moe(
    out_dir: Path,
    *,
    seed: int = 0,
    head_dim: int = 16,
    imprint: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the tiny MoE model to ``out_dir`` (replacing it atomically); return the path.
    ``head_dim``: its four attention heads' width (16 shipped; 32 for vLLM's CPU attention,
    which takes no narrower ones: another model, drawn from the same seed). ``imprint``:
    trained as the tiny text model is (``tiny_model.IMPRINT_STEPS`` steps on its synthetic
    chats, ``progress(done, total)`` every tenth), so that it calls the tools it is offered
    some of the time; without it, the scaled random weights alone."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer: Any = AutoTokenizer.from_pretrained(SHIPPED_TINY_MODEL)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a PretrainedConfig kwarg
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=CONTEXT_WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=end,
        pad_token_id=pad,
    )

    def shape(model: Any) -> None:
        _scale(model)
        if imprint:
            imprint_tool_use(model, tokenizer, random.Random(seed), IMPRINT_STEPS, progress)

    model = seeded_model(
        Qwen3MoeForCausalLM, config, seed=seed, eos_ids=[end, pad], pad_id=pad, shape=shape
    )
    return save_atomically(out_dir, model, tokenizer)


def _scale(model: Any) -> None:
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(ROUTER_SCALE)
            for weight in layer.mlp.experts.parameters():
                weight.mul_(EXPERT_SCALE)
        model.model.embed_tokens.weight.mul_(EMBEDDING_SCALE)
