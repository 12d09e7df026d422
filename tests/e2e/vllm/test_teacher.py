"""The real vLLM engine (CPU build) as a teacher: its prompt logprobs of given ids are
transformers' float32 teacher forcing within 1e-4 (``make test-vllm``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.vllm.conftest import Served
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e


async def test_prompt_logprobs_are_teacher_forcing(served: Served, text_model: Path) -> None:
    """vLLM scores the ids after a prefix (``PromptScorer``) as transformers does, and a
    second request sharing the prefix scores it alike."""
    hf = HFEngine.load(text_model)
    ids = [5, 17, 230, 41, 9, 300, 12, 77, 8, 1000, 42, 3]
    for request_id, start in (("score-1", 4), ("score-2", 1)):
        got = await served.engine.prompt_logprobs(request_id, ids, start)
        expected = hf.score(ids[:start], ids[start:])
        assert len(got) == len(ids) - start
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) <= 1e-4
