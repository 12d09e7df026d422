"""The real vLLM engine (CPU build) behind the real proxy, through the official clients:
every recorded logprob is transformers' float32 teacher forcing within 1e-4."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from sdk.client import ProxyClient, TrialSession
from sdk.fidelity import check_fidelity
from tests.e2e.vllm.conftest import TIMEOUT_FACTOR, Served, within
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-4
HI = [{"role": "user", "content": "Hi there, which tools can you use?"}]


@pytest.fixture(scope="session")
def teacher(text_model: Path) -> HFEngine:
    """transformers on the served checkpoint, float32: the trainer's view."""
    return HFEngine.load(text_model)


@pytest.fixture
async def proxy(served: Served) -> Any:
    async with ProxyClient(served.proxy.url) as client:
        yield client


async def _trial(proxy: ProxyClient, **sampling: Any) -> TrialSession:
    return await proxy.create_session(sampling={"temperature": 1.0, "top_p": 1.0, **sampling})


def _openai(trial: TrialSession) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)


async def _gap(proxy: ProxyClient, trial: TrialSession, teacher: HFEngine) -> Any:
    """The fidelity report of the trial's trajectories against ``teacher``."""
    export = await proxy.trajectories(trial.trial_id)
    return check_fidelity(export, teacher.score)


async def test_models_name_the_engine_settings(served: Served, proxy: ProxyClient) -> None:
    """/v1/models names the vllm backend and the settings it computes with: float32 (the
    checkpoint's dtype on CPU), eager, the context window given."""
    trial = await _trial(proxy)
    async with aiohttp.ClientSession() as http, http.get(f"{trial.base_url}/models") as r:
        (model,) = (await r.json())["data"]
    (engine,) = model["engines"]
    assert engine["backend"] == "vllm"
    assert (engine["dtype"], engine["enforce_eager"], engine["max_model_len"]) == (
        "float32",
        True,
        4096,
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completions(proxy: ProxyClient, teacher: HFEngine, stream: bool) -> None:
    """A chat turn, streamed and not, records what vLLM sampled at teacher forcing's logprobs."""
    trial = await _trial(proxy)
    client = _openai(trial)
    if stream:
        chunks = await client.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=24,
            stream=True,  # type: ignore[arg-type]
        )
        async for _ in chunks:
            pass
    else:
        await client.chat.completions.create(model="tiny", messages=HI, max_tokens=24)  # type: ignore[arg-type]
    report = await _gap(proxy, trial, teacher)
    assert report.sampled_tokens > 0
    assert within(report, TOLERANCE), report


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages(proxy: ProxyClient, teacher: HFEngine, stream: bool) -> None:
    """Anthropic Messages through the official client, streamed and not."""
    trial = await _trial(proxy)
    client = anthropic.AsyncAnthropic(
        base_url=trial.anthropic_base_url, api_key=trial.api_key, max_retries=0
    )
    if stream:
        async with client.messages.stream(model="tiny", max_tokens=24, messages=HI) as events:  # type: ignore[arg-type]
            await events.get_final_message()
    else:
        await client.messages.create(model="tiny", max_tokens=24, messages=HI)  # type: ignore[arg-type]
    report = await _gap(proxy, trial, teacher)
    assert report.sampled_tokens > 0
    assert within(report, TOLERANCE), report


@pytest.mark.parametrize("stream", [False, True])
async def test_responses(proxy: ProxyClient, teacher: HFEngine, stream: bool) -> None:
    """The Responses API through the official client, streamed and not."""
    trial = await _trial(proxy)
    client = _openai(trial)
    if stream:
        events = await client.responses.create(
            model="tiny",
            input=HI,
            max_output_tokens=24,
            stream=True,  # type: ignore[arg-type]
        )
        async for _ in events:
            pass
    else:
        await client.responses.create(model="tiny", input=HI, max_output_tokens=24)  # type: ignore[arg-type]
    report = await _gap(proxy, trial, teacher)
    assert report.sampled_tokens > 0
    assert within(report, TOLERANCE), report


async def test_a_chain_continues_with_the_sampled_ids(
    proxy: ProxyClient, teacher: HFEngine
) -> None:
    """Three turns, each sending the history back: one trajectory whose earlier replies are
    the sampled ids verbatim (vLLM reuses their KV from its prefix cache), all of it at
    teacher forcing's logprobs."""
    trial = await _trial(proxy)
    client = _openai(trial)
    messages: list[dict[str, Any]] = list(HI)
    for turn in range(3):
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)  # type: ignore[arg-type]
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"And then, step {turn}?"},
        ]
    export = await proxy.trajectories(trial.trial_id)
    (trajectory,) = export["trajectories"]
    assert len(trajectory["turns"]) == 3
    report = check_fidelity(export, teacher.score)
    assert within(report, TOLERANCE), report


async def test_the_cap_and_stop_strings(proxy: ProxyClient, teacher: HFEngine) -> None:
    """max_tokens caps what vLLM samples (finish "length"); a stop string taken from a
    seeded reply ends the same seeded reply there (finish "stop")."""
    trial = await _trial(proxy, seed=7)
    client = _openai(trial)
    capped = await client.chat.completions.create(model="tiny", messages=HI, max_tokens=5)  # type: ignore[arg-type]
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage is not None
    assert capped.usage.completion_tokens == 5
    long = await client.chat.completions.create(model="tiny", messages=HI, max_tokens=32, seed=7)  # type: ignore[arg-type]
    text = long.choices[0].message.content or ""
    assert len(text) > 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = await client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=32,
        seed=7,
        stop=[stop],  # type: ignore[arg-type]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in (cut.choices[0].message.content or "")
    assert text.startswith(cut.choices[0].message.content or "")
    report = await _gap(proxy, trial, teacher)
    assert within(report, TOLERANCE), report


async def test_several_trials_at_once(proxy: ProxyClient, teacher: HFEngine) -> None:
    """Six trials' turns at once share the engine's batches; each records its own."""
    trials = [await _trial(proxy) for _ in range(6)]

    async def turn(trial: TrialSession) -> None:
        await _openai(trial).chat.completions.create(model="tiny", messages=HI, max_tokens=16)  # type: ignore[arg-type]

    await asyncio.gather(*(turn(t) for t in trials))
    for trial in trials:
        report = await _gap(proxy, trial, teacher)
        assert within(report, TOLERANCE), report


async def test_a_client_that_hangs_up_aborts_the_engines_request(
    served: Served, proxy: ProxyClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed chat whose client leaves after the first event: the worker aborts the
    request in vLLM, which then holds nothing unfinished."""
    trial = await _trial(proxy, temperature=2.0)
    body = {"model": "tiny", "messages": HI, "max_tokens": 2000, "stream": True}
    engine, llm = served.engine, served.engine._llm
    aborted: list[str] = []
    abort = engine.abort

    async def recording(request_id: str) -> None:
        aborted.append(request_id)
        await abort(request_id)

    monkeypatch.setattr(engine, "abort", recording)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{trial.base_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {trial.api_key}"},
        ) as r,
    ):
        assert r.status == 200
        await r.content.readline()
    deadline = asyncio.get_running_loop().time() + 10 * TIMEOUT_FACTOR
    while not aborted or llm.output_processor.get_num_unfinished_requests():
        assert asyncio.get_running_loop().time() < deadline, "vLLM kept the request"
        await asyncio.sleep(0.05)
