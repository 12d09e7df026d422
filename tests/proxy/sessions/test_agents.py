"""What a request's headers say of its agent (the agent's own first, a harness's next),
the spawning calls a reply made; a turn continues only its own agent's chain; all of it
stored with the turn. Deciding a turn's agent: tests/proxy/turns/test_attribution.py."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest

from proxy.chat.messages import ToolCall
from proxy.exceptions import BadRequestError
from proxy.sessions.agents import (
    MAIN_AGENT,
    AgentClaim,
    Spawn,
    SpawnedBy,
    TurnAgent,
    agent_claim,
    spawns_of,
)
from proxy.sessions.model import Outcome, Session, TrialId, TurnMeta, TurnNode
from proxy.sessions.store import SessionStore


def _meta() -> TurnMeta:
    return TurnMeta(
        api="anthropic.messages",
        model="tiny",
        requested_model="m",
        worker_id="w",
        finish_reason="stop",
        sampling={},
        created_at=0.0,
        queue_seconds=0.0,
        engine_seconds=0.0,
        branch_reason="new_session",
    )


def _add(session: Session, parent: int | None, key: bytes, agent: TurnAgent) -> TurnNode:
    node = TurnNode(
        index=len(session.nodes),
        parent=parent,
        context_ids=array("i", [1, 2]),
        completion_ids=array("i", [3]),
        logprobs=array("f", [-0.5]),
        prompt_len=2 + (session.nodes[parent].end if parent is not None else 0),
        key=key,
        meta=_meta(),
        agent=agent,
    )
    session.add_turn(node)
    return node


# ---------------------------------------------------------------------- headers


def test_claude_code_sub_agents_are_named_by_their_headers() -> None:
    """The main thread sends no agent id; a first-level sub-agent its id (parent main); a
    nested one its parent's too, percent-encoded where not ASCII."""
    assert agent_claim({"X-Claude-Code-Session-Id": "s"}) is None
    assert agent_claim({"x-claude-code-agent-id": "a1"}) == AgentClaim("a1", "main", None)
    nested = {"x-claude-code-agent-id": "a%C3%A9", "x-claude-code-parent-agent-id": "a1"}
    assert agent_claim(nested) == AgentClaim("aé", "a1", None)


def test_claude_code_request_classes_give_the_kind() -> None:
    """With gateway hint headers the request class is the kind: the main thread's
    compaction is the main agent's, a side reply is auxiliary."""
    assert agent_claim({"x-claude-code-request-class": "main"}) == AgentClaim("main", None, "main")
    assert agent_claim({"x-claude-code-request-class": "compaction"}) == AgentClaim(
        "main", None, "compaction"
    )
    side = agent_claim({"x-claude-code-request-class": "side_reply"})
    assert side == AgentClaim("main", None, "auxiliary")
    sub = {"x-claude-code-agent-id": "a1", "x-claude-code-request-class": "subagent"}
    assert agent_claim(sub) == AgentClaim("a1", "main", "subagent")
    # A class this proxy does not know says nothing: the kind is decided as without it.
    assert agent_claim({"x-claude-code-request-class": "new-thing"}) is None


def test_codex_threads_are_named_by_their_headers() -> None:
    """Codex: the thread without a parent thread is the main agent; a spawned thread
    keeps its thread id, its parent named by thread (resolved against the session)."""
    assert agent_claim({"thread-id": "t0", "session-id": "s"}) == AgentClaim("main", None, None)
    spawned = {"thread-id": "t1", "x-codex-parent-thread-id": "t0", "x-openai-subagent": "x"}
    assert agent_claim(spawned) == AgentClaim("t1", "t0", "subagent", True)
    compact = {"thread-id": "t0", "x-openai-subagent": "compact"}
    assert agent_claim(compact) == AgentClaim("main", None, "compaction")


def test_the_agents_own_headers_win_over_a_harness() -> None:
    """A harness's headers name agents that say nothing; the agent's own come first."""
    harness = {"x-relay-agent-id": "h1", "x-relay-agent-kind": "subagent"}
    assert agent_claim(harness) == AgentClaim("h1", "main", "subagent")
    assert agent_claim({**harness, "x-claude-code-agent-id": "a1"}) == AgentClaim(
        "a1", "main", None
    )
    assert agent_claim({"x-relay-agent-kind": "auxiliary"}) == AgentClaim("main", None, "auxiliary")
    nested = {"x-relay-agent-id": "h2", "x-relay-parent-agent-id": "h1"}
    assert agent_claim(nested) == AgentClaim("h2", "h1", None)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"x-relay-agent-kind": "boss"}, "must be one of"),
        ({"x-relay-agent-id": ""}, "printable"),
        ({"x-relay-agent-id": "x" * 201}, "printable"),
        ({"x-relay-agent-id": "a\tb"}, "printable"),
        ({"x-relay-parent-agent-id": "p"}, "needs x-relay-agent-id"),
        ({"x-relay-agent-id": "main", "x-relay-parent-agent-id": "p"}, "no parent"),
        ({"x-relay-agent-id": "a", "x-relay-parent-agent-id": "a"}, "its own parent"),
        ({"x-relay-agent-id": "a", "x-relay-agent-kind": "main"}, "main agent"),
        # Checked even where the agent's own headers win.
        ({"x-claude-code-agent-id": "a", "x-relay-agent-kind": "?"}, "must be one of"),
    ],
)
def test_bad_harness_headers_are_refused(headers: dict[str, str], message: str) -> None:
    """A harness header with a bad value is a 400 (invalid_agent) that names it."""
    with pytest.raises(BadRequestError, match=message) as raised:
        agent_claim(headers)
    assert raised.value.code == "invalid_agent"


