"""Retried requests end to end: the official openai and anthropic clients retrying on their
own, Codex-style resends, clients that leave, against a real proxy and a paced ``instant``
worker (the scripted worker where a reply must hold a stop string). Every test counts the
generations the worker started, the turns recorded and their replays exactly, and in every
test what ``build_samples`` trains with its defaults is what the agent received."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anthropic import APITimeoutError as AnthropicTimeoutError
from anthropic import AsyncAnthropic
from openai import APITimeoutError, AsyncOpenAI
from transformers import AutoTokenizer

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from sdk.samples import build_samples
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.e2e.link import Link
from tests.scripted_worker import PacedScriptedEngine, tiny_reply
from worker_client.backends.instant import InstantEngine
from worker_client.client import ServedModel, WorkerClient

pytestmark = pytest.mark.e2e

# Eight tokens at 20 per second: a reply takes 0.4 s, long enough to be cut while it runs.
REPLY_TOKENS = 8
TOKENS_PER_SECOND = 20.0
PROMPT = "list the files"
APIS = ("chat", "anthropic", "responses", "completions")


@dataclass(slots=True)
class Stack:
    running: RunningProxy
    client: ProxyClient
    tokenizer: Any
    data_dir: Path
    model_dir: Path
    engine: InstantEngine  # its ``served`` counts the generations the worker started
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def generations(self, since: int) -> int:
        """Generations the worker started since its count was ``since``."""
        return self.engine.served - since


def _start_worker(running: RunningProxy, model_dir: Path) -> InstantEngine:
    engine = InstantEngine.load(
        model_dir, reply_tokens=REPLY_TOKENS, tokens_per_second=TOKENS_PER_SECOND
    )
    worker = WorkerClient(running.worker_url, {engine.card.name: ServedModel(engine, model_dir)})
    running.worker_tasks.append(asyncio.get_running_loop().create_task(worker.run()))
    return engine


async def _start(
    model_dir: Path, data_dir: Path, port: int = 0
) -> tuple[RunningProxy, InstantEngine]:
    config = ProxyConfig(
        port=port,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=64,
        data_dir=data_dir,
        cache_dir=data_dir.parent / "proxy-cache",
    )
    running = await start_proxy(config)
    engine = _start_worker(running, model_dir)
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    return running, engine


@pytest.fixture(scope="module")
async def stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    data_dir = tmp_path_factory.mktemp("retries") / "data"
    running, engine = await _start(tiny_model_dir, data_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with ProxyClient(running.url) as client:
        yield Stack(running, client, tokenizer, data_dir, tiny_model_dir, engine)
    await running.stop()


@pytest.fixture
async def link(stack: Stack) -> AsyncIterator[Link]:
    port = int(stack.running.url.rsplit(":", 1)[1])
    hop = Link(port)
    await hop.start()
    yield hop
    await hop.stop()


# ---------------------------------------------------------------------- agents


async def ask(
    api: str,
    base_url: str,
    api_key: str,
    *,
    stream: bool,
    max_retries: int = 2,
    client_timeout: float = 60.0,
    prompt: str = PROMPT,
) -> str:
    """One model call through the official client of ``api``; the text the agent got."""
    if api == "anthropic":
        async with AsyncAnthropic(
            base_url=base_url.removesuffix("/v1"),
            api_key=api_key,
            max_retries=max_retries,
            timeout=client_timeout,
        ) as anthropic:
            return await _ask_anthropic(anthropic, prompt, stream)
    async with AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=max_retries, timeout=client_timeout
    ) as openai:
        if api == "responses":
            return await _ask_responses(openai, prompt, stream)
        if api == "completions":
            return await _ask_completions(openai, prompt, stream)
        return await _ask_chat(openai, prompt, stream)


async def _ask_anthropic(anthropic: AsyncAnthropic, prompt: str, stream: bool) -> str:
    messages: Any = [{"role": "user", "content": prompt}]
    if not stream:
        message = await anthropic.messages.create(model="any", max_tokens=64, messages=messages)
        return "".join(b.text for b in message.content if b.type == "text")
    parts = []
    events = await anthropic.messages.create(
        model="any", max_tokens=64, messages=messages, stream=True
    )
    async for event in events:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            parts.append(event.delta.text)
    return "".join(parts)


async def _ask_responses(openai: AsyncOpenAI, prompt: str, stream: bool) -> str:
    if not stream:
        response = await openai.responses.create(model="any", input=prompt)
        return response.output_text
    parts = []
    async for event in await openai.responses.create(model="any", input=prompt, stream=True):
        if event.type == "response.output_text.delta":
            parts.append(event.delta)
    return "".join(parts)


async def _ask_chat(openai: AsyncOpenAI, prompt: str, stream: bool) -> str:
    chat: Any = [{"role": "user", "content": prompt}]
    if not stream:
        completion = await openai.chat.completions.create(model="any", messages=chat)
        return completion.choices[0].message.content or ""
    parts = []
    chunks = await openai.chat.completions.create(model="any", messages=chat, stream=True)
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


async def _ask_completions(openai: AsyncOpenAI, prompt: str, stream: bool) -> str:
    if not stream:
        completion = await openai.completions.create(model="any", prompt=prompt)
        return completion.choices[0].text
    parts = []
    async for chunk in await openai.completions.create(model="any", prompt=prompt, stream=True):
        parts += [c.text for c in chunk.choices if c.text]
    return "".join(parts)


def trained_texts(export: dict[str, Any], tokenizer: Any, **options: Any) -> list[str]:
    """The text of every stretch of sampled tokens ``build_samples`` trains (mask 1)."""
    texts = []
    for sample in build_samples(export, **options):
        for turn in sample.turns:
            start, end = turn["response_start"], turn["response_end"]
            if end > start and all(sample.response_mask[start:end]):
                ids = sample.response_ids[start:end]
                texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return sorted(texts)


def turn_texts(export: dict[str, Any], tokenizer: Any) -> dict[int, str]:
    """Every recorded turn's sampled text, by turn index."""
    out = {}
    for traj in export["trajectories"]:
        for turn in traj["turns"]:
            ids = traj["response_ids"][turn["response_start"] : turn["response_end"]]
            out[turn["turn"]] = tokenizer.decode(ids, skip_special_tokens=True)
    return out


