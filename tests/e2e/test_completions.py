"""Legacy completions through the real proxy, relay, worker and tiny model, with the
official ``openai`` client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from sdk.client import ProxyClient

pytestmark = pytest.mark.e2e


def _client(base_url: str, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _sampled_text(tokenizer: Any, ids: list[int]) -> str:
    """What the agent should have received for these sampled ids (no final stop token)."""
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    text: str = tokenizer.decode(ids, skip_special_tokens=False)
    return text


async def test_text_prompt_is_tokenized_without_a_chat_template(
    proxy_client: ProxyClient, tokenizer: Any
) -> None:
    """A text prompt is recorded as the tokenizer's own ids (context), the reply as the
    sampled ids; text, finish reason and usage match the record exactly."""
    trial = await proxy_client.create_session()
    prompt = "def add(a, b):\n    return"
    async with _client(trial.base_url, trial.api_key) as client:
        reply = await client.completions.create(model="m", prompt=prompt, max_tokens=12, seed=3)
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    assert traj["prompt_ids"] == tokenizer.encode(prompt)
    assert "<|im_start|>" not in tokenizer.decode(traj["prompt_ids"])
    assert reply.object == "text_completion"
    assert reply.choices[0].text == _sampled_text(tokenizer, traj["response_ids"])
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(traj["prompt_ids"])
    assert reply.usage.completion_tokens == len(traj["response_ids"]) == sum(traj["response_mask"])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    turn = traj["turns"][0]
    assert turn["api"] == "openai.completions"
    assert turn["sampling"]["max_tokens"] == 12
    expected = "length" if turn["finish_reason"] == "length" else "stop"
    assert reply.choices[0].finish_reason == expected


async def test_token_id_prompt_is_sent_verbatim_and_continues(
    proxy_client: ProxyClient, tokenizer: Any
) -> None:
    """A token-id prompt is the recorded context as given; sending back prompt + sampled ids
    (vLLM's return_token_ids) + new ids continues the same trajectory."""
    trial = await proxy_client.create_session()
    prompt = [5, 17, 300, 42, 7]
    async with _client(trial.base_url, trial.api_key) as client:
        first = await client.completions.create(
            model="m", prompt=prompt, max_tokens=6, seed=1, extra_body={"return_token_ids": True}
        )
        sampled = first.choices[0].model_extra["token_ids"]  # type: ignore[index]
        assert first.choices[0].model_extra["prompt_token_ids"] == prompt  # type: ignore[index]
        more = [*prompt, *sampled, 11, 12]
        second = await client.completions.create(model="m", prompt=more, max_tokens=6, seed=2)
    (traj,) = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    assert traj["prompt_ids"] == prompt
    assert [t["branch_reason"] for t in traj["turns"]] == ["new_session", "continued"]
    start, end = traj["turns"][0]["response_start"], traj["turns"][0]["response_end"]
    assert traj["response_ids"][start:end] == sampled
    assert traj["response_ids"][end : end + 2] == [11, 12]
    assert traj["response_mask"][end : end + 2] == [0, 0]
    assert second.usage is not None
    assert second.usage.prompt_tokens == len(more)


async def test_stream_equals_non_stream_for_the_same_seed(
    proxy_client: ProxyClient, tokenizer: Any
) -> None:
    """Concatenated streamed text equals the non-streamed text for the same seed, with
    several chunks, exact usage, and the same recorded ids either way."""
    trial = await proxy_client.create_session()
    kwargs: dict[str, Any] = {"model": "m", "prompt": "Once upon a time", "max_tokens": 24}
    async with _client(trial.base_url, trial.api_key) as client:
        whole = await client.completions.create(seed=5, **kwargs)
        chunks = [
            c
            async for c in await client.completions.create(
                seed=5, stream=True, stream_options={"include_usage": True}, **kwargs
            )
        ]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None
    assert whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    first, second = (
        t["response_ids"] for t in (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    )
    assert first == second
    assert _sampled_text(tokenizer, first) == text


async def test_logprobs_are_the_recorded_ones(proxy_client: ProxyClient, tokenizer: Any) -> None:
    """logprobs=1 returns the legacy object over the sampled tokens with the recorded
    logprobs; streamed, the same object arrives with the final chunk."""
    trial = await proxy_client.create_session()
    kwargs: dict[str, Any] = {"model": "m", "prompt": "x = ", "max_tokens": 10, "logprobs": 1}
    async with _client(trial.base_url, trial.api_key) as client:
        reply = await client.completions.create(seed=8, **kwargs)
        chunks = [c async for c in await client.completions.create(seed=8, stream=True, **kwargs)]
    trajs = (await proxy_client.trajectories(trial.trial_id))["trajectories"]
    lp = reply.choices[0].logprobs
    assert lp is not None
    assert lp.tokens is not None
    assert lp.text_offset is not None
    ids = trajs[0]["response_ids"]
    assert lp.tokens == [tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs == pytest.approx(trajs[0]["response_logprobs"], abs=1e-6)
    assert lp.top_logprobs == [{t: p} for t, p in zip(lp.tokens, lp.token_logprobs, strict=True)]
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed) == 1
    assert streamed[0].token_logprobs == pytest.approx(trajs[1]["response_logprobs"], abs=1e-6)


async def test_n_streamed_choices_are_branches(proxy_client: ProxyClient, tokenizer: Any) -> None:
    """n=2 with stream: each choice streams under its own index and is its own branch;
    the same request unstreamed gives the same choices."""
    trial = await proxy_client.create_session()
    kwargs: dict[str, Any] = {"model": "m", "prompt": "a b c", "max_tokens": 16, "n": 2, "seed": 6}
    async with _client(trial.base_url, trial.api_key) as client:
        whole = await client.completions.create(**kwargs)
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    export = await proxy_client.trajectories(trial.trial_id)
    assert len(export["trajectories"]) == 4
    assert len({tuple(t["prompt_ids"]) for t in export["trajectories"]}) == 1


async def test_stop_string_cuts_the_text(proxy_client: ProxyClient) -> None:
    """A stop string ends the reply before it; the sampled tokens are still recorded."""
    trial = await proxy_client.create_session(sampling={"seed": 2})
    async with _client(trial.base_url, trial.api_key) as client:
        free = await client.completions.create(model="m", prompt="words:", max_tokens=30)
        text = free.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip()
        cut = await client.completions.create(
            model="m", prompt="words:", max_tokens=30, stop=[stop]
        )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    turns = [
        t
        for tr in (await proxy_client.trajectories(trial.trial_id))["trajectories"]
        for t in tr["turns"]
    ]
    assert turns[1]["stop_sequence"] == stop


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"prompt": ["one", "two"]}, "unsupported"),
        ({"prompt": [[1, 2], [3, 4]]}, "unsupported"),
        ({"prompt": "hi", "echo": True}, "unsupported"),
        ({"prompt": "hi", "suffix": "end"}, "unsupported"),
        ({"prompt": "hi", "best_of": 3}, "unsupported"),
        ({"prompt": [1, 2, 10_000_000]}, "invalid_request"),
        ({"prompt": [1, -2]}, "invalid_request"),
        ({"prompt": ""}, "invalid_request"),
        ({"prompt": []}, "invalid_request"),
        ({"prompt": {"text": "hi"}}, "invalid_request"),
        ({"prompt": "hi", "logprobs": 99}, "invalid_request"),
        ({}, "invalid_request"),
    ],
)
async def test_bad_input_is_an_openai_400_and_changes_nothing(
    proxy_client: ProxyClient, body: dict[str, Any], code: str
) -> None:
    """Batches, echo, out-of-vocabulary ids and malformed prompts are refused in OpenAI's
    error shape before anything is dispatched; the session stays empty."""
    trial = await proxy_client.create_session()
    headers = {"Authorization": f"Bearer {trial.api_key}"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{trial.base_url}/completions", json={"model": "m", **body}, headers=headers
        ) as response,
    ):
        assert response.status == 400
        payload = await response.json()
    assert set(payload) == {"error"}
    assert payload["error"]["code"] == code
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"]
    summary = await proxy_client.get_session(trial.trial_id)
    assert summary["turns"] == 0


async def test_batch_is_refused_through_the_sdk(proxy_client: ProxyClient) -> None:
    """The official client sees a batch of prompts as a BadRequestError (400)."""
    trial = await proxy_client.create_session()
    async with _client(trial.base_url, trial.api_key) as client:
        with pytest.raises(openai.BadRequestError, match="batch of 2 prompts"):
            await client.completions.create(model="m", prompt=["one", "two"], max_tokens=4)
    assert (await proxy_client.get_session(trial.trial_id))["turns"] == 0
