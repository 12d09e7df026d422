"""Sub-agents through the real proxy, relay and worker (a scripted policy on the tiny
model), with raw HTTP carrying the headers Claude Code sends: every turn knows its agent,
the spawning call is found, concurrent sub-agents keep their own chains, and trials end
with a typed outcome and a budget the proxy enforces."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient, TrialSession
from sdk.exceptions import ProxyRequestError
from sdk.samples import build_samples
from tests.scripted_worker import PacedScriptedEngine, tiny_reply

pytestmark = pytest.mark.e2e

TOOLS = [
    {
        "name": "Agent",
        "description": "Run a sub-agent on a task.",
        "input_schema": {
            "type": "object",
            "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
            "required": ["prompt"],
        },
    }
]


async def _message(
    http: aiohttp.ClientSession,
    trial: TrialSession,
    messages: list[dict[str, Any]],
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    async with http.post(
        f"{trial.anthropic_base_url}/v1/messages",
        json={"model": "m", "max_tokens": 64, "messages": messages, "tools": TOOLS},
        headers={"x-api-key": trial.api_key, **(headers or {})},
    ) as response:
        return response.status, await response.json()


def _assistant(body: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": body["content"]}


def _tool_uses(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for b in body["content"] if b["type"] == "tool_use"]


def _sub(agent: str) -> dict[str, str]:
    return {"x-claude-code-agent-id": agent, "X-Claude-Code-Session-Id": "s1"}


async def test_a_sub_agent_is_recorded_with_the_call_that_spawned_it(
    scripted_stack: tuple[RunningProxy, PacedScriptedEngine],
    scripted: PacedScriptedEngine,
    scripted_client: ProxyClient,
) -> None:
    """The main agent calls Agent; the sub-agent's two turns (named by Claude Code's
    header) are its own chain, its first naming the main turn and call; the agents view
    lists both and the samples carry their agent."""
    trial = await scripted_client.create_session()
    scripted.script(
        tiny_reply("", [("Agent", {"description": "count", "prompt": "Count the files"})]),
        tiny_reply("There are three files."),
        tiny_reply("Counted."),
        tiny_reply("The sub-agent counted three files."),
    )
    async with aiohttp.ClientSession() as http:
        main = [{"role": "user", "content": "How many files are there?"}]
        status, first = await _message(http, trial, main)
        assert status == 200, first
        (call,) = _tool_uses(first)
        sub = [{"role": "user", "content": "Count the files"}]
        status, s1 = await _message(http, trial, sub, _sub("a7f3"))
        assert status == 200, s1
        sub += [_assistant(s1), {"role": "user", "content": "Report."}]
        status, s2 = await _message(http, trial, sub, _sub("a7f3"))
        assert status == 200, s2
        main += [
            _assistant(first),
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "3"}],
            },
        ]
        status, last = await _message(http, trial, main, {"X-Claude-Code-Session-Id": "s1"})
        assert status == 200, last
    agents = await scripted_client.agents(trial.trial_id)
    assert agents == [
        {"id": "main", "parent": None, "kind": "main", "spawned_by": None, "turns": [0, 3]},
        {
            "id": "a7f3",
            "parent": "main",
            "kind": "subagent",
            "spawned_by": {"turn": 0, "tool_call_id": call["id"]},
            "turns": [1, 2],
        },
    ]
    await scripted_client.complete(trial.trial_id, 1.0, agent_rewards={"a7f3": 0.5})
    export = await scripted_client.trajectories(trial.trial_id)
    assert export["outcome"] == "completed"
    assert sorted(t["agent_id"] for t in export["trajectories"]) == ["a7f3", "main"]
    samples = build_samples(export)
    assert {(s.agent_id, s.agent_kind, s.reward) for s in samples} == {
        ("main", "main", 1.0),
        ("a7f3", "subagent", 0.5),
    }
    assert [s.agent_id for s in build_samples(export, agents="main")] == ["main"]


async def test_concurrent_sub_agents_never_continue_each_others_chains(
    scripted: PacedScriptedEngine, scripted_client: ProxyClient
) -> None:
    """Two sub-agents given the same prompt send byte-identical requests at once, and are
    answered alike: each one's second turn still continues its own first turn."""
    trial = await scripted_client.create_session()
    scripted.policy = lambda prompt: tiny_reply("Looked.")
    spawn = {"prompt": "Look at a.py"}
    scripted.script(tiny_reply("", [("Agent", spawn), ("Agent", spawn)]))
    async with aiohttp.ClientSession() as http:
        status, first = await _message(http, trial, [{"role": "user", "content": "Review."}])
        assert status == 200, first
        calls = [c["id"] for c in _tool_uses(first)]

        async def sub_agent(agent: str) -> None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Look at a.py"}]
            for _ in range(2):
                status, body = await _message(http, trial, messages, _sub(agent))
                assert status == 200, body
                messages += [_assistant(body), {"role": "user", "content": "Go on."}]

        await asyncio.gather(sub_agent("a1"), sub_agent("a2"))
    export = await scripted_client.trajectories(trial.trial_id)
    chains = {t["agent_id"]: [x["agent"]["id"] for x in t["turns"]] for t in export["trajectories"]}
    assert chains == {"main": ["main"], "a1": ["a1", "a1"], "a2": ["a2", "a2"]}
    agents = {a["id"]: a for a in await scripted_client.agents(trial.trial_id)}
    assert sorted(a["spawned_by"]["tool_call_id"] for a in (agents["a1"], agents["a2"])) == sorted(
        calls
    )


