"""Routing replay (R3) on the ``hf`` backend with the tiny mixture-of-experts model: the
rows a request asks for are the experts teacher forcing routes the same ids to, on every
(position, layer), from the asked position to the last one run forward; a cached prefix
keeps its rows; nothing is captured unless asked; a dense model refuses the question.
CPU here; on CUDA the same code runs (hooks read the routers' indices on any device)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relay.protocol import RoutedExperts
from worker_client.backends.hf import HFEngine
from worker_client.engine import FinishReason, SamplingParams, TokenChunk
from worker_client.exceptions import EngineError
from worker_client.routing import RoutingCapture, RoutingShape, unpack_rows
from worker_client.tiny_moe import EXPERTS, LAYERS, SHIPPED_TINY_MOE, TOP_K

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
async def moe() -> AsyncIterator[HFEngine]:
    loaded = HFEngine.load(SHIPPED_TINY_MOE)
    yield loaded
    await loaded.close()


@pytest.fixture
async def fresh(moe: HFEngine) -> AsyncIterator[HFEngine]:
    """An engine on the loaded model with an empty prefix cache, stopping only at
    max_tokens."""
    made = HFEngine(moe.model, name="tiny-moe", max_model_len=4096, eos_token_ids=())
    yield made
    await made.close()


def teacher_forced(model: Any, ids: Sequence[int]) -> np.ndarray[Any, Any]:
    """The routing of one forward over ``ids``: row p is position p's experts."""
    with RoutingCapture(model) as capture, torch.inference_mode():
        model(torch.tensor([list(ids)]))
    return capture.rows()


async def run(
    engine: HFEngine, prompt: Sequence[int], tokens: int, seed: int = 3, **kwargs: Any
) -> tuple[list[int], TokenChunk]:
    out: list[int] = []
    last = None
    async for chunk in engine.generate(
        "r", prompt, SamplingParams(max_tokens=tokens, seed=seed), **kwargs
    ):
        out += chunk.token_ids
        last = chunk
    assert last is not None
    assert last.finish_reason is not None
    return out, last


def rows_of(engine: HFEngine, routed: RoutedExperts | None) -> np.ndarray[Any, Any]:
    assert routed is not None
    assert engine.card.routing is not None
    return unpack_rows(routed, engine.card.routing)


def test_the_card_announces_the_routers_shape(moe: HFEngine) -> None:
    assert moe.card.routing == RoutingShape(LAYERS, TOP_K, EXPERTS)


async def test_generated_rows_are_teacher_forcings_on_every_token_and_layer(
    fresh: HFEngine, tiny_moe_prompt: Any
) -> None:
    """Prefill and every decode step are captured: positions 0 to the last one run
    forward (all but the last sampled token), as teacher forcing routes them."""
    prompt = tiny_moe_prompt[0].tolist()
    sampled, last = await run(fresh, prompt, 12, routed_experts_from=0)
    assert last.finish_reason is FinishReason.LENGTH
    ids = prompt + sampled
    assert last.routed_experts is not None
    assert (last.routed_experts.start, last.routed_experts.rows) == (0, len(ids) - 1)
    assert len(last.routed_experts.data) == (len(ids) - 1) * LAYERS * TOP_K  # uint8
    rows = rows_of(fresh, last.routed_experts)
    assert np.array_equal(rows, teacher_forced(fresh.model, ids[:-1]))


@pytest.mark.parametrize("k", [1, 7, "prompt", "inside the reply"])
async def test_asking_from_k_gives_exactly_rows_k_on(
    fresh: HFEngine, tiny_moe_prompt: Any, k: Any
) -> None:
    prompt = tiny_moe_prompt[0].tolist()
    start = {"prompt": len(prompt), "inside the reply": len(prompt) + 4}.get(k, k)
    sampled, last = await run(fresh, prompt, 10, routed_experts_from=start)
    ids = prompt + sampled
    assert last.routed_experts is not None
    assert (last.routed_experts.start, last.routed_experts.rows) == (start, len(ids) - 1 - start)
    expected = teacher_forced(fresh.model, ids[:-1])[start:]
    assert np.array_equal(rows_of(fresh, last.routed_experts), expected)


