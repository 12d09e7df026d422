"""Chat completions through the real proxy, relay, worker and tiny model, with the
official ``openai`` client."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from proxy.appkeys import POOL
from proxy.chat.template_check import SHAPES
from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient
from sdk.demo import TOOLS
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.scripted_worker import PacedScriptedEngine, tiny_reply

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


async def test_models_endpoint_shows_the_template_check(
    stack: RunningProxy, proxy_client: ProxyClient
) -> None:
    """Each served model says which tool-call format its template teaches and what the
    template does to every conversation shape agents produce (all continue on the tiny
    model's template)."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        models = await client.models.list()
    (model,) = models.data
    extra = model.model_extra or {}
    assert extra["tool_call_format"] == "hermes"
    shapes = {c["shape"]: c["result"] for c in extra["template_check"]}
    assert shapes == {s.name: "continued" for s in SHAPES}


async def test_health_and_readiness(stack: RunningProxy, proxy_client: ProxyClient) -> None:
    """/healthz is alive and /readyz is 200 while a worker is connected."""
    assert await proxy_client.ready()


async def _stream_text(client: AsyncOpenAI, **kwargs: Any) -> tuple[str, list[Any]]:
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


async def test_stream_equals_non_stream_for_the_same_seed(proxy_client: ProxyClient) -> None:
    """Concatenated deltas equal the non-streamed text, and both record the same ids."""
    trial = await proxy_client.create_session()
    kwargs: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 40,
        "seed": 5,
    }
    async with _client(trial.base_url, trial.api_key) as client:
        whole = await client.chat.completions.create(**kwargs)
        text, chunks = await _stream_text(client, stream_options={"include_usage": True}, **kwargs)
    assert text == (whole.choices[0].message.content or "")
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    export = await proxy_client.trajectories(trial.trial_id)
    first, second = (t["response_ids"] for t in export["trajectories"])
    assert first == second
    assert len(export["trajectories"]) == 2  # two requests with the same messages: siblings


async def test_stream_delivers_tokens_before_the_turn_ends(proxy_client: ProxyClient) -> None:
    """The stream has one chunk per engine delta, not one synthesized at the end."""
    trial = await proxy_client.create_session(sampling={"seed": 3})
    async with _client(trial.base_url, trial.api_key) as client:
        _, chunks = await _stream_text(
            client, model="m", messages=[{"role": "user", "content": "go on"}], max_tokens=20
        )
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 3
    assert chunks[-1].choices[0].finish_reason in {"stop", "length", "tool_calls"}


async def test_disconnect_mid_stream_records_a_truncated_turn(
    stack: RunningProxy, proxy_client: ProxyClient
) -> None:
    """A client that leaves mid-stream cancels the generation; the sampled part is kept."""
    trial = await proxy_client.create_session(sampling={"seed": 1, "max_tokens": 60})
    body = {"model": "m", "messages": [{"role": "user", "content": "long answer"}], "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{trial.base_url}/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        await response.content.readline()  # the first chunk; then the client goes away
    for _ in range(100):
        summary = await proxy_client.get_session(trial.trial_id)
        if summary["turns"] == 1:
            break
        await asyncio.sleep(0.05)
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    turn = traj["turns"][0]
    assert turn["truncated"] is True
    assert turn["finish_reason"] == "abort"
    assert turn["completion_tokens"] < 60
    assert stack.app[POOL].in_flight == 0


async def test_stop_sequence_ends_the_reply(proxy_client: ProxyClient) -> None:
    """A stop string cuts the reply before it; the sampled tokens are still recorded."""
    trial = await proxy_client.create_session(sampling={"seed": 2})
    async with _client(trial.base_url, trial.api_key) as client:
        free = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "words"}], max_tokens=40
        )
        text = free.choices[0].message.content or ""
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip()
        cut = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "words"}], max_tokens=40, stop=[stop]
        )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    turns = [
        t
        for tr in (await proxy_client.trajectories(trial.trial_id))["trajectories"]
        for t in tr["turns"]
    ]
    assert turns[1]["stop_sequence"] == stop
    assert turns[1]["finish_reason"] == "stop_sequence"