def turns_of(export: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {t["turn"]: t for traj in export["trajectories"] for t in traj["turns"]}


async def metric(stack: Stack, name: str, api: str) -> float:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{stack.running.url}/metrics") as response,
    ):
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(f'{name}_total{{api="{api}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


API_NAMES = {
    "chat": "openai.chat",
    "anthropic": "anthropic.messages",
    "responses": "openai.responses",
    "completions": "openai.completions",
}


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", APIS)
async def test_sdk_retry_after_the_reply_was_lost_gets_the_recorded_reply(
    stack: Stack, link: Link, api: str, stream: bool
) -> None:
    """The connection drops after the proxy wrote the whole reply: the client's own retry
    (retry count 1) gets that recorded reply again in its API and mode, nothing is sampled,
    the tree keeps one turn, and that turn is what is trained."""
    trial = await stack.client.create_session()
    replayed = await metric(stack, "relay_turns_replayed", API_NAMES[api])
    served = stack.engine.served
    link.plans = ["after"]
    got = await ask(api, link.url(trial.base_url), trial.api_key, stream=stream)
    export = await stack.client.trajectories(trial.trial_id)
    assert stack.generations(served) == 1
    (turn,) = turns_of(export).values()
    assert turn["delivered"] is True
    assert turn["replays"] == 1
    assert turn["retry_of"] is None
    assert turn_texts(export, stack.tokenizer)[0] == got
    assert trained_texts(export, stack.tokenizer) == [got]
    assert await metric(stack, "relay_turns_replayed", API_NAMES[api]) == replayed + 1


@pytest.mark.parametrize("api", ["chat", "anthropic", "completions"])
async def test_sdk_retry_after_the_connection_dropped_mid_stream_samples_anew(
    stack: Stack, link: Link, api: str
) -> None:
    """The connection drops while a stream is sampled: the cut attempt stays in the export
    (undelivered), the client's retry is sampled anew as ``retry_of`` it, and only the
    reply the agent got is trained."""
    trial = await stack.client.create_session()
    served = stack.engine.served
    link.plans = ["before"]
    got = await ask(api, link.url(trial.base_url), trial.api_key, stream=True)
    export = await stack.client.trajectories(trial.trial_id)
    assert stack.generations(served) == 2  # the cut attempt, then the retry's
    turns = turns_of(export)
    assert sorted(turns) == [0, 1]
    assert [turns[0]["replays"], turns[1]["replays"]] == [0, 0]
    assert turns[0]["truncated"] is True
    assert turns[0]["delivered"] is False
    assert turns[1]["retry_of"] == 0
    assert turns[1]["delivered"] is True
    assert turn_texts(export, stack.tokenizer)[1] == got
    assert trained_texts(export, stack.tokenizer) == [got]
    # The cut attempt is kept for whoever asks for it.
    assert len(build_samples(export)) == 1
    assert len(build_samples(export, keep_undelivered=True)) == 2
    # The viewer shows the same.
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{stack.running.url}/ui/api/sessions/{trial.trial_id}") as response,
    ):
        shown = (await response.json())["turns"]
    assert [(t["delivered"], t["retry_of"]) for t in shown] == [(False, None), (True, 0)]


