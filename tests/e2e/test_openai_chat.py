"""Chat completions through the real proxy, relay, worker and tiny model, with the
official ``openai`` client."""

from __future__ import annotations

from typing import Any

import pytest
from openai import AsyncOpenAI

from proxy.appkeys import POOL
from proxy.embedded import RunningProxy
from sdk.client import ProxyClient
from sdk.demo import TOOLS

pytestmark = pytest.mark.e2e


def _client(base_url: str, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


async def test_completion_reports_exact_usage(proxy_client: ProxyClient) -> None:
    """usage counts equal the recorded prompt and sampled token counts."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        reply = await client.chat.completions.create(
            model="anything", messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=3
        )
    export = await proxy_client.trajectories(trial.trial_id)
    (traj,) = export["trajectories"]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(traj["prompt_ids"])
    assert reply.usage.completion_tokens == sum(traj["response_mask"]) >= 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.choices[0].finish_reason in {"stop", "length", "tool_calls"}


async def test_max_tokens_caps_and_finish_length(proxy_client: ProxyClient) -> None:
    """A 1-token cap stops with finish_reason length unless the stop token came first."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "count to ten"}], max_tokens=1, seed=1
        )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 1
    export = await proxy_client.trajectories(trial.trial_id)
    turn = export["trajectories"][0]["turns"][0]
    assert turn["sampling"]["max_tokens"] == 1
    assert reply.choices[0].finish_reason == (
        "length" if turn["finish_reason"] == "length" else "stop"
    )


async def test_session_sampling_overrides_and_global_cap(proxy_client: ProxyClient) -> None:
    """The trainer's sampling wins over the agent's; 32k requests are capped globally."""
    trial = await proxy_client.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
    async with _client(trial.base_url, trial.api_key) as client:
        await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0.01,
            top_p=0.1,
            max_tokens=32000,
        )
    turn = (await proxy_client.trajectories(trial.trial_id))["trajectories"][0]["turns"][0]
    assert turn["sampling"]["temperature"] == 1.0
    assert turn["sampling"]["top_p"] == 1.0
    assert turn["sampling"]["max_tokens"] == 64  # the stack's --max-tokens


async def test_continuation_appends_to_the_same_trajectory(proxy_client: ProxyClient) -> None:
    """Echoing the reply back and adding a message continues the context (no new branch),
    and the earlier sampled ids appear verbatim in the later prompt."""
    trial = await proxy_client.create_session()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    async with _client(trial.base_url, trial.api_key) as client:
        for turn in range(3):
            reply = await client.chat.completions.create(
                model="m",
                messages=messages,
                tools=TOOLS,
                max_tokens=24,
                seed=turn,  # type: ignore[arg-type]
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok"})
            if not message.tool_calls:
                messages.append({"role": "user", "content": f"next {turn}"})
    export = await proxy_client.trajectories(trial.trial_id)
    (traj,) = export["trajectories"]
    assert [t["branch_reason"] for t in traj["turns"]] == ["new_session", "continued", "continued"]
    # Each later turn's prompt is exactly the stored ids before it.
    full = traj["prompt_ids"] + traj["response_ids"]
    for t in traj["turns"]:
        assert t["prompt_tokens"] == len(traj["prompt_ids"]) + t["response_start"]
    assert len(full) == traj["turns"][-1]["prompt_tokens"] + traj["turns"][-1]["completion_tokens"]


async def test_models_endpoint_lists_served_model(
    stack: RunningProxy, proxy_client: ProxyClient
) -> None:
    """GET /v1/models lists the worker's model."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == sorted(stack.app[POOL].served_models())
    assert len(models.data) == 1


async def test_health_and_readiness(stack: RunningProxy, proxy_client: ProxyClient) -> None:
    """/healthz is alive and /readyz is 200 while a worker is connected."""
    assert await proxy_client.ready()
