"""Real model families end to end: a proxy, real workers serving each family's tiny model
through a scripted policy, and the official clients of every agent API running a
reasoning, tool-using episode. Each episode must be one chain of continued turns with the
sampled ids verbatim in later contexts, reasoning returned in the API's own form (and sent
back or not), and a trajectory that re-scores by teacher forcing. The policy calls only
tools its prompt shows (``tests.scripted_policy``): every family's prompt must carry the
agent's tools, DeepSeek's through the listing the proxy writes into the system prompt."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from sdk.fidelity import check_fidelity
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.families import FAMILIES, family_model
from tests.scripted_policy import ScriptedEngine, Turn
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel, WorkerClient

E2E_FAMILIES = sorted(FAMILIES)

TOOLS = [
    ("bash", "Run a command", {"type": "object", "properties": {"command": {"type": "string"}}}),
    ("read_file", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}}),
]
SCRIPT = [
    ("I should list the files first.", "", [("bash", {"command": "ls"})]),
    ("Now read it.", "Reading main.py.", [("read_file", {"path": "main.py"})]),
    ("That answers it.", "main.py prints hi.", []),
]
TOOL_OUTPUTS = ["main.py\nREADME.md", "print('hi')"]
# What a prompt that shows a tool contains: its description and its parameters' names.
DEFINITIONS = {name: (description, *p["properties"]) for name, description, p in TOOLS}


@pytest.fixture(scope="module")
async def family_stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[RunningProxy, dict[str, ScriptedEngine]]]:
    running = await start_proxy(
        ProxyConfig(port=0, max_tokens=256, cache_dir=tmp_path_factory.mktemp("families"))
    )
    engines: dict[str, ScriptedEngine] = {}
    for name in E2E_FAMILIES:
        directory = family_model(name)
        scorer = HFEngine.load(directory, name=name)
        engine = ScriptedEngine(
            scorer,
            AutoTokenizer.from_pretrained(str(directory)),
            write=FAMILIES[name].reply,
            tools=DEFINITIONS,
        )
        engines[name] = engine
        client = WorkerClient(
            running.worker_url, {name: ServedModel(engine, directory)}, worker_id=f"w-{name}"
        )
        running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    await running.wait_for_workers(len(E2E_FAMILIES), within_seconds=120 * TIMEOUT_FACTOR)
    yield running, engines
    await running.stop()


# What an agent saw of an episode: the reasoning of each turn, and the id of each tool call.
Seen = tuple[list[str], list[str]]


async def _chat(base_url: str, key: str, model: str, stream: bool, send_back: bool) -> Seen:
    async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        tools = [
            {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
            for n, d, p in TOOLS
        ]
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files, then read main.py."},
        ]
        reasoning: list[str] = []
        ids: list[str] = []
        for turn in range(3):
            if stream:
                content, thought, calls = "", "", {}
                async for chunk in await client.chat.completions.create(
                    model=model, messages=messages, tools=tools, stream=True
                ):
                    delta = chunk.choices[0].delta if chunk.choices else None
                    if delta is None:
                        continue
                    content += delta.content or ""
                    thought += (delta.model_extra or {}).get("reasoning_content") or ""
                    for call in delta.tool_calls or []:
                        calls[call.index] = {
                            "id": call.id,
                            "type": "function",
                            "function": call.function.model_dump(),
                        }
                tool_calls = [calls[i] for i in sorted(calls)]
            else:
                reply = await client.chat.completions.create(
                    model=model, messages=messages, tools=tools
                )
                message = reply.choices[0].message
                content = message.content or ""
                thought = (message.model_extra or {}).get("reasoning_content") or ""
                tool_calls = [c.model_dump() for c in message.tool_calls or []]
            reasoning.append(thought)
            assistant: dict[str, Any] = {"role": "assistant", "content": content}
            if tool_calls:
                assistant["tool_calls"] = tool_calls
            if send_back and thought:
                assistant["reasoning_content"] = thought
            messages.append(assistant)
            ids += [c["id"] for c in tool_calls]
            if turn < 2:
                assert tool_calls, f"turn {turn} returned no tool call"
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": tool_calls[0]["id"],
                        "content": TOOL_OUTPUTS[turn],
                    }
                )
        return reasoning, ids


async def _anthropic(base_url: str, key: str, model: str, stream: bool, send_back: bool) -> Seen:
    async with AsyncAnthropic(base_url=base_url, api_key=key, max_retries=0) as client:
        tools = [{"name": n, "description": d, "input_schema": p} for n, d, p in TOOLS]
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "List the files, then read main.py."}
        ]
        reasoning: list[str] = []
        ids: list[str] = []
        for turn in range(3):
            kwargs: dict[str, Any] = {
                "model": model,
                "max_tokens": 256,
                "system": "You are a coding agent.",
                "messages": messages,
                "tools": tools,
            }
            if stream:
                async with client.messages.stream(**kwargs) as events:
                    reply = await events.get_final_message()
            else:
                reply = await client.messages.create(**kwargs)
            blocks = [b.model_dump(mode="json", exclude_none=True) for b in reply.content]
            reasoning.append("".join(b["thinking"] for b in blocks if b["type"] == "thinking"))
            if not send_back:
                blocks = [b for b in blocks if b["type"] != "thinking"]
            messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in blocks if b["type"] == "tool_use"]
            ids += [b["id"] for b in uses]
            if turn < 2:
                assert uses, f"turn {turn} returned no tool_use"
                messages.append(
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": uses[0]["id"],
                                "content": TOOL_OUTPUTS[turn],
                            }
                        ],
                    }
                )
        return reasoning, ids


async def _responses(base_url: str, key: str, model: str, stream: bool, send_back: bool) -> Seen:
    async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        tools = [
            {"type": "function", "name": n, "description": d, "parameters": p} for n, d, p in TOOLS
        ]
        items: list[dict[str, Any]] = [
            {"role": "developer", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files, then read main.py."},
        ]
        reasoning: list[str] = []
        ids: list[str] = []
        for turn in range(3):
            if stream:
                async with client.responses.stream(model=model, input=items, tools=tools) as events:
                    reply = await events.get_final_response()
            else:
                reply = await client.responses.create(model=model, input=items, tools=tools)
            output = [item.model_dump(mode="json", exclude_none=True) for item in reply.output]
            reasoning.append(
                "".join(
                    part["text"]
                    for item in output
                    if item["type"] == "reasoning"
                    for part in item.get("content") or []
                )
            )
            if not send_back:
                output = [item for item in output if item["type"] != "reasoning"]
            items.extend(output)
            calls = [item for item in output if item["type"] == "function_call"]
            ids += [item["call_id"] for item in calls]
            if turn < 2:
                assert calls, f"turn {turn} returned no function call"
                items.append(
                    {
                        "type": "function_call_output",
                        "call_id": calls[0]["call_id"],
                        "output": TOOL_OUTPUTS[turn],
                    }
                )
        return reasoning, ids


AGENTS = {"chat": _chat, "anthropic": _anthropic, "responses": _responses}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", sorted(AGENTS))
@pytest.mark.parametrize("family", E2E_FAMILIES)
async def test_a_reasoning_tool_episode_is_one_chain(
    family_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
    family: str,
    api: str,
    stream: bool,
) -> None:
    """Three turns (two tool calls, then an answer) through the official client of each
    agent API, by a policy that calls only tools its prompt shows: one trajectory of
    continued turns, the sampled ids verbatim in the next prompt, reasoning returned as the
    API's reasoning, and fidelity within 1e-4."""
    running, engines = family_stack
    case, engine = FAMILIES[family], engines[family]
    engine.prompts.clear()
    engine.sampled.clear()
    engine.unseen.clear()
    engine.script(*(Turn(r, c, tuple(calls)) for r, c, calls in SCRIPT))
    send_back = not stream  # one of each: reasoning sent back, and dropped
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model=family)
        base = trial.anthropic_base_url if api == "anthropic" else trial.base_url
        reasoning, call_ids = await AGENTS[api](base, trial.api_key, family, stream, send_back)
        export = await proxy.trajectories(trial.trial_id)
    assert engine.unseen == []  # the policy saw every tool it called
    (trajectory,) = export["trajectories"]
    reasons = [t["branch_reason"] for t in trajectory["turns"]]
    assert reasons == ["new_session", "continued", "continued"]
    expected = [r for r, _, _ in SCRIPT] if case.reasoning else ["", "", ""]
    assert reasoning == expected
    if case.model_call_ids:  # the ids the model wrote reach the agent
        assert call_ids == [
            case.call_id(name, i) for _, _, calls in SCRIPT for i, (name, _) in enumerate(calls)
        ]
    prompts = engine.prompts
    assert len(prompts) == 3
    for turn in range(2):
        sampled = engine.sampled[turn]
        assert prompts[turn + 1][: len(prompts[turn]) + len(sampled)] == prompts[turn] + sampled
    report = check_fidelity(export, engine.scorer.score)
    assert report.ok(), report
    assert json.dumps(export)  # the export is plain JSON