@pytest.mark.parametrize("api", ["chat", "anthropic", "completions"])
async def test_sdk_timeouts_against_a_paced_worker_get_one_generation(
    stack: Stack, api: str
) -> None:
    """A client timeout shorter than the reply (0.15 s against 0.4 s): the reply is still
    sampled to its end after the client gives up, and the client's own retry gets it from
    the record. One generation, one turn, trained once: what the agent received."""
    trial = await stack.client.create_session()
    served = stack.engine.served
    replayed = await metric(stack, "relay_turns_replayed", API_NAMES[api])
    got = await ask(
        api, trial.base_url, trial.api_key, stream=False, max_retries=4, client_timeout=0.15
    )
    export = await stack.client.trajectories(trial.trial_id)
    assert stack.generations(served) == 1
    (turn,) = turns_of(export).values()
    # Answered once from the record: a retry that times out while it waits for the
    # generation leaves before it is answered, so it is no replay.
    assert turn["replays"] == 1
    assert await metric(stack, "relay_turns_replayed", API_NAMES[api]) == replayed + 1
    assert turn["retry_of"] is None
    assert turn["delivered"] is True
    assert turn_texts(export, stack.tokenizer)[0] == got
    assert trained_texts(export, stack.tokenizer) == [got]


async def test_a_client_that_times_out_and_never_retries_trains_nothing(stack: Stack) -> None:
    """A whole reply whose client gave up and never came back is recorded (for a retry
    that does not come) but not delivered, and not trained."""
    trial = await stack.client.create_session()
    served = stack.engine.served
    with pytest.raises(APITimeoutError):
        await ask(
            "chat", trial.base_url, trial.api_key, stream=False, max_retries=0, client_timeout=0.1
        )
    export = await _settled(stack, trial.trial_id, 1)
    assert stack.generations(served) == 1
    (turn,) = turns_of(export).values()
    assert turn["replays"] == 0
    assert turn["truncated"] is False
    assert turn["delivered"] is False
    assert trained_texts(export, stack.tokenizer) == []
    assert len(build_samples(export, keep_undelivered=True)) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_codex_style_resend_with_the_same_client_request_id(
    stack: Stack, stream: bool
) -> None:
    """A Responses request sent again whole with the same ``x-client-request-id`` (what
    Codex does after a dropped stream) and no retry count: after a reply that went out it
    is answered from the record; after a cut one it is sampled anew."""
    trial = await stack.client.create_session()
    served = stack.engine.served
    url = f"{trial.base_url}/responses"
    body = {"model": "any", "input": PROMPT, "stream": stream}
    headers = {"Authorization": f"Bearer {trial.api_key}", "x-client-request-id": "turn-1"}
    async with aiohttp.ClientSession() as http:
        first = await _responses_text(http, url, body, headers, stream)
        again = await _responses_text(http, url, body, headers, stream)
        assert again == first
        export = await stack.client.trajectories(trial.trial_id)
        (turn,) = turns_of(export).values()
        assert turn["replays"] == 1
        assert stack.generations(served) == 1
        # The next request of the conversation: cut after its first event, then resent.
        body2 = {"model": "any", "input": "and now?", "stream": True}
        headers2 = headers | {"x-client-request-id": "turn-2"}
        async with http.post(url, json=body2, headers=headers2) as response:
            await response.content.readline()
        received = await _responses_text(http, url, body2, headers2, True)
    export = await _settled(stack, trial.trial_id, 3)
    assert stack.generations(served) == 3  # the first reply, the cut one, its resend
    turns = turns_of(export)
    assert sorted(turns) == [0, 1, 2]
    assert [turns[i]["replays"] for i in range(3)] == [1, 0, 0]
    assert [turns[i]["retry_of"] for i in range(3)] == [None, None, 1]
    assert [turns[i]["truncated"] for i in range(3)] == [False, True, False]
    assert turns[1]["delivered"] is False
    assert trained_texts(export, stack.tokenizer) == sorted([first, received])


