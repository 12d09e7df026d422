"""The vllm section's pure parts: the direct agent's token bookkeeping and its table (the
section itself starts a real engine twice and is not run by the tests)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from bench.agents import words
from bench.report import render, vllm_table
from bench.vllm import ADD_WORDS, SYSTEM_WORDS, TokenAgent, chat_tokens
from worker_client.tiny_model import SHIPPED_TINY_MODEL


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED_TINY_MODEL)


@pytest.mark.parametrize("cut", [False, True])
def test_the_direct_agents_ids_are_the_templates_rendering(tokenizer: Any, cut: bool) -> None:
    """Ids kept turn by turn (a sampled reply, closed or cut at max_tokens, then the next
    message) are the ids of the whole conversation rendered by the chat template: the
    direct side computes the prompts the proxy computes."""
    agent = TokenAgent(None, "", tokenizer, chat_tokens(tokenizer), seed=5, max_tokens=8)  # type: ignore[arg-type]
    agent.new_session()
    reply = tokenizer.encode("a short reply", add_special_tokens=False)
    agent.ids += reply if cut else [*reply, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    agent.observe()
    rng = random.Random(5)
    messages = [
        {"role": "system", "content": words(rng, SYSTEM_WORDS)},
        {"role": "user", "content": words(rng, ADD_WORDS)},
        {"role": "assistant", "content": "a short reply"},
        {"role": "user", "content": words(rng, ADD_WORDS)},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert agent.ids == tokenizer.encode(text, add_special_tokens=False)
    assert agent.client_seconds > 0


def _row(target: str, concurrency: int, p50: float, cpu: dict[str, float]) -> dict[str, Any]:
    return {
        "target": target,
        "concurrency": concurrency,
        "turns": 64,
        "errors": 0,
        "completion_tokens": 64 * 20,
        "turns_per_s": 10.0,
        "p50_ms": p50,
        "p99_ms": p50 * 3,
        "cpu_ms_per_turn": cpu,
    }


def test_the_table_sets_each_side_beside_the_other() -> None:
    """One line per side and concurrency, then the proxy's difference; CPU split into the
    engine core, what runs around it (named) and the direct agent's own work."""
    section = {
        "rows": [
            _row("direct", 1, 100.0, {"vllm serve": 20.0, "engine core": 80.0, "client": 1.0}),
            _row("proxy", 1, 110.0, {"proxy": 6.0, "worker": 9.0, "engine core": 80.0}),
        ],
        "engine_start_s": {"direct": 60.0, "proxy": 70.0},
        "killed_after_stop": {"direct": 0, "proxy": 0},
        "engine": "--dtype float32",
        "model": "/x/text-hd32",
    }
    table = vllm_table(section)
    lines = table.splitlines()
    assert (
        "| `vllm serve`, token ids | 1 | 64 | 0 | 20.0 | 10.0 | 100 | 300 | 100.0 | 80.0 | 20.0 (vllm serve 20.0) | 1.0 |"
        in lines
    )
    assert (
        "| proxy + `vllm` worker | 1 | 64 | 0 | 20.0 | 10.0 | 110 | 330 | 95.0 | 80.0 | 15.0 (proxy 6.0 + worker 9.0) | 0.0 |"
        in lines
    )
    assert (
        "| proxy's difference | 1 | | | | +0.0 | +10 | +30 | -5.0 | +0.0 | -5.0 | -1.0 |" in lines
    )
    assert "`vllm serve` ready in 60 s; proxy + worker ready in 70 s" in table
    assert "## The proxy beside `vllm serve`" in render({"vllm": section}, {}, "python -m bench")


def test_a_machine_without_vllm_says_so() -> None:
    text = render({"vllm": {"skipped": "no side environment"}}, {}, "python -m bench")
    assert "Not measured: no side environment." in text
