"""Which agent made a turn, and which call spawned it, through the real proxy, relay and a
scripted worker, over the Anthropic Messages API and OpenAI chat completions (streamed and
not, with and without the agent's headers): a sub-agent takes the call whose prompt is
exactly its first message, in the order calls were made, also while the reply that made
the call still streams and across a restart, and never through a refused request; side
requests (auxiliary, Claude Code's title) never cost the main agent its training data."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient, TrialSession
from sdk.samples import TRAINED_KINDS, BranchPolicy, Sample, build_samples, main_sample
from tests.e2e.conftest import IN_PROCESS_STREAMS, TIMEOUT_FACTOR
from tests.scripted_worker import PacedScriptedEngine, serve_scripted, tiny_reply
from worker_client.engine import TokenChunk

pytestmark = pytest.mark.e2e

Json = dict[str, Any]

SCHEMA: Json = {
    "type": "object",
    "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
    "required": ["prompt"],
}
ANTHROPIC_TOOLS = [
    {"name": "Agent", "description": "Run a sub-agent on a task.", "input_schema": SCHEMA}
]
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Agent",
            "description": "Run a sub-agent on a task.",
            "parameters": SCHEMA,
        },
    }
]
MAIN_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude."
# Claude Code 2.1.197's title request: this system prompt, one user message, no tools.
TITLE_SYSTEM = (
    "Generate a concise, sentence-case title (3-7 words) that captures the main topic or goal "
    "of this coding session. The title should be clear enough that the user recognizes the "
    "session in a list. Use sentence case: capitalize only the first word and proper nouns."
)
# What Claude Code puts before the prompt in a sub-agent's first user message.
REMINDER = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following "
    "context:\n# important-instruction-reminders\nDo what has been asked; nothing more, "
    "nothing less.\n</system-reminder>\n"
)
QUESTION = "How many files are there?"
END = "<|im_end|>"  # the tiny model's end of turn, which ends every scripted reply


@dataclass(frozen=True)
class Wire:
    """An API and whether its replies stream."""

    api: str  # "anthropic" | "openai"
    stream: bool

    def __str__(self) -> str:
        return self.api + ("-stream" if self.stream else "")

    def user(self, *texts: str) -> Json:
        """A user message: one text, or one text block per text."""
        content: str | list[Json] = (
            texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        )
        return {"role": "user", "content": content}


WIRES = [Wire(api, stream) for api in ("anthropic", "openai") for stream in (False, True)]
BY_WIRE = pytest.mark.parametrize("wire", WIRES, ids=str)
BY_HEADERS = pytest.mark.parametrize("named", [False, True], ids=["no-headers", "agent-headers"])


@dataclass(frozen=True)
class Call:
    """A tool call as the agent received it."""

    id: str
    name: str
    input: Json


@dataclass
class Reply:
    status: int
    body: Any = None  # the error body when the request was refused
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    message: Json = field(default_factory=dict)  # the assistant message, for the history


OnCall = Callable[[Call], Awaitable[None]]


@dataclass
class Agent:
    """An agent's raw HTTP to its trial."""

    http: aiohttp.ClientSession
    trial: TrialSession
    wire: Wire

    async def send(
        self,
        messages: Sequence[Json],
        headers: dict[str, str] | None = None,
        *,
        system: str | None = MAIN_SYSTEM,
        tools: bool = True,
        on_call: OnCall | None = None,
    ) -> Reply:
        """One request; ``on_call`` is awaited as each tool call of a streamed reply is
        complete in the stream (the stream waits meanwhile)."""
        body: Json = {"model": "m", "max_tokens": 64, "stream": self.wire.stream}
        if self.wire.api == "anthropic":
            url = f"{self.trial.anthropic_base_url}/v1/messages"
            auth = {"x-api-key": self.trial.api_key}
            body["messages"] = list(messages)
            if system is not None:
                body["system"] = system
            if tools:
                body["tools"] = ANTHROPIC_TOOLS
        else:
            url = f"{self.trial.base_url}/chat/completions"
            auth = {"Authorization": f"Bearer {self.trial.api_key}"}
            head = [] if system is None else [{"role": "system", "content": system}]
            body["messages"] = [*head, *messages]
            if tools:
                body["tools"] = OPENAI_TOOLS
        async with self.http.post(url, json=body, headers={**auth, **(headers or {})}) as response:
            if response.status != 200:
                return Reply(response.status, await response.json())
            if not self.wire.stream:
                return _whole(self.wire.api, await response.json())
            if self.wire.api == "anthropic":
                return await _anthropic_stream(response, on_call)
            return await _openai_stream(response, on_call)

    async def ok(
        self,
        messages: Sequence[Json],
        headers: dict[str, str] | None = None,
        *,
        system: str | None = MAIN_SYSTEM,
        tools: bool = True,
        on_call: OnCall | None = None,
    ) -> Reply:
        reply = await self.send(messages, headers, system=system, tools=tools, on_call=on_call)
        assert reply.status == 200, reply.body
        return reply