async def test_the_models_endpoint_says_how_tools_reach_each_family(
    family_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
) -> None:
    """``GET /v1/models`` says per family whether its template renders the tools or the
    proxy lists them in the system prompt (DeepSeek-V3.1's and R1's templates drop them)."""
    running, _ = family_stack
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model="qwen3")
        async with AsyncOpenAI(
            base_url=trial.base_url, api_key=trial.api_key, max_retries=0
        ) as client:
            models = await client.models.list()
    tools = {m.id: (m.model_extra or {})["tools"] for m in models.data}
    listed = {"deepseek_v31": "deepseek_v31", "deepseek_r1": "deepseek_v3"}
    assert {name: t["result"] for name, t in tools.items()} == {
        name: "listed" if name in listed else "rendered" for name in E2E_FAMILIES
    }
    for name, tool_call_format in listed.items():
        assert f"in the {tool_call_format} format" in tools[name]["reason"]


@pytest.mark.parametrize(
    ("api", "bad", "code"),
    [
        ("anthropic", {"type": "thinking", "thinking": "I plan.", "signature": "forged"}, 400),
        ("anthropic", {"type": "thinking", "thinking": "", "signature": "x"}, 400),
        ("anthropic", {"type": "thinking", "signature": "x"}, 400),
        ("responses", {"type": "reasoning", "content": [{"type": "reasoning_text"}]}, 400),
        ("responses", {"type": "reasoning", "content": "not a list"}, 400),
        ("chat", {"role": "user", "content": "hi", "reasoning_content": "not a user's"}, 400),
    ],
    ids=["forged-signature", "empty-thinking", "no-thinking", "no-text", "bad-content", "user"],
)
async def test_bad_reasoning_input_is_refused_and_changes_nothing(
    family_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
    api: str,
    bad: dict[str, Any],
    code: int,
) -> None:
    """Malformed reasoning, a thinking block without text or with a signature the proxy
    did not give: a 4xx in the API's own error shape, and the session is unchanged."""
    running, _ = family_stack
    async with ProxyClient(running.url) as proxy, aiohttp.ClientSession() as http:
        trial = await proxy.create_session(model="qwen3")
        before = await proxy.get_session(trial.trial_id)
        headers = {"Authorization": f"Bearer {trial.api_key}", "x-api-key": trial.api_key}
        if api == "anthropic":
            url = f"{trial.anthropic_base_url}/v1/messages"
            body: dict[str, Any] = {
                "model": "qwen3",
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [bad, {"type": "text", "text": "ok"}]},
                    {"role": "user", "content": "go on"},
                ],
            }
        elif api == "responses":
            url = f"{trial.base_url}/responses"
            body = {"model": "qwen3", "input": [{"role": "user", "content": "hi"}, bad]}
        else:
            url = f"{trial.base_url}/chat/completions"
            body = {"model": "qwen3", "messages": [bad]}
        async with http.post(url, json=body, headers=headers) as response:
            assert response.status == code
            error = await response.json()
        if api == "anthropic":
            assert error["type"] == "error"
            assert error["error"]["message"]
        else:
            assert error["error"]["message"]
        assert await proxy.get_session(trial.trial_id) == before