# ---------------------------------------------------------------------- attribution


def test_spawn_calls_are_the_agent_and_task_calls_with_a_prompt() -> None:
    calls = [
        ToolCall("c1", "Agent", json.dumps({"description": "d", "prompt": " Count the files "})),
        ToolCall("c2", "Bash", json.dumps({"command": "ls"})),
        ToolCall("c3", "Task", json.dumps({"prompt": ""})),
        ToolCall("c4", "Task", "not json"),
    ]
    assert spawns_of(calls) == (Spawn("c1", "Count the files"),)


def test_a_named_turn_continues_only_its_own_agents_chain() -> None:
    """Two sub-agents whose turns have the same context key never continue each other:
    each finds its own turn; a turn nothing names finds the latest."""
    s = Session(TrialId("t"), "k")
    _add(s, None, b"same", TurnAgent("a1", "main", "subagent"))
    _add(s, None, b"same", TurnAgent("a2", "main", "subagent"))
    keys = [b"", b"same", b"new"]
    assert s.find_continuation(keys, "a1") == (0, 1)
    assert s.find_continuation(keys, "a2") == (1, 1)
    assert s.find_continuation(keys, "main") is None
    assert s.find_continuation(keys) == (1, 1)
    _add(s, None, b"same", TurnAgent("a1", "main", "subagent"))
    assert s.find_continuation(keys, "a1") == (2, 1)
    assert s.find_continuation(keys, "a2") == (1, 1)


def test_agents_list_and_export() -> None:
    """The export names each turn's agent and each trajectory's; the agents list has
    one entry per agent and kind, with its turns and the call that spawned it."""
    s = Session(TrialId("t"), "k")
    _add(s, None, b"m0", TurnAgent(spawns=(Spawn("c1", "p"),)))
    _add(s, None, b"a0", TurnAgent("a1", "main", "subagent", SpawnedBy(0, "c1")))
    _add(s, 1, b"a1", TurnAgent("a1", "main", "subagent"))
    _add(s, 0, b"m1", MAIN_AGENT)
    _add(s, None, b"x0", TurnAgent("main", None, "auxiliary"))
    assert s.agent_list() == [
        {"id": "main", "parent": None, "kind": "main", "spawned_by": None, "turns": [0, 3]},
        {
            "id": "a1",
            "parent": "main",
            "kind": "subagent",
            "spawned_by": {"turn": 0, "tool_call_id": "c1"},
            "turns": [1, 2],
        },
        {"id": "main", "parent": None, "kind": "auxiliary", "spawned_by": None, "turns": [4]},
    ]
    export = s.export()
    by_leaf = {t["turns"][-1]["turn"]: t for t in export["trajectories"]}
    assert (by_leaf[2]["agent_id"], by_leaf[2]["agent_kind"]) == ("a1", "subagent")
    assert by_leaf[2]["turns"][0]["spawned_by"] == {"turn": 0, "tool_call_id": "c1"}
    assert by_leaf[2]["turns"][1]["spawned_by"] is None
    assert by_leaf[3]["turns"][0]["agent"] == {"id": "main", "parent": None, "kind": "main"}
    assert by_leaf[4]["agent_kind"] == "auxiliary"


async def test_agents_and_outcomes_are_stored_with_the_turns(tmp_path: Path) -> None:
    """A turn's agent, spawned_by and spawn calls, and a trial's outcome and agent rewards,
    reload as they were from a store that was never closed (as after ``kill -9``)."""
    s = Session(TrialId("t"), "k")
    _add(s, None, b"m0", TurnAgent(spawns=(Spawn("c1", "p"),)))
    _add(s, None, b"a0", TurnAgent("a1", "main", "subagent", SpawnedBy(0, "c1")))
    s.outcome = Outcome.BUDGET_EXHAUSTED
    s.agent_rewards = {"a1": 0.5}
    store = await SessionStore.open(tmp_path)
    await store.save_session(s)
    for node in s.nodes:
        await store.save_turn(s, node)
    reopened = await SessionStore.open(tmp_path)  # the first one is left as a crash leaves it
    (loaded,) = (await reopened.load()).sessions
    await reopened.close()
    await store.close()
    assert [n.agent for n in loaded.nodes] == [n.agent for n in s.nodes]
    assert loaded.outcome is Outcome.BUDGET_EXHAUSTED
    assert loaded.agent_rewards == {"a1": 0.5}
    assert loaded.spawning.taken == {(0, "c1"): "a1"}
    assert json.dumps(loaded.export()) == json.dumps(s.export())