def _openai_message(text: str, calls: Sequence[tuple[str, str, str]]) -> Json:
    """The assistant message of a chat completion: its text and calls (id, name, arguments)."""
    message: Json = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ]
    return message


def _whole(api: str, body: Json) -> Reply:
    if api == "anthropic":
        blocks = body["content"]
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        calls = [Call(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
        return Reply(200, body, text, calls, {"role": "assistant", "content": blocks})
    message = body["choices"][0]["message"]
    raw = [
        (c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls") or []
    ]
    text = message.get("content") or ""
    calls = [Call(i, n, json.loads(a)) for i, n, a in raw]
    return Reply(200, body, text, calls, _openai_message(text, raw))


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[Json]:
    """The JSON payloads of a server-sent event stream, as they arrive."""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _anthropic_stream(response: aiohttp.ClientResponse, on_call: OnCall | None) -> Reply:
    blocks: dict[int, Json] = {}
    partial: dict[int, str] = {}
    calls: list[Call] = []
    async for event in _events(response):
        kind = event["type"]
        if kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
            partial[event["index"]] = ""
        elif kind == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] += delta["partial_json"]
        elif kind == "content_block_stop":
            block = blocks[event["index"]]
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial[event["index"]] or "{}")
                calls.append(Call(block["id"], block["name"], block["input"]))
                if on_call is not None:
                    await on_call(calls[-1])
    content = [blocks[i] for i in sorted(blocks)]
    text = "".join(b["text"] for b in content if b["type"] == "text")
    return Reply(200, None, text, calls, {"role": "assistant", "content": content})


def _complete(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


async def _openai_stream(response: aiohttp.ClientResponse, on_call: OnCall | None) -> Reply:
    text = ""
    parts: dict[int, list[str]] = {}  # per call index: id, name, arguments
    told: set[int] = set()
    async for chunk in _events(response):
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                entry = parts.setdefault(piece["index"], ["", "", ""])
                entry[0] = piece.get("id") or entry[0]
                function = piece.get("function") or {}
                entry[1] += function.get("name") or ""
                entry[2] += function.get("arguments") or ""
        for index, (call_id, name, arguments) in sorted(parts.items()):
            if index not in told and call_id and _complete(arguments):
                told.add(index)
                if on_call is not None:
                    await on_call(Call(call_id, name, json.loads(arguments)))
    raw = [(i, n, a) for i, n, a in (parts[k] for k in sorted(parts))]
    calls = [Call(i, n, json.loads(a)) for i, n, a in raw]
    return Reply(200, None, text, calls, _openai_message(text, raw))


def _sub(agent: str) -> dict[str, str]:
    """The headers Claude Code sends on a sub-agent's requests."""
    return {"x-claude-code-agent-id": agent, "X-Claude-Code-Session-Id": "s1"}


def _named(named: bool, agent: str) -> dict[str, str] | None:
    return _sub(agent) if named else None


def _spawn(*prompts: str) -> str:
    """A main reply that calls Agent once per prompt."""
    return tiny_reply("", [("Agent", {"prompt": p}) for p in prompts])


# ---------------------------------------------------------------------- the export


def _turns(export: Json) -> dict[int, Json]:
    """Every recorded turn, by index."""
    return {t["turn"]: t for traj in export["trajectories"] for t in traj["turns"]}


def _turn_of(export: Json, engine: PacedScriptedEngine, reply: str) -> int:
    """The turn whose sampled tokens are ``reply``: a scripted reply, or the text of one
    (``tiny_reply``). Each test scripts distinct replies."""
    tokenizer: Any = engine.tokenizer
    scripted = reply if reply.endswith(END) else tiny_reply(reply)
    ids = tokenizer.encode(scripted, add_special_tokens=False)
    found = {
        t["turn"]
        for traj in export["trajectories"]
        for t in traj["turns"]
        if traj["response_ids"][t["response_start"] : t["response_end"]] == ids
    }
    assert len(found) == 1, (reply, found)
    return int(found.pop())


def _spawned(turn: int, call: Call) -> Json:
    return {"turn": turn, "tool_call_id": call.id}


def _sub_agent(agent: str) -> Json:
    return {"id": agent, "parent": "main", "kind": "subagent"}


def _masks(samples: Sequence[Sample], turn: int) -> list[list[int]]:
    """The mask over ``turn``'s sampled tokens in every sample that holds it."""
    return [
        s.response_mask[t["response_start"] : t["response_end"]]
        for s in samples
        for t in s.turns
        if t["turn"] == turn
    ]


def _trained_once(samples: Sequence[Sample], turn: int) -> bool:
    """Whether one sample trains every sampled token of ``turn`` and no other trains any."""
    masks = _masks(samples, turn)
    return sum(all(m) and bool(m) for m in masks) == 1 and sum(any(m) for m in masks) == 1


# ---------------------------------------------------------------------- holding a reply


@dataclass
class Hold:
    """The engine's next reply waits before its last token until ``release`` is set."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    armed: bool = True
    held: bool = False  # the reply reached its last token and waited there
    timed_out: bool = False  # ... and nothing released it


def _hold_next_reply(engine: PacedScriptedEngine, monkeypatch: pytest.MonkeyPatch) -> Hold:
    hold = Hold()
    inner = engine.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncGenerator[TokenChunk, None]:
        mine, hold.armed = hold.armed, False
        async with contextlib.aclosing(inner(*args, **kwargs)) as stream:
            async for chunk in stream:
                if mine and chunk.finish_reason is not None:
                    hold.held = True
                    try:
                        await asyncio.wait_for(hold.release.wait(), 20 * TIMEOUT_FACTOR)
                    except TimeoutError:
                        hold.timed_out = True
                yield chunk

    monkeypatch.setattr(engine, "generate", generate)
    return hold


# ---------------------------------------------------------------------- a durable proxy

# Tokens one session of the durable proxy may store: a request adding more is refused
# after its messages are read and its prompt planned.
SESSION_TOKENS = 4000
HUGE_SYSTEM = " ".join(["context"] * 6000)


@dataclass
class Durable:
    """A proxy on a data dir, with a scripted worker that reconnects when it restarts."""

    config: ProxyConfig
    engine: PacedScriptedEngine
    running: RunningProxy

    @property
    def url(self) -> str:
        return self.running.url

    async def restart(self) -> None:
        """Stop the proxy, start it again on the same port and data dir, and wait until
        the worker has reconnected."""
        await self.running.stop()
        self.running = await start_proxy(self.config)
        await self.running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)


@pytest.fixture(scope="module")
async def durable(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Durable]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=64,
        max_session_tokens=SESSION_TOKENS,
        data_dir=tmp_path_factory.mktemp("attribution-data"),
        cache_dir=tmp_path_factory.mktemp("attribution-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
    )
    running = await start_proxy(config)
    config = dataclasses.replace(config, port=urlsplit(running.url).port or 0)
    engine = serve_scripted(running, tiny_model_dir, worker_id="attribution-durable")
    # Not one of the proxy's worker tasks: it outlives a restart, and reconnects.
    worker = running.worker_tasks.pop()
    durable = Durable(config, engine, running)
    try:
        await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        yield durable
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await worker
        await durable.running.stop()


async def _new_trial(url: str) -> TrialSession:
    async with ProxyClient(url) as client:
        return await client.create_session()


async def _export(url: str, trial: TrialSession) -> Json:
    async with ProxyClient(url) as client:
        return await client.trajectories(trial.trial_id)


# ---------------------------------------------------------------------- 1. overlapping prompts


@BY_WIRE
@BY_HEADERS
@pytest.mark.parametrize("framed", [False, True], ids=["bare", "system-reminders"])
async def test_a_sub_agent_takes_the_call_whose_prompt_is_exactly_its_message(
    scripted: PacedScriptedEngine,
    scripted_client: ProxyClient,
    wire: Wire,
    named: bool,
    framed: bool,
) -> None:
    """Of two calls whose prompts overlap ("Count files", "Count files in src"), each
    sub-agent takes the call whose prompt is exactly its first message (after Claude
    Code's system reminders), though the longer one's sub-agent comes first."""
    main_reply = _spawn("Count files", "Count files in src")
    scripted.script(main_reply, tiny_reply("Seven in src."), tiny_reply("Twelve in all."))
    trial = await scripted_client.create_session()
    async with aiohttp.ClientSession() as http:
        agent = Agent(http, trial, wire)
        main = await agent.ok([wire.user(QUESTION)])
        call_a, call_b = main.calls
        assert (call_a.input["prompt"], call_b.input["prompt"]) == (
            "Count files",
            "Count files in src",
        )
        for call, name in ((call_b, "agent-b"), (call_a, "agent-a")):
            prompt = call.input["prompt"]
            first = wire.user(REMINDER, prompt) if framed else wire.user(prompt)
            await agent.ok([first], _named(named, name))
    export = await scripted_client.trajectories(trial.trial_id)
    turns = _turns(export)
    spawner = _turn_of(export, scripted, main_reply)
    ids = (
        {call_a.id: "agent-a", call_b.id: "agent-b"} if named else {c.id: c.id for c in main.calls}
    )
    for reply, call in (("Seven in src.", call_b), ("Twelve in all.", call_a)):
        turn = turns[_turn_of(export, scripted, reply)]
        assert (turn["agent"], turn["spawned_by"]) == (
            _sub_agent(ids[call.id]),
            _spawned(spawner, call),
        ), call.input["prompt"]
    assert {t["agent"]["id"] for t in turns.values()} == {"main", *ids.values()}


@BY_WIRE
@BY_HEADERS
async def test_calls_with_the_same_prompt_are_taken_in_the_order_they_were_made(
    scripted: PacedScriptedEngine,
    scripted_client: ProxyClient,
    wire: Wire,
    named: bool,
) -> None:
    """Two calls with the same prompt: the first sub-agent to arrive takes the first call,
    the next one the second."""
    main_reply = _spawn("Look at a.py", "Look at a.py")
    scripted.script(main_reply, tiny_reply("First look."), tiny_reply("Second look."))
    trial = await scripted_client.create_session()
    async with aiohttp.ClientSession() as http:
        agent = Agent(http, trial, wire)
        main = await agent.ok([wire.user("Review a.py twice.")])
        for name in ("agent-1", "agent-2"):
            await agent.ok([wire.user("Look at a.py")], _named(named, name))
    export = await scripted_client.trajectories(trial.trial_id)
    turns = _turns(export)
    spawner = _turn_of(export, scripted, main_reply)
    for reply, call, name in zip(
        ("First look.", "Second look."), main.calls, ("agent-1", "agent-2"), strict=True
    ):
        turn = turns[_turn_of(export, scripted, reply)]
        assert turn["agent"] == _sub_agent(name if named else call.id)
        assert turn["spawned_by"] == _spawned(spawner, call)


# ---------------------------------------------------------------------- 2. a reply still streaming


@pytest.mark.parametrize("api", ["anthropic", "openai"])
@BY_HEADERS
async def test_a_sub_agent_started_while_its_parents_reply_streams(
    scripted: PacedScriptedEngine,
    scripted_client: ProxyClient,
    monkeypatch: pytest.MonkeyPatch,
    api: str,
    named: bool,
) -> None:
    """A sub-agent whose first request comes once the call is complete in its parent's
    stream, while that stream is still open, is the call's sub-agent: spawned by the main
    turn and the call."""
    wire = Wire(api, True)
    main_reply = _spawn("Count the files")
    scripted.script(main_reply, tiny_reply("Counted."))
    hold = _hold_next_reply(scripted, monkeypatch)
    trial = await scripted_client.create_session()
    seen: list[Call] = []
    async with aiohttp.ClientSession() as http:
        agent = Agent(http, trial, wire)

        async def start_sub_agent(call: Call) -> None:
            seen.append(call)
            await agent.ok([wire.user(call.input["prompt"])], _named(named, "agent-a"))
            hold.release.set()  # the parent's reply may end now

        main = await agent.ok([wire.user(QUESTION)], on_call=start_sub_agent)
    (call,) = main.calls
    assert seen == [call]
    assert hold.held
    assert not hold.timed_out, "the sub-agent's request was not answered while the reply streamed"
    export = await scripted_client.trajectories(trial.trial_id)
    turns = _turns(export)
    sub = turns[_turn_of(export, scripted, "Counted.")]
    assert (sub["agent"], sub["spawned_by"]) == (
        _sub_agent("agent-a" if named else call.id),
        _spawned(_turn_of(export, scripted, main_reply), call),
    )


# ---------------------------------------------------------------------- 3. side and title requests

AUXILIARY = [
    pytest.param({"x-relay-agent-kind": "auxiliary"}, {}, id="harness-kind"),
    pytest.param(
        {"x-claude-code-request-class": "auxiliary"},
        {"x-claude-code-request-class": "main"},
        id="claude-code-class",
    ),
]


@BY_WIRE
@pytest.mark.parametrize(("side", "main_headers"), AUXILIARY)
async def test_an_auxiliary_request_after_main_turns_leaves_them_trained(
    scripted: PacedScriptedEngine,
    scripted_client: ProxyClient,
    wire: Wire,
    side: dict[str, str],
    main_headers: dict[str, str],
) -> None:
    """An auxiliary request that continues the main conversation is not trained, and the
    two main turns before it still are (mask 1 over each, once) with ``TRAINED_KINDS``."""
    replies = ["Let me count them.", "There are three files.", "Counting files"]
    scripted.script(*(tiny_reply(r) for r in replies))
    trial = await scripted_client.create_session()
    async with aiohttp.ClientSession() as http:
        agent = Agent(http, trial, wire)
        messages = [wire.user(QUESTION)]
        for follow_up in ("Go on.", "Write a title for this conversation."):
            reply = await agent.ok(messages, main_headers)
            messages += [reply.message, wire.user(follow_up)]
        await agent.ok(messages, side)
    export = await scripted_client.trajectories(trial.trial_id)
    first, second, aside = (_turn_of(export, scripted, r) for r in replies)
    assert _turns(export)[aside]["agent"] == {"id": "main", "parent": None, "kind": "auxiliary"}
    samples = build_samples(export, kinds=TRAINED_KINDS)
    assert [_trained_once(samples, t) for t in (first, second)] == [True, True], [
        (s.agent_id, s.agent_kind, [t["turn"] for t in s.turns]) for s in samples
    ]
    assert not any(any(m) for m in _masks(samples, aside))


@BY_WIRE
async def test_a_title_request_is_the_main_agents_auxiliary_turn(
    scripted: PacedScriptedEngine, scripted_client: ProxyClient, wire: Wire
) -> None:
    """Claude Code's title request (no headers, no tools, its title instruction as the
    system prompt, one user message), sent before and after the main turns, is the main
    agent's auxiliary turn: never the main sample, and no sample with ``TRAINED_KINDS``."""
    replies = ["Counting project files", "Let me count them.", "There are three files."]
    scripted.script(*(tiny_reply(r) for r in [*replies, "Count the project files"]))
    trial = await scripted_client.create_session()
    async with aiohttp.ClientSession() as http:
        agent = Agent(http, trial, wire)
        question = wire.user(QUESTION)
        await agent.ok([question], system=TITLE_SYSTEM, tools=False)
        messages = [question]
        for follow_up in ("Go on.", "Thanks."):
            reply = await agent.ok(messages)
            messages += [reply.message, wire.user(follow_up)]
        await agent.ok([question], system=TITLE_SYSTEM, tools=False)
    export = await scripted_client.trajectories(trial.trial_id)
    turns = _turns(export)
    title, *mains = (_turn_of(export, scripted, r) for r in replies)
    titles = [title, _turn_of(export, scripted, "Count the project files")]
    assert [turns[t]["agent"] for t in titles] == [
        {"id": "main", "parent": None, "kind": "auxiliary"}
    ] * 2
    assert [turns[t]["agent"] for t in mains] == [
        {"id": "main", "parent": None, "kind": "main"}
    ] * 2
    for policy in (BranchPolicy.LAST, BranchPolicy.ALL):
        sample = main_sample(build_samples(export, policy=policy))
        assert [t["turn"] for t in sample.turns] == mains, policy
    trained = build_samples(export, kinds=TRAINED_KINDS)
    assert [[t["turn"] for t in s.turns] for s in trained] == [mains]


# ---------------------------------------------------------------------- 4. a restart


@pytest.mark.parametrize("wire", [Wire("anthropic", False), Wire("openai", True)], ids=str)
@BY_HEADERS
@pytest.mark.parametrize("taken_before", [False, True], ids=["one-call", "second-of-two"])
async def test_a_restart_between_the_spawn_and_the_sub_agents_first_turn(
    durable: Durable, wire: Wire, named: bool, taken_before: bool
) -> None:
    """The proxy restarts on its data dir after the main turn made its Agent call(s):
    the sub-agent's first turn after it still names its call, and with two calls of one
    prompt, the one a sub-agent took before the restart stays taken."""
    engine = durable.engine
    engine.reset()
    main_reply = _spawn(*["Look at a.py"] * (2 if taken_before else 1))
    engine.script(main_reply, *([tiny_reply("Before the restart.")] if taken_before else []))
    engine.script(tiny_reply("After the restart."))
    trial = await _new_trial(durable.url)
    async with aiohttp.ClientSession() as http:
        agent = Agent(http, trial, wire)
        main = await agent.ok([wire.user("Review a.py.")])
        if taken_before:
            await agent.ok([wire.user("Look at a.py")], _named(named, "agent-1"))
    await durable.restart()
    async with aiohttp.ClientSession() as http:
        await Agent(http, trial, wire).ok([wire.user("Look at a.py")], _named(named, "agent-2"))
    export = await _export(durable.url, trial)
    turns = _turns(export)
    spawner = _turn_of(export, engine, main_reply)
    if taken_before:
        before = turns[_turn_of(export, engine, "Before the restart.")]
        assert before["spawned_by"] == _spawned(spawner, main.calls[0])
    call = main.calls[-1]
    after = turns[_turn_of(export, engine, "After the restart.")]
    assert (after["agent"], after["spawned_by"]) == (
        _sub_agent("agent-2" if named else call.id),
        _spawned(spawner, call),
    )


# ---------------------------------------------------------------------- 5. a refused request


@BY_WIRE
@BY_HEADERS
async def test_a_refused_first_request_takes_no_call(
    durable: Durable, wire: Wire, named: bool
) -> None:
    """A sub-agent's first request refused after its messages are read (a 400: the session
    would store too many tokens) takes no call: of two calls with one prompt, the next
    sub-agent to succeed takes the first, and the refused one, sent again, the second."""
    engine = durable.engine
    engine.reset()
    main_reply = _spawn("Look at a.py", "Look at a.py")
    engine.script(main_reply, tiny_reply("First look."), tiny_reply("Second look."))
    trial = await _new_trial(durable.url)
    first = wire.user("Look at a.py")
    async with aiohttp.ClientSession() as http:
        agent = Agent(http, trial, wire)
        main = await agent.ok([wire.user("Review a.py twice.")])
        refused = await agent.send([first], _named(named, "agent-x"), system=HUGE_SYSTEM)
        assert refused.status == 400, refused.body
        assert "a session may store at most" in json.dumps(refused.body)  # the token limit
        await agent.ok([first], _named(named, "agent-y"))
        await agent.ok([first], _named(named, "agent-x"))
    export = await _export(durable.url, trial)
    turns = _turns(export)
    spawner = _turn_of(export, engine, main_reply)
    call_1, call_2 = main.calls
    for reply, call, name in (
        ("First look.", call_1, "agent-y"),
        ("Second look.", call_2, "agent-x"),
    ):
        turn = turns[_turn_of(export, engine, reply)]
        assert (turn["agent"], turn["spawned_by"]) == (
            _sub_agent(name if named else call.id),
            _spawned(spawner, call),
        ), reply