async def test_n_choices_are_sibling_branches(proxy_client: ProxyClient) -> None:
    """n=3 returns three choices, each recorded as its own branch of the same context."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "pick"}], max_tokens=8, n=3, seed=4
        )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    export = await proxy_client.trajectories(trial.trial_id)
    assert len(export["trajectories"]) == 3
    assert len({tuple(t["prompt_ids"]) for t in export["trajectories"]}) == 1
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(
        sum(t["response_mask"]) for t in export["trajectories"]
    )


async def test_logprobs_are_the_recorded_ones(proxy_client: ProxyClient) -> None:
    """logprobs=true returns each sampled token with the logprob the trainer gets."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            logprobs=True,
            top_logprobs=1,
        )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    assert [c.logprob for c in content] == pytest.approx(traj["response_logprobs"], abs=1e-6)


async def test_tool_choice_none_returns_tool_markup_as_text(
    scripted_client: ProxyClient, scripted: PacedScriptedEngine
) -> None:
    """With tool_choice none, nothing is parsed into tool calls: a reply in tool-call markup
    comes back as text."""
    scripted.script(tiny_reply("Let me look.", [("bash", {"command": "ls"})]))
    trial = await scripted_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "list the files"}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="none",
            max_tokens=40,
            seed=1,
        )
    assert not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert '<tool_call>\n{"name": "bash"' in (reply.choices[0].message.content or "")
    (prompt,) = scripted.prompts  # the tools were rendered all the same
    assert '"name": "bash"' in scripted.tokenizer.decode(prompt)  # type: ignore[attr-defined]


async def test_tool_choice_naming_an_unknown_tool_is_400(proxy_client: ProxyClient) -> None:
    """A forced function that is not among the tools is rejected."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "x"}],
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )


async def test_n_streamed_choices_are_sibling_branches(proxy_client: ProxyClient) -> None:
    """n=3 with stream: every choice streams its own deltas under its index, ends with its
    own finish reason, equals the unstreamed choice of the same seed, and is its own branch;
    usage counts all three."""
    trial = await proxy_client.create_session()
    kwargs: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "pick"}],
        "max_tokens": 16,
        "n": 3,
        "seed": 4,
    }
    async with _client(trial.base_url, trial.api_key) as client:
        whole = await client.chat.completions.create(**kwargs)
        chunks = [
            c
            async for c in await client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        ]
    texts = {0: "", 1: "", 2: ""}
    deltas = {0: 0, 1: 0, 2: 0}
    finishes: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            if choice.delta.content:
                texts[choice.index] += choice.delta.content
                deltas[choice.index] += 1
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content or "" for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert sum(deltas.values()) > 3  # streamed token by token, not one block per choice
    export = await proxy_client.trajectories(trial.trial_id)
    streamed = export["trajectories"][3:]
    assert len(export["trajectories"]) == 6
    assert sorted(t["turns"][0]["sampling"]["seed"] for t in streamed) == [4, 5, 6]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == sum(sum(t["response_mask"]) for t in streamed)


async def test_disconnect_mid_stream_truncates_every_choice(
    stack: RunningProxy, proxy_client: ProxyClient
) -> None:
    """A client that leaves an n=2 stream cancels both generations; each choice's sampled
    part is recorded as its own truncated branch."""
    trial = await proxy_client.create_session(sampling={"seed": 1, "max_tokens": 60})
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "long answers"}],
        "stream": True,
        "n": 2,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{trial.base_url}/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        await response.content.readline()  # the first chunk; then the client goes away
    for _ in range(int(200 * TIMEOUT_FACTOR)):
        if (await proxy_client.get_session(trial.trial_id))["turns"] == 2:
            break
        await asyncio.sleep(0.05)
    trajectories = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    assert len(trajectories) == 2
    for traj in trajectories:
        (turn,) = traj["turns"]
        assert turn["truncated"] is True
        assert turn["finish_reason"] == "abort"
        assert turn["completion_tokens"] < 60
    assert stack.app[POOL].in_flight == 0
