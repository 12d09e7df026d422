"""The tiny mixture-of-experts model as the routing tests use it: loaded, a chat prompt for
it, and a sampled reply with its raw logprobs."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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
