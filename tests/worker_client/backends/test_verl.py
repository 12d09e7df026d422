"""The ``verl`` backend with verl's real ``TokenOutput``.

verl's rollout servers need vLLM or SGLang on a GPU, so the rollout client here answers
with the ``hf`` engine on the tiny model and wraps the result in verl's own ``TokenOutput``
the way verl's vLLM server does (``stop_reason`` "completed"/"aborted",
``extra_fields["global_steps"]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

replica = pytest.importorskip("verl.workers.rollout.replica")

from worker_client.backends.hf import HFEngine  # noqa: E402
from worker_client.backends.verl import VerlEngine, verl_sampling  # noqa: E402
from worker_client.engine import FinishReason, SamplingParams  # noqa: E402
from worker_client.exceptions import EngineError  # noqa: E402
from worker_client.policy import POLICY_VERSION  # noqa: E402

PROMPT = [5, 17, 42, 9, 3]


class HFRollout:
    def __init__(self, hf: HFEngine, global_steps: int) -> None:
        self.hf = hf
        self.global_steps = global_steps
        self.requests: list[dict[str, Any]] = []
        self.stop_reason = "completed"

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> Any:
        self.requests.append(dict(sampling_params))
        sampling = SamplingParams(
            max_tokens=sampling_params["max_tokens"],
            temperature=sampling_params["temperature"],
            top_p=sampling_params["top_p"],
            seed=sampling_params.get("seed"),
        )
        ids: list[int] = []
        logprobs: list[float] = []
        async for chunk in self.hf.generate(request_id, prompt_ids, sampling):
            ids += chunk.token_ids
            logprobs += chunk.logprobs
        return replica.TokenOutput(
            token_ids=ids,
            log_probs=logprobs,
            stop_reason=self.stop_reason,
            extra_fields={"global_steps": self.global_steps},
        )


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> HFEngine:
    return HFEngine.load(tiny_model_dir)


async def test_turn_carries_tokens_logprobs_and_global_steps(hf: HFEngine) -> None:
    """One request gives the sampled ids, faithful logprobs and verl's global_steps."""
    rollout = HFRollout(hf, global_steps=5)
    engine = VerlEngine(rollout, name="tiny", max_model_len=512, eos_token_ids=[0, 2])
    chunks = [c async for c in engine.generate("r", PROMPT, SamplingParams(max_tokens=6, seed=2))]
    (chunk,) = chunks
    assert chunk.extra[POLICY_VERSION] == 5
    assert rollout.requests[0]["logprobs"] is True
    assert rollout.requests[0]["top_k"] == -1
    expected = hf.score(PROMPT, chunk.token_ids)
    assert max(abs(a - b) for a, b in zip(chunk.logprobs, expected, strict=True)) < 1e-4
    stopped = chunk.token_ids[-1] in {0, 2}
    assert chunk.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)


async def test_aborted_and_unknown_stop_reasons(hf: HFEngine) -> None:
    """'aborted' maps to ABORT; an unknown stop reason is an engine error."""
    rollout = HFRollout(hf, global_steps=1)
    engine = VerlEngine(rollout, name="tiny", max_model_len=512, eos_token_ids=[0, 2])
    rollout.stop_reason = "aborted"
    (chunk,) = [c async for c in engine.generate("a", PROMPT, SamplingParams(max_tokens=2))]
    assert chunk.finish_reason is FinishReason.ABORT
    rollout.stop_reason = "exploded"
    with pytest.raises(EngineError, match="exploded"):
        [c async for c in engine.generate("b", PROMPT, SamplingParams(max_tokens=2))]


def test_sampling_mapping() -> None:
    """Our settings become verl's dict: top_k off is -1, seed and stop ids when set."""
    params = verl_sampling(
        SamplingParams(max_tokens=9, temperature=0.7, top_k=4, seed=1, stop_token_ids=(7,))
    )
    assert params == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 4,
        "max_tokens": 9,
        "logprobs": True,
        "seed": 1,
        "stop_token_ids": [7],
    }