# ------------------------------------------------------------------ session options


@pytest.mark.parametrize(
    ("family", "options", "send_back", "reasons"),
    [
        # Qwen3 with thinking off: the generation prompt closes an empty think block and
        # the model answers directly (written here in Qwen2.5's markup, which is Qwen3's
        # without the think block).
        ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, True, ["continued"] * 2),
        # History as the template renders it: Qwen2.5's rendering is what was sampled, so
        # it still continues; Qwen3 keeps reasoning after the last query only when it is
        # sent back, else every later turn is its own trajectory.
        ("qwen25", {"history": "template"}, True, ["continued"] * 2),
        ("qwen3", {"history": "template"}, True, ["continued"] * 2),
        ("qwen3", {"history": "template"}, False, ["template_rewrote_history"] * 2),
    ],
    ids=["qwen3-thinking-off", "qwen25-template", "qwen3-template-sent", "qwen3-template-dropped"],
)
async def test_session_options_on_real_templates(
    family_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
    family: str,
    options: dict[str, Any],
    send_back: bool,
    reasons: list[str],
) -> None:
    """``chat_template_kwargs`` reach every rendering of the session (probes included) and
    ``history: "template"`` records exactly what the template renders: continued where that
    extends the recorded context, a new trajectory where it does not; fidelity holds."""
    running, engines = family_stack
    engine = engines[family]
    thinking_off = "chat_template_kwargs" in options
    engine.prompts.clear()
    engine.sampled.clear()
    engine.unseen.clear()
    engine.script(*(Turn(r, c, tuple(calls)) for r, c, calls in SCRIPT))
    if thinking_off:
        # Written in Qwen2.5's markup: Qwen3's without the think block.
        engine.write = FAMILIES["qwen25"].reply
    try:
        async with ProxyClient(running.url) as proxy:
            trial = await proxy.create_session(model=family, **options)
            summary = await proxy.get_session(trial.trial_id)
            await _chat(trial.base_url, trial.api_key, family, False, send_back)
            export = await proxy.trajectories(trial.trial_id)
    finally:
        engine.write = FAMILIES[family].reply
    assert engine.unseen == []
    assert summary["history"] == options.get("history", "keep")
    assert summary["chat_template_kwargs"] == options.get("chat_template_kwargs", {})
    turns = sorted(
        (t for traj in export["trajectories"] for t in traj["turns"]), key=lambda t: t["turn"]
    )
    unique = list({t["turn"]: t for t in turns}.values())
    assert [t["branch_reason"] for t in unique] == ["new_session", *reasons]
    assert len(export["trajectories"]) == (1 if reasons[0] == "continued" else 3)
    if thinking_off:  # full renderings and continuations alike
        for prompt in engine.prompts:
            text = engine.tokenizer.decode(prompt)
            assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    report = check_fidelity(export, engine.scorer.score)
    assert report.ok(), report


