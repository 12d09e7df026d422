"""Routing replay (R3) with the real ``hf`` worker on the tiny Qwen3-MoE: the experts recorded
while the worker sampled are the model's own under teacher forcing on every (token, layer),
and a forward with the routers forced to them reproduces every sampled logprob within 1e-4,
while another routing does not; over two turns of one chain, streamed and not, in Chat
Completions and Anthropic Messages. Off unless asked; a dense model asked says so."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient, TrialSession
from sdk.exceptions import ProxyRequestError
from sdk.fidelity import check_samples
from sdk.routing import ReplayScorer
from sdk.samples import build_samples, export_routing
from tests.e2e.conftest import IN_PROCESS_STREAMS, TIMEOUT_FACTOR
from worker_client.routing import RoutingCapture
from worker_client.tiny_moe import SHIPPED_TINY_MOE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
async def moe_hf_stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=10,
        cache_dir=tmp_path_factory.mktemp("moe-hf-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
    )
    running = await start_proxy(config)
    start_hf_worker(running, SHIPPED_TINY_MOE, worker_id="test-moe-hf")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


@pytest.fixture(scope="session")
def moe_model() -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED_TINY_MOE), dtype=torch.float32)
    return model.eval()


@pytest.fixture
async def moe_client(moe_hf_stack: RunningProxy) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(moe_hf_stack.url) as client:
        yield client


async def _chat(trial: TrialSession, messages: list[dict[str, Any]], stream: bool) -> str:
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as c:
        if not stream:
            reply = await c.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
            return reply.choices[0].message.content or ""
        text = ""
        async for chunk in await c.chat.completions.create(
            model="m",
            messages=messages,  # type: ignore[arg-type]
            stream=True,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text


async def _anthropic(trial: TrialSession, messages: list[dict[str, Any]], stream: bool) -> str:
    async with AsyncAnthropic(
        base_url=trial.anthropic_base_url, api_key=trial.api_key, max_retries=0
    ) as c:
        if stream:
            async with c.messages.stream(model="m", max_tokens=10, messages=messages) as s:  # type: ignore[arg-type]
                message = await s.get_final_message()
        else:
            message = await c.messages.create(model="m", max_tokens=10, messages=messages)  # type: ignore[arg-type]
    return "".join(b.text for b in message.content if b.type == "text")


def _own_routing(model: Any, ids: list[int]) -> np.ndarray[Any, Any]:
    """The model's own routing of ``ids`` under teacher forcing: rows of all but the last."""
    with RoutingCapture(model) as capture, torch.inference_mode():
        model(torch.tensor([ids]))
    return capture.rows()[: len(ids) - 1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "anthropic"])
async def test_recorded_routing_is_the_models_own_and_replays_every_logprob(
    moe_client: ProxyClient, moe_model: Any, api: str, stream: bool
) -> None:
    trial = await moe_client.create_session(
        sampling={"temperature": 1.0, "top_p": 1.0}, routed_experts=True
    )
    say = _chat if api == "chat" else _anthropic
    first = [{"role": "user", "content": "Tell me about the sea."}]
    reply = await say(trial, first, stream)
    await say(
        trial,
        [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "More?"}],
        stream,
    )
    export = await moe_client.trajectories(trial.trial_id)
    (trajectory,) = export["trajectories"]
    assert [t["branch_reason"] for t in trajectory["turns"]] == ["new_session", "continued"]
    assert not any(t["routing_missing"] for t in trajectory["turns"])
    routing = export_routing(trajectory)
    assert routing is not None
    assert routing.missing == ()
    assert routing.rows.dtype == np.uint8
    ids = trajectory["prompt_ids"] + trajectory["response_ids"]
    assert routing.rows.shape == (len(ids) - 1, 2, 2)
    # Every (token, layer): the experts the worker chose are the ones teacher forcing picks.
    assert np.array_equal(routing.rows, _own_routing(moe_model, ids))

    (sample,) = build_samples(export)
    assert sample.routed_experts is not None
    report = check_samples([sample], ReplayScorer(moe_model))
    assert report.sampled_tokens >= 2
    assert report.ok(), report
    sample.routed_experts = (sample.routed_experts + 1) % 8  # every token to other experts
    assert not check_samples([sample], ReplayScorer(moe_model)).ok()


async def test_routing_is_off_unless_asked(moe_client: ProxyClient) -> None:
    trial = await moe_client.create_session()
    await _chat(trial, [{"role": "user", "content": "hi"}], stream=False)
    (trajectory,) = (await moe_client.trajectories(trial.trial_id))["trajectories"]
    assert "routed_experts" not in trajectory


async def test_a_dense_model_asked_for_routing_says_so(proxy_client: ProxyClient) -> None:
    """The shared ``stack`` serves the dense tiny model."""
    with pytest.raises(ProxyRequestError) as caught:
        await proxy_client.create_session(routed_experts=True)
    assert caught.value.status == 400
    assert caught.value.code == "routing_unsupported"


async def test_a_reply_ended_by_a_stop_string_keeps_its_routing(
    moe_client: ProxyClient, moe_model: Any
) -> None:
    """The proxy stops the worker where a stop string matched; the worker's last frame
    still brings the rows of what it sampled, so the turn is trainable with R3."""
    trial = await moe_client.create_session(
        sampling={"temperature": 1.0, "top_p": 1.0}, routed_experts=True
    )
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as c:
        reply = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Tell me about the sea."}],
            stop=["e", "a", "o", " "],  # the tiny model writes one of these soon
            max_tokens=40,
        )
    assert reply.choices[0].finish_reason == "stop"
    (trajectory,) = (await moe_client.trajectories(trial.trial_id))["trajectories"]
    assert trajectory["turns"][0]["finish_reason"] == "stop_sequence"
    assert trajectory["turns"][0]["routing_missing"] is False
    routing = export_routing(trajectory)
    assert routing is not None
    assert routing.missing == ()
    ids = trajectory["prompt_ids"] + trajectory["response_ids"]
    assert np.array_equal(routing.rows, _own_routing(moe_model, ids))