async def _responses_text(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    stream: bool,
) -> str:
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        if not stream:
            data = await response.json()
            return "".join(
                c["text"]
                for item in data["output"]
                for c in item.get("content", [])
                if c.get("type") == "output_text"
            )
        parts = []
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("type") == "response.output_text.delta":
                    parts.append(event["delta"])
        return "".join(parts)


async def _settled(stack: Stack, trial_id: str, turns: int) -> dict[str, Any]:
    """The export once it holds ``turns`` turns (a cut turn is recorded as its handler
    ends, a moment after the client left)."""
    export: dict[str, Any] = {}
    for _ in range(100):
        export = await stack.client.trajectories(trial_id)
        if len(turns_of(export)) >= turns:
            return export
        await asyncio.sleep(0.05)
    return export


async def test_a_client_that_leaves_and_never_returns_trains_nothing(stack: Stack) -> None:
    """A stream the client leaves after its first tokens: the cut turn is in the export,
    undelivered, and trains nothing (the agent never had the whole reply)."""
    trial = await stack.client.create_session()
    served = stack.engine.served
    undelivered = await metric(stack, "relay_turns_undelivered", "openai.chat")
    url = f"{trial.base_url}/chat/completions"
    body = {"model": "any", "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url, json=body, headers={"Authorization": f"Bearer {trial.api_key}"}) as r,
    ):
        for _ in range(3):
            await r.content.readline()
    export = await _settled(stack, trial.trial_id, 1)
    assert stack.generations(served) == 1
    (turn,) = turns_of(export).values()
    assert turn["replays"] == 0
    assert turn["truncated"] is True
    assert turn["delivered"] is False
    assert trained_texts(export, stack.tokenizer) == []
    summary = await stack.client.get_session(trial.trial_id)
    assert summary["undelivered_turns"] == 1
    assert await metric(stack, "relay_turns_undelivered", "openai.chat") == undelivered + 1


@pytest.mark.parametrize("api", APIS)
async def test_identical_requests_without_a_marker_are_new_samples(stack: Stack, api: str) -> None:
    """The same body twice, no retry count, no request id, the first reply delivered
    (best-of-n by repeated calls): two samples, both trained."""
    trial = await stack.client.create_session()
    served = stack.engine.served
    first = await ask(api, trial.base_url, trial.api_key, stream=False, max_retries=0)
    second = await ask(api, trial.base_url, trial.api_key, stream=False, max_retries=0)
    assert first != second
    export = await stack.client.trajectories(trial.trial_id)
    assert stack.generations(served) == 2
    turns = turns_of(export)
    assert sorted(turns) == [0, 1]
    assert all(t["retry_of"] is None and t["replays"] == 0 for t in turns.values())
    assert trained_texts(export, stack.tokenizer) == sorted([first, second])