async def test_a_spent_budget_refuses_in_the_agents_format_and_types_the_outcome(
    scripted: PacedScriptedEngine, scripted_client: ProxyClient
) -> None:
    """Past the trial's turn budget a request is a 400 ``budget_exhausted`` in the API's
    own shape (Anthropic and OpenAI), nothing is recorded, and the trial's outcome is
    ``budget_exhausted`` unless the trainer says otherwise."""
    trial = await scripted_client.create_session(budget={"turns": 1})
    scripted.policy = lambda prompt: tiny_reply("Done.")
    async with aiohttp.ClientSession() as http:
        status, body = await _message(http, trial, [{"role": "user", "content": "Hi"}])
        assert status == 200, body
        status, body = await _message(http, trial, [{"role": "user", "content": "Again"}])
        assert status == 400
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "budget of 1 turns is spent" in body["error"]["message"]
        async with http.post(
            f"{trial.base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
            headers={"Authorization": f"Bearer {trial.api_key}"},
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "budget_exhausted"
    summary = await scripted_client.get_session(trial.trial_id)
    assert (summary["turns"], summary["outcome"]) == (1, "budget_exhausted")
    await scripted_client.complete(trial.trial_id)
    export = await scripted_client.trajectories(trial.trial_id)
    assert (export["outcome"], export["reward"]) == ("budget_exhausted", None)


async def test_bad_completions_and_harness_headers_change_nothing(
    scripted: PacedScriptedEngine, scripted_client: ProxyClient
) -> None:
    """An unknown outcome, ``completed`` without a reward, a reward for an agent that made
    no turn and a bad harness header are 400s that leave the trial as it was; an infra
    error is recorded as such, with no reward."""
    trial = await scripted_client.create_session()
    scripted.policy = lambda prompt: tiny_reply("Done.")
    async with aiohttp.ClientSession() as http:
        status, body = await _message(
            http, trial, [{"role": "user", "content": "Hi"}], {"x-relay-agent-kind": "boss"}
        )
        assert status == 400, body
        assert body["type"] == "error"
        assert "x-relay-agent-kind" in body["error"]["message"]
        status, body = await _message(
            http, trial, [{"role": "user", "content": "Hi"}], {"x-relay-agent-id": "helper"}
        )
        assert status == 200, body
    for kwargs, code in [
        ({"outcome": "crashed"}, "invalid_outcome"),
        ({"outcome": "completed"}, "invalid_outcome"),
        ({"reward": 1.0, "agent_rewards": {"nobody": 1.0}}, "unknown_agent"),
    ]:
        with pytest.raises(ProxyRequestError) as raised:
            await scripted_client.complete(trial.trial_id, **kwargs)  # type: ignore[arg-type]
        assert raised.value.code == code
    summary = await scripted_client.get_session(trial.trial_id)
    assert (summary["status"], summary["turns"], summary["agents"]) == ("active", 1, 1)
    await scripted_client.complete(trial.trial_id, outcome="infra_error")
    export = await scripted_client.trajectories(trial.trial_id)
    assert (export["outcome"], export["reward"]) == ("infra_error", None)
    assert export["trajectories"][0]["turns"][0]["agent"] == {
        "id": "helper",
        "parent": "main",
        "kind": "subagent",
    }
    assert build_samples(export) == []
    assert json.dumps(export)  # plain JSON