async def test_deepseek_v31_thinking_on_through_the_session_option(
    family_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
) -> None:
    """DeepSeek-V3.1 with ``{"thinking": true}``: the generation prompt opens the think
    block, the reply's reasoning comes back as ``reasoning_content``, and the next user turn
    continues the chain (history drops the reasoning; the chain keeps it)."""
    running, engines = family_stack
    engine = engines["deepseek_v31"]
    engine.prompts.clear()
    engine.sampled.clear()
    engine.script(
        "Two plus two.</think>It is 4.<｜end▁of▁sentence｜>",
        "Double it.</think>It is 8.<｜end▁of▁sentence｜>",
    )
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(
            model="deepseek_v31", chat_template_kwargs={"thinking": True}
        )
        async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
            seen = []
            for follow_up in ["And doubled?", None]:
                reply = await client.chat.completions.create(
                    model="deepseek_v31", messages=messages
                )
                message = reply.choices[0].message
                seen.append(((message.model_extra or {}).get("reasoning_content"), message.content))
                if follow_up:
                    messages += [
                        {"role": "assistant", "content": message.content},
                        {"role": "user", "content": follow_up},
                    ]
        export = await proxy.trajectories(trial.trial_id)
    assert seen == [("Two plus two.", "It is 4."), ("Double it.", "It is 8.")]
    assert engine.tokenizer.decode(engine.prompts[0]).endswith("<｜Assistant｜><think>")
    (trajectory,) = export["trajectories"]
    assert [t["branch_reason"] for t in trajectory["turns"]] == ["new_session", "continued"]
    assert check_fidelity(export, engine.scorer.score).ok()
