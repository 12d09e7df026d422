"""Codex itself (the pinned npm CLI) delegates a step to a sub-agent through its
``multi_agent_v1`` tools, through the proxy: the sub-agent's turns are recorded as its own
agent (its thread id), its first turn names the main turn and the ``spawn_agent`` call
that spawned it, and the main agent's turns stay one chain.

What Codex 0.171.0 sends (captured through the proxy): every request carries
``thread-id`` (its own thread) and ``session-id`` (the main thread's); a spawned thread's
also ``x-codex-parent-thread-id`` (the main thread) and ``x-openai-subagent:
collab_spawn``. ``spawn_agent`` returns ``{"agent_id": <the new thread id>, "nickname":
...}``; the sub-agent's input is Codex's instructions, an ``<environment_context>`` user
message, then the spawn message (no parent history). Under ``codex exec`` the main agent
gets the sub-agent's answer only by calling ``wait_agent`` (its output, then a
``<subagent_notification>`` message); the run ends at the main agent's first reply without
a tool call.

The worker serves the scripted policy of the agent-CLI tests (``tests.scripted_policy``)
on the qwen3 family's tiny model, in its native markup; Codex shows the model its
namespaced tools flattened (``multi_agent_v1__spawn_agent``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient
from tests.e2e import test_agent_clis as agent_clis
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.scripted_policy import ScriptedEngine, Turn

pytestmark = pytest.mark.e2e

# The agent-CLI tests' fixtures: the CLIs, the agent's home, the proxy with its scripted
# workers.
clis = agent_clis.clis
home = agent_clis.home
agent_stack = agent_clis.agent_stack

FAMILY = "qwen3"
TASK = "TASK-c9a: have a helper agent check the workspace, then report what it said."
SUB_TASK = "SUBTASK-c9a: say that the workspace is ready."
SUB_ANSWER = "Helper report: workspace-ready-c9a."
ANSWER = "Finished: the helper said workspace-ready-c9a."
SPAWN = "multi_agent_v1__spawn_agent"
WAIT = "multi_agent_v1__wait_agent"
# spawn_agent's output, as the main agent's next prompt shows it.
AGENT_ID = re.compile(r'"agent_id"\s*:\s*"([^"]+)"')


def policy(prompt: str) -> Turn:
    """The main agent spawns a helper, waits for it, then reports what it said; the
    helper (its prompt has the spawn message, not the task) answers; anything else gets a
    short answer."""
    if TASK in prompt:
        if SUB_ANSWER in prompt:  # wait_agent's output
            return Turn("", ANSWER)
        spawned = AGENT_ID.findall(prompt)
        if spawned:
            # Codex's bounds: 10 s to an hour.
            wait = min(max(int(60_000 * TIMEOUT_FACTOR), 10_000), 3_600_000)
            return Turn("I wait for it.", "", ((WAIT, {"targets": spawned, "timeout_ms": wait}),))
        return Turn("I will ask a helper.", "", ((SPAWN, {"message": SUB_TASK}),))
    if SUB_TASK in prompt:
        return Turn("", SUB_ANSWER)
    return Turn("", "OK.")


def rollout(codex_home: Path, thread: str) -> list[dict[str, Any]]:
    """The items of Codex's own record of a thread (its rollout file)."""
    (path,) = (codex_home / "sessions").rglob(f"rollout-*-{thread}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_codex_records_its_sub_agent_and_what_spawned_it(
    clis: Path,
    agent_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
    home: Path,
) -> None:
    """Codex's spawned thread is its own sub-agent, spawned_by the main turn's spawn call."""
    running, engines = agent_stack
    engine = engines[FAMILY]
    engine.prompts.clear()
    engine.sampled.clear()
    engine.unseen.clear()
    engine.tools[SPAWN] = ("message",)
    engine.tools[WAIT] = ("targets", "timeout_ms")
    engine.policy = policy
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model=FAMILY)
        argv, env = agent_clis._codex(clis, trial, FAMILY, home)
        argv[-1] = TASK
        _, output = await agent_clis.run_cli(argv, env, home)
        export = await proxy.trajectories(trial.trial_id)
        agents = await proxy.agents(trial.trial_id)

    assert engine.unseen == []  # each prompt showed the tool its turn called
    assert ANSWER in output
    # What Codex says of its threads: its own events and its record of the spawn call.
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    (main_thread,) = [e["thread_id"] for e in events if e["type"] == "thread.started"]
    (sub_thread,) = {
        thread
        for e in events
        if e["type"] == "item.completed" and e["item"].get("tool") == "spawn_agent"
        for thread in e["item"]["receiver_thread_ids"]
    }
    items = [r["payload"] for r in rollout(home / "codex", main_thread)]
    (call,) = [i for i in items if i.get("type") == "function_call" and i["name"] == "spawn_agent"]
    (result,) = [
        i
        for i in items
        if i.get("type") == "function_call_output" and i["call_id"] == call["call_id"]
    ]
    assert json.loads(result["output"])["agent_id"] == sub_thread

    # Every generation is a recorded turn; which agent made each is read off its reply.
    turns: dict[int, dict[str, Any]] = {}
    replies: dict[int, str] = {}
    for trajectory in export["trajectories"]:
        for t in trajectory["turns"]:
            turns[t["turn"]] = t
            ids = trajectory["response_ids"][t["response_start"] : t["response_end"]]
            replies[t["turn"]] = engine.tokenizer.decode(ids)  # type: ignore[attr-defined]
    assert sorted(turns) == list(range(len(engine.prompts))) == [0, 1, 2, 3]
    (spawner,) = [n for n, text in replies.items() if SPAWN in text]
    (waiter,) = [n for n, text in replies.items() if WAIT in text]
    (reporter,) = [n for n, text in replies.items() if ANSWER in text]
    (helper,) = [n for n, text in replies.items() if SUB_ANSWER in text]
    main_agent = {"id": "main", "parent": None, "kind": "main"}
    sub_agent = {"id": sub_thread, "parent": "main", "kind": "subagent"}
    assert {n: t["agent"] for n, t in turns.items()} == {
        spawner: main_agent,
        waiter: main_agent,
        reporter: main_agent,
        helper: sub_agent,
    }
    # The main agent's turns are one chain of continued turns; the sub-agent's turn is in
    # a trajectory of its own.
    main_turns = [spawner, waiter, reporter]
    chains = sorted(
        (trajectory["agent_id"], [t["turn"] for t in trajectory["turns"]])
        for trajectory in export["trajectories"]
    )
    assert chains == sorted([("main", main_turns), (sub_thread, [helper])])
    reasons = [turns[n]["branch_reason"] for n in main_turns]
    assert reasons == ["new_session", "continued", "continued"]
    spawned_by = {"turn": spawner, "tool_call_id": call["call_id"]}
    assert {n: t["spawned_by"] for n, t in turns.items()} == {
        spawner: None,
        waiter: None,
        reporter: None,
        helper: spawned_by,
    }
    assert {a["id"]: a for a in agents} == {
        "main": {**main_agent, "spawned_by": None, "turns": main_turns},
        sub_thread: {**sub_agent, "spawned_by": spawned_by, "turns": [helper]},
    }
