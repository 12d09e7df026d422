"""Reading vLLM's prompt logprobs for the ids asked, on outputs shaped as vLLM's (no vLLM
needed): the prompt token's own entry at each position, never a top one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker_client.backends.vllm_scoring import prompt_logprobs_from
from worker_client.exceptions import EngineError


def _output(entries: list[dict[int, float] | None]) -> SimpleNamespace:
    """A ``RequestOutput`` with ``prompt_logprobs``: per position, token id to Logprob."""
    return SimpleNamespace(
        request_id="r1",
        prompt_logprobs=[
            None if e is None else {t: SimpleNamespace(logprob=v) for t, v in e.items()}
            for e in entries
        ],
    )


def test_the_prompt_tokens_own_logprobs_are_read_from_start() -> None:
    """Each position gives its own token's logprob (beside the top one vLLM adds); the
    first position has none and is never read."""
    output = _output([None, {7: -0.5, 2: -0.1}, {8: -2.0, 3: -0.2}, {9: -0.3}])
    assert prompt_logprobs_from(output, [1, 7, 8, 9], 1) == [-0.5, -2.0, -0.3]
    assert prompt_logprobs_from(output, [1, 7, 8, 9], 3) == [-0.3]


def test_missing_or_misaligned_prompt_logprobs_fail_the_request() -> None:
    """An output without prompt logprobs, with another length, or without the prompt
    token's entry is an engine error, never a silent misalignment."""
    with pytest.raises(EngineError, match="none prompt logprobs"):
        prompt_logprobs_from(SimpleNamespace(request_id="r1", prompt_logprobs=None), [1, 2], 1)
    with pytest.raises(EngineError, match="2 prompt logprobs for the 3 ids"):
        prompt_logprobs_from(_output([None, {2: -1.0}]), [1, 2, 3], 1)
    with pytest.raises(EngineError, match="no logprob for id 2 at position 1"):
        prompt_logprobs_from(_output([None, {5: -1.0}]), [1, 2], 1)