async def test_a_retry_while_the_first_attempt_generates_joins_it(stack: Stack) -> None:
    """A marked retry that arrives while the first attempt is still sampling waits for it:
    one generation, the same reply to both, one turn trained once."""
    trial = await stack.client.create_session()
    served = stack.engine.served
    url = f"{trial.base_url}/chat/completions"
    body = {"model": "any", "messages": [{"role": "user", "content": PROMPT}]}
    auth = {"Authorization": f"Bearer {trial.api_key}"}
    async with aiohttp.ClientSession() as http:

        async def call(headers: dict[str, str]) -> str:
            async with http.post(url, json=body, headers=auth | headers) as response:
                data = await response.json()
                return str(data["choices"][0]["message"]["content"])

        first = asyncio.create_task(call({}))
        await asyncio.sleep(0.1)
        retried = await call({"x-stainless-retry-count": "1"})
        assert await first == retried
    export = await stack.client.trajectories(trial.trial_id)
    assert stack.generations(served) == 1
    (turn,) = turns_of(export).values()
    assert turn["replays"] == 1
    assert turn["delivered"] is True
    assert trained_texts(export, stack.tokenizer) == [retried]


@contextlib.contextmanager
def _store_locked(data_dir: Path) -> Iterator[sqlite3.Connection]:
    """Hold the store's write lock: the proxy's commits wait (a slow disk)."""
    db = sqlite3.connect(data_dir / "relay.db", timeout=5)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    finally:
        db.rollback()
        db.close()


