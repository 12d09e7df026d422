"""The verl adapter's R3 field against verl's own code: ``AgentLoopOutput.routed_experts``
as its agent loops fill it, padded by verl's ``_agent_loop_postprocess`` into the batch
field its router replay reads, still replays the sampled logprobs on the tiny MoE; the
empty output of a failed task carries zero rows of the model's shape."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl.experimental.agent_loop.agent_loop")

from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

from sdk.agent_loop import RolloutResult
from sdk.exceptions import RemoteAgentLoopError
from sdk.routing import replay_routing
from sdk.samples import build_samples
from sdk.verl import RemoteAgentLoop, model_routing_shape, to_output
from tests.moe import two_turn_episode
from worker_client.tiny_moe import SHIPPED_TINY_MOE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_LENGTH, RESPONSE_LENGTH = 96, 48


async def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _verl_worker() -> SimpleNamespace:
    """What ``_agent_loop_postprocess`` reads of its worker, for a text model."""
    worker = SimpleNamespace(
        rollout_config=SimpleNamespace(
            prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH
        ),
        tokenizer=AutoTokenizer.from_pretrained(SHIPPED_TINY_MOE),
        _compute_multi_modal_inputs=lambda output, input_ids: {},
        _compute_position_ids=lambda input_ids, mask, mm, kwargs: (mask.cumsum(-1) - 1).clamp(
            min=0
        ),
        _get_mm_processor_kwargs=lambda audios=None: {},
        _compute_score=_nothing,
        _compute_teacher_logprobs=_nothing,
    )
    worker._pad_token_ids = functools.partial(AgentLoopWorker._pad_token_ids, worker)
    return worker


async def test_verl_pads_the_adapters_routing_into_what_its_replay_reads(
    tiny_moe: Any, tiny_moe_prompt: torch.Tensor
) -> None:
    export, _ = two_turn_episode(tiny_moe, tiny_moe_prompt)
    (sample,) = build_samples(export)
    assert sample.routed_experts is not None
    result = RolloutResult(Path("task"), "t", [sample], 1.0, {}, [], {})
    output = to_output(sample, result)
    rows = output.routed_experts
    assert isinstance(rows, np.ndarray)
    assert rows.dtype == np.int16
    assert rows.shape == (len(sample.prompt_ids) + len(sample.response_ids) - 1, 2, 2)
    np.testing.assert_array_equal(rows, sample.routed_experts)

    # verl's as_dict (its batch-free path) spans the whole sequence, the last row zero.
    whole = output.as_dict()["routed_experts"]
    assert whole.dtype == torch.int16
    assert whole.shape[0] == len(sample.prompt_ids) + len(sample.response_ids)
    assert not whole[-1].any()

    # verl's padded batch field: [1, prompt_length + response_length, layers, top_k],
    # the rows starting where the left-padded prompt starts.
    padded = await AgentLoopWorker._agent_loop_postprocess(
        _verl_worker(), output, False, raw_prompt=[]
    )
    assert padded.routed_experts is not None
    assert padded.routed_experts.shape == (1, PROMPT_LENGTH + RESPONSE_LENGTH, 2, 2)
    real = padded.attention_mask[0].bool()
    ids = padded.input_ids[0][real]
    assert ids.tolist() == sample.prompt_ids + sample.response_ids
    replayed = padded.routed_experts[0][real].numpy()[:-1]
    with torch.no_grad(), replay_routing(tiny_moe, replayed):
        logits = tiny_moe(input_ids=ids[None, :-1]).logits[0]
    start = len(sample.prompt_ids) - 1
    scored = logits[start:].log_softmax(-1).gather(1, ids[start + 1 :, None])[:, 0]
    mask = torch.tensor(sample.response_mask, dtype=torch.bool)
    recorded = torch.tensor(sample.response_logprobs)
    assert (scored[mask] - recorded[mask]).abs().max() < 1e-4


def test_a_failed_task_gives_zero_rows_of_the_models_shape() -> None:
    """verl batches ``routed_experts`` only when every output has it: the empty output
    of ``on_failure: empty`` carries zeros shaped from the model's routers."""
    assert model_routing_shape(str(SHIPPED_TINY_MOE)) == (2, 2)
    loop = object.__new__(RemoteAgentLoop)
    loop._tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TINY_MOE)
    loop.rollout_config = SimpleNamespace(prompt_length=PROMPT_LENGTH)
    loop.config = SimpleNamespace(
        actor_rollout_ref=SimpleNamespace(model=SimpleNamespace(path=str(SHIPPED_TINY_MOE)))
    )
    loop.settings = SimpleNamespace(routed_experts=True)
    row = {"raw_prompt": [{"role": "user", "content": "hello"}]}
    output = loop._failed_output(row, RemoteAgentLoopError("down"))
    assert output.routed_experts is not None
    assert output.routed_experts.shape == (len(output.prompt_ids), 2, 2)
    assert not output.routed_experts.any()