async def test_a_reused_prefix_gives_its_kept_rows(fresh: HFEngine, tiny_moe_prompt: Any) -> None:
    """The next turn reuses the cached KV of the first (its positions are not run again);
    rows asked from inside that prefix come from the rows kept beside it."""
    prompt = tiny_moe_prompt[0].tolist()
    sampled, _ = await run(fresh, prompt, 8, routed_experts_from=0)
    turn = prompt + sampled + prompt[-6:]
    forwards = count_forwards(fresh)
    reply, last = await run(fresh, turn, 6, seed=4, routed_experts_from=5)
    assert forwards() < len(turn)  # the shared prefix was not run again
    ids = turn + reply
    assert last.routed_experts is not None
    assert last.routed_experts.start == 5
    assert np.array_equal(
        rows_of(fresh, last.routed_experts), teacher_forced(fresh.model, ids[:-1])[5:]
    )


async def test_a_prefix_cached_without_rows_is_run_again_from_the_asked_start(
    fresh: HFEngine, tiny_moe_prompt: Any
) -> None:
    """A turn that asked for no routing kept none: the next one asking from k reuses its
    KV only up to k, so every row from k is there."""
    prompt = tiny_moe_prompt[0].tolist()
    sampled, first = await run(fresh, prompt, 8)
    assert first.routed_experts is None
    turn = prompt + sampled + prompt[-4:]
    reply, last = await run(fresh, turn, 5, seed=9, routed_experts_from=3)
    ids = turn + reply
    assert last.routed_experts is not None
    assert last.routed_experts.start == 3
    assert np.array_equal(
        rows_of(fresh, last.routed_experts), teacher_forced(fresh.model, ids[:-1])[3:]
    )


async def test_nothing_is_captured_unless_asked(fresh: HFEngine, tiny_moe_prompt: Any) -> None:
    """No hook on a router while a request that did not ask runs, and no rows after."""
    prompt = tiny_moe_prompt[0].tolist()
    routers = [layer.mlp.gate for layer in fresh.model.model.layers]
    hooked: list[int] = []
    stream = fresh.generate("r", prompt, SamplingParams(max_tokens=4, seed=1))
    async for chunk in stream:
        hooked.append(sum(len(r._forward_hooks) for r in routers))
        assert chunk.routed_experts is None
    assert hooked
    assert not any(hooked)
    _, asked = await run(fresh, prompt, 4, routed_experts_from=0)
    assert asked.routed_experts is not None
    assert sum(len(r._forward_hooks) for r in routers) == 0  # removed once it ended


async def test_an_abort_brings_the_rows_it_has(fresh: HFEngine, tiny_moe_prompt: Any) -> None:
    """A request aborted mid-way (a weight update preempts it) ends with the rows of its
    prompt and the tokens it sampled, all but the last."""
    prompt = tiny_moe_prompt[0].tolist()
    sampled: list[int] = []
    last = None
    async for chunk in fresh.generate(
        "r", prompt, SamplingParams(max_tokens=50, seed=2), routed_experts_from=2
    ):
        sampled += chunk.token_ids
        last = chunk
        if len(sampled) == 3:
            await fresh.abort("r")
    assert last is not None
    assert last.finish_reason is FinishReason.ABORT
    ids = prompt + sampled
    assert last.routed_experts is not None
    assert (last.routed_experts.start, last.routed_experts.rows) == (2, len(ids) - 1 - 2)
    assert np.array_equal(
        rows_of(fresh, last.routed_experts), teacher_forced(fresh.model, ids[:-1])[2:]
    )


async def test_a_dense_model_has_no_routing_and_refuses_the_question(
    tiny_model_dir: Path,
) -> None:
    dense = HFEngine.load(tiny_model_dir)
    try:
        assert dense.card.routing is None
        with pytest.raises(EngineError, match="reports no routing"):
            await run(dense, [1, 2, 3], 2, routed_experts_from=0)
    finally:
        await dense.close()


def count_forwards(engine: HFEngine) -> Any:
    """How many positions the model runs forward from now on (its first router counts)."""
    seen = [0]
    router = engine.model.model.layers[0].mlp.gate

    def hook(module: Any, args: Any, output: Any) -> None:
        seen[0] += int(output[2].shape[0])

    handle = router.register_forward_hook(hook)

    def forwards() -> int:
        handle.remove()
        return seen[0]

    return forwards