async def test_a_reply_committed_but_never_delivered_is_replayed_after_a_restart(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The client leaves while its whole reply is being committed: the turn is recorded
    undelivered. The proxy restarts, and the client's retry without any marker (Claude
    Code's own loop, retry count 0) gets that committed reply; the chain stays one
    chain and trains exactly what the agent received."""
    data_dir = tmp_path / "data"
    running, engine = await _start(tiny_model_dir, data_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    try:
        async with ProxyClient(running.url) as client:
            trial = await client.create_session()
            url = f"{trial.base_url}/chat/completions"
            body = {"model": "any", "messages": [{"role": "user", "content": PROMPT}]}
            headers = {"Authorization": f"Bearer {trial.api_key}", "x-stainless-retry-count": "0"}
            with _store_locked(data_dir):
                async with aiohttp.ClientSession() as http:
                    request = asyncio.create_task(http.post(url, json=body, headers=headers))
                    for _ in range(100):  # recorded in memory; its commit waits on the lock
                        if (await client.get_session(trial.trial_id))["turns"] == 1:
                            break
                        await asyncio.sleep(0.05)
                    request.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await request
            summary = await client.get_session(trial.trial_id)
            assert summary["turns"] == 1
            assert engine.served == 1
        port = int(running.url.rsplit(":", 1)[1])
        await running.stop()
        running, engine = await _start(tiny_model_dir, data_dir, port)  # the base URL holds
        async with ProxyClient(running.url) as client:
            export = await client.trajectories(trial.trial_id)
            (turn,) = turns_of(export).values()
            assert turn["delivered"] is False
            assert turn["truncated"] is False
            assert trained_texts(export, tokenizer) == []
            async with (
                aiohttp.ClientSession() as http,
                http.post(url, json=body, headers=headers) as r,
            ):
                got = (await r.json())["choices"][0]["message"]["content"]
            export = await client.trajectories(trial.trial_id)
            assert engine.served == 0  # answered from the store: nothing sampled anew
            (turn,) = turns_of(export).values()
            assert turn["delivered"] is True
            assert turn["replays"] == 1
            assert turn_texts(export, tokenizer)[0] == got
            assert trained_texts(export, tokenizer) == [got]
    finally:
        await running.stop()


# A reply whose stop string comes after 40 tokens paced 20 ms apart: a client that waits
# 0.2 s times out long before it.
STOPPED = "the agent opens every file of the project and reads it twice " * 3
STOP_STRING = "ALL DONE"


async def _ask_with_stop(
    api: str, base_url: str, api_key: str, *, client_timeout: float, retry_count: int
) -> tuple[str, str]:
    """One non-streamed call with the stop string through the official client of ``api``,
    no retry of its own (``retry_count`` is the attempt's marker): the text and the
    reason the reply ended, as the client reads them."""
    marker = {"x-stainless-retry-count": str(retry_count)}
    if api == "anthropic":
        async with AsyncAnthropic(
            base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0
        ) as anthropic:
            message = await anthropic.messages.create(
                model="any",
                max_tokens=64,
                messages=[{"role": "user", "content": PROMPT}],
                stop_sequences=[STOP_STRING],
                extra_headers=marker,
                timeout=client_timeout,
            )
            text = "".join(b.text for b in message.content if b.type == "text")
            return text, f"{message.stop_reason}:{message.stop_sequence}"
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as openai:
        if api == "completions":
            completion = await openai.completions.create(
                model="any",
                prompt=PROMPT,
                stop=[STOP_STRING],
                extra_headers=marker,
                timeout=client_timeout,
            )
            return completion.choices[0].text, completion.choices[0].finish_reason
        chat = await openai.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": PROMPT}],
            stop=[STOP_STRING],
            extra_headers=marker,
            timeout=client_timeout,
        )
        return chat.choices[0].message.content or "", chat.choices[0].finish_reason


@pytest.mark.parametrize("when", ["while_sampling", "after_recorded"])
@pytest.mark.parametrize("api", ["chat", "anthropic", "completions"])
async def test_a_timed_out_request_with_stop_strings_is_generated_once(
    scripted_stack: tuple[RunningProxy, PacedScriptedEngine],
    scripted: PacedScriptedEngine,
    scripted_client: ProxyClient,
    api: str,
    when: str,
) -> None:
    """A non-streamed request with a stop string whose client times out: the reply is
    sampled on to its stop string, recorded whole and undelivered, and the client's retry
    (retry count 1) gets it, joined while it is sampled or replayed once recorded. One
    generation, one turn, one replay, ended by the stop string; trained once."""
    scripted.delay = 0.02
    scripted.policy = lambda prompt: tiny_reply(f"{STOPPED}{STOP_STRING} and more words")
    trial = await scripted_client.create_session()
    with pytest.raises((APITimeoutError, AnthropicTimeoutError)):
        await _ask_with_stop(api, trial.base_url, trial.api_key, client_timeout=0.2, retry_count=0)
    if when == "after_recorded":
        deadline = asyncio.get_running_loop().time() + 30 * TIMEOUT_FACTOR
        while (await scripted_client.get_session(trial.trial_id))["turns"] == 0:
            assert asyncio.get_running_loop().time() < deadline, "no turn recorded"
            await asyncio.sleep(0.05)
    got, ended = await _ask_with_stop(
        api, trial.base_url, trial.api_key, client_timeout=60 * TIMEOUT_FACTOR, retry_count=1
    )
    export = await scripted_client.trajectories(trial.trial_id)
    tokenizer = scripted.tokenizer
    assert len(scripted.prompts) == 1  # one generation for the two attempts
    (turn,) = turns_of(export).values()
    assert (turn["truncated"], turn["delivered"], turn["replays"]) == (False, True, 1)
    assert turn["stop_sequence"] == STOP_STRING
    assert ended == (f"stop_sequence:{STOP_STRING}" if api == "anthropic" else "stop")
    assert got == STOPPED
    assert turn_texts(export, tokenizer)[0].startswith(got)
    (trained,) = trained_texts(export, tokenizer)
    assert trained.startswith(got)
