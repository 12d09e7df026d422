"""The tiny mixture-of-experts model as the routing tests use it: loaded, a chat prompt for
it, a sampled reply with its raw logprobs, and a two-turn episode exported with the routing
captured while it was generated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sdk.samples import encode_routing
from worker_client.routing import RoutingCapture
from worker_client.tiny_moe import SHIPPED_TINY_MOE


def load_moe() -> Any:
    return AutoModelForCausalLM.from_pretrained(SHIPPED_TINY_MOE, dtype=torch.float32).eval()


def chat_prompt() -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TINY_MOE)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List the files, then read main.py."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)])


def generate(model: Any, prompt: torch.Tensor, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Twelve sampled tokens and their raw logprobs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    sampled = out.sequences[0, prompt.shape[1] :]
    logprobs = torch.stack(
        [step[0].log_softmax(-1)[t] for step, t in zip(out.logits, sampled, strict=True)]
    )
    return sampled, logprobs


def two_turn_episode(
    model: Any, prompt: torch.Tensor
) -> tuple[dict[str, Any], np.ndarray[Any, Any]]:
    """Two sampled turns with context between them, as the proxy exports it; the routing
    is what the engine's routers chose while generating the last turn (every position of
    the trajectory but the last)."""
    first, first_logprobs = generate(model, prompt, seed=5)
    context = prompt[0, 1:7]  # a tool result's tokens
    second_prompt = torch.cat([prompt[0], first, context])[None]
    with RoutingCapture(model) as capture:
        second, second_logprobs = generate(model, second_prompt, seed=6)
    rows = capture.rows()
    response = [*first.tolist(), *context.tolist(), *second.tolist()]
    assert rows.shape[0] == prompt.shape[1] + len(response) - 1
    end = len(first) + len(context)
    traj = {
        "prompt_ids": prompt[0].tolist(),
        "response_ids": response,
        "response_mask": [1] * len(first) + [0] * len(context) + [1] * len(second),
        "response_logprobs": [
            *first_logprobs.tolist(),
            *[0.0] * len(context),
            *second_logprobs.tolist(),
        ],
        "turns": [
            {"turn": 0, "response_start": 0, "response_end": len(first)},
            {"turn": 1, "parent": 0, "response_start": end, "response_end": len(response)},
        ],
        "routed_experts": encode_routing(rows),
    }
    return {"trial_id": "moe", "reward": 1.0, "trajectories": [traj]}, rows


def padded_batch(samples: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Samples as TRL lays a batch out: prompts left-padded, completions right-padded, one
    attention mask; and the prompts' padded width."""
    prompt_width = max(len(s.prompt_ids) for s in samples)
    response_width = max(len(s.response_ids) for s in samples)
    ids = torch.zeros((len(samples), prompt_width + response_width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(samples):
        start = prompt_width - len(s.prompt_ids)
        ids[b, start:prompt_width] = torch.tensor(s.prompt_ids)
        ids[b, prompt_width : prompt_width + len(s.response_ids)] = torch.tensor(s.response_ids)
        mask[b, start : prompt_width + len(s.response_ids)] = 1
    return ids, mask, prompt_width
