"""Which agent made a turn, decided from the request and the session alone: a spawning
call is taken by the sub-agent whose first message is exactly its message (the agent's
framing left out), containment only as a fallback, never a call already taken; a call is
known while its reply still streams; a result that names the agent links it; a turn's
kind is its own (headers, else a title or compaction request by its content)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from proxy.chat.messages import ChatMessage, Tool, ToolCall
from proxy.sessions.agents import (
    MAIN_AGENT,
    AgentClaim,
    Spawn,
    SpawnedBy,
    SpawnResult,
    TurnAgent,
    agent_claim,
    spawn_message,
    spawned_agent,
    spawns_of,
)
from proxy.sessions.model import Session, TrialId
from proxy.turns.attribution import TITLE_INSTRUCTIONS, attribute, request_view
from tests.proxy.sessions.test_agents import _add

TOOL = Tool(name="Agent", description="Run a sub-agent.", parameters={"type": "object"})


def _user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="system", content="You are a helper."), ChatMessage("user", text)]


def _attribute(
    s: Session,
    claim: AgentClaim | None,
    parent: int | None,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] = (TOOL,),
) -> TurnAgent:
    spawns = s.spawns()
    before = s.nodes[parent].agent if parent is not None else None
    return attribute(claim, before, request_view(messages, tools, spawns), spawns, s.agents)


def _spawning(s: Session, *messages: str) -> None:
    """The main agent's turn whose reply calls Agent once per message (ids c1, c2, ...)."""
    spawns = tuple(Spawn(f"c{i + 1}", m) for i, m in enumerate(messages))
    _add(s, None, b"m0", TurnAgent(spawns=spawns))


def test_a_new_root_with_a_pending_calls_prompt_is_that_calls_sub_agent() -> None:
    """Nothing named: the root whose first user message is an unanswered Agent call's
    prompt is a sub-agent spawned by that turn and call; later roots are the main one's."""
    s = Session(TrialId("t"), "k")
    _add(s, None, b"m0", TurnAgent(spawns=(Spawn("toolu_1", "Count the files"),)))
    agent = _attribute(s, None, None, _user("Count the files"))
    assert agent == TurnAgent("toolu_1", "main", "subagent", SpawnedBy(0, "toolu_1"))
    _add(s, None, b"s0", agent)
    # Its chain continued: the same agent, without the spawn mark.
    assert _attribute(s, None, 1, []) == TurnAgent("toolu_1", "main", "subagent")
    # A new root of the same prompt later is that sub-agent again (its chain was rewritten).
    assert _attribute(s, None, None, _user("Count the files")).id == "toolu_1"
    assert _attribute(s, None, None, _user("Something else")) == MAIN_AGENT


def test_an_answered_call_spawns_nothing_by_content() -> None:
    """Once the spawning turn was continued (the call was answered), a root nothing names
    with its prompt is not taken for its sub-agent."""
    s = Session(TrialId("t"), "k")
    _add(s, None, b"m0", TurnAgent(spawns=(Spawn("toolu_1", "Count the files"),)))
    _add(s, 0, b"m1", MAIN_AGENT)
    assert _attribute(s, None, None, _user("Count the files")) == MAIN_AGENT


def test_a_named_sub_agent_finds_the_call_that_spawned_it() -> None:
    """A sub-agent named by headers gets spawned_by from the call with its prompt, the
    first not taken: two calls with one prompt go to two sub-agents in order."""
    s = Session(TrialId("t"), "k")
    _spawning(s, "Look at a.py", "Look at a.py")
    first = _attribute(s, AgentClaim("a1", "main", None), None, _user("Look at a.py"))
    assert first == TurnAgent("a1", "main", "subagent", SpawnedBy(0, "c1"))
    _add(s, None, b"a0", first)
    second = _attribute(s, AgentClaim("a2", "main", "subagent"), None, _user("Look at a.py"))
    assert second.spawned_by == SpawnedBy(0, "c2")
    _add(s, None, b"b0", second)
    # Its second root is the same agent, with no second spawn.
    again = _attribute(s, AgentClaim("a1", "main", None), None, _user("Look at a.py"))
    assert again == TurnAgent("a1", "main", "subagent")


def test_overlapping_prompts_are_matched_exactly_first() -> None:
    """ "Count files in src" takes its own call even though "Count files" is inside it and
    was made first; "Count files" then takes the other, with headers or without."""
    for named in (False, True):
        s = Session(TrialId("t"), "k")
        _spawning(s, "Count files", "Count files in src")
        claim_b = AgentClaim("agent-b", "main", None) if named else None
        b = _attribute(s, claim_b, None, _user("Count files in src"))
        assert b.spawned_by == SpawnedBy(0, "c2")
        _add(s, None, b"b0", b)
        claim_a = AgentClaim("agent-a", "main", None) if named else None
        a = _attribute(s, claim_a, None, _user("Count files"))
        assert a.spawned_by == SpawnedBy(0, "c1")
        assert a.id == ("agent-a" if named else "c1")


def test_containment_is_a_fallback_that_never_takes_a_taken_call() -> None:
    """A first message that only holds a call's message takes it when no call is its
    message exactly, the longest such message first; a taken call is never taken again."""
    s = Session(TrialId("t"), "k")
    _spawning(s, "Count files", "Count files in src")
    agent = _attribute(s, AgentClaim("x", "main", None), None, _user("Please: Count files in src!"))
    assert agent.spawned_by == SpawnedBy(0, "c2")
    _add(s, None, b"x0", agent)
    other = _attribute(s, AgentClaim("y", "main", None), None, _user("Count files in src, again"))
    assert other.spawned_by == SpawnedBy(0, "c1")  # the only call left that it holds
    _add(s, None, b"y0", other)
    third = _attribute(s, AgentClaim("z", "main", None), None, _user("Count files in src"))
    assert third.spawned_by is None


def test_the_agents_framing_is_not_part_of_the_message() -> None:
    """Claude Code's system reminder before the prompt, and Codex's environment context
    as a user message of its own, are left out: the prompt still matches exactly."""
    s = Session(TrialId("t"), "k")
    _spawning(s, "Count files", "Count files in src")
    framed = "<system-reminder>\nToday is Friday.\n</system-reminder>\n\nCount files"
    agent = _attribute(s, None, None, [ChatMessage("user", framed)])
    assert agent.spawned_by == SpawnedBy(0, "c1")
    codex = [
        ChatMessage("developer", "You are a coding agent."),
        ChatMessage("user", "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"),
        ChatMessage("user", "Count files in src"),
    ]
    thread = _attribute(s, AgentClaim("T1", "T0", "subagent", True), None, codex)
    assert thread == TurnAgent("T1", "main", "subagent", SpawnedBy(0, "c2"))


def test_a_named_sub_agent_takes_only_its_parents_calls() -> None:
    """The header names the agent and the content the call: a call another agent made
    is not its spawn."""
    s = Session(TrialId("t"), "k")
    _add(s, None, b"a0", TurnAgent("a1", "main", "subagent", spawns=(Spawn("c9", "Dig"),)))
    nested = _attribute(s, AgentClaim("a2", "main", None), None, _user("Dig"))
    assert nested.spawned_by is None
    child = _attribute(s, AgentClaim("a3", "a1", None), None, _user("Dig"))
    assert child == TurnAgent("a3", "a1", "subagent", SpawnedBy(0, "c9"))


def test_a_call_still_streaming_is_taken_and_gets_its_turn_when_recorded() -> None:
    """A call sent while its reply streams can be taken at once (its turn unknown yet);
    once the reply is recorded, the taken call and the export name its turn."""
    s = Session(TrialId("t"), "k")
    _add(s, None, b"x0", MAIN_AGENT)  # an earlier turn: the spawning one is not turn 0
    sent = s.spawning.sent("main", [Spawn("c1", "Count files")])
    sub = _attribute(s, None, None, _user("Count files"))
    assert sub == TurnAgent("c1", "main", "subagent", SpawnedBy(None, "c1"))
    _add(s, None, b"s0", sub)  # the sub-agent's first turn, recorded before its parent
    assert s.spawning.taken == {(None, "c1"): "c1"}
    _add(s, 0, b"m1", TurnAgent(spawns=(Spawn("c1", "Count files"),)))
    s.spawning.drop(sent)
    assert s.spawning.streaming == []
    assert s.spawning.taken == {(2, "c1"): "c1"}
    assert s.spawned_by(s.nodes[1]) == {"turn": 2, "tool_call_id": "c1"}


def test_a_first_request_in_flight_holds_its_call_until_it_is_recorded_or_fails() -> None:
    """Two sub-agents of one prompt at once: the second takes the other call while the
    first's request runs; a request that ends without a turn lets its call go."""
    s = Session(TrialId("t"), "k")
    _spawning(s, "Look", "Look")
    first = _attribute(s, None, None, _user("Look"))
    held = s.spawning.hold(first)
    assert held == (0, "c1")
    second = _attribute(s, None, None, _user("Look"))
    assert second.spawned_by == SpawnedBy(0, "c2")
    s.spawning.release(held, first.id)
    assert _attribute(s, None, None, _user("Look")).spawned_by == SpawnedBy(0, "c1")


def test_a_spawn_result_links_the_call_to_the_agent_it_names() -> None:
    """Codex's spawn_agent returns the new thread's id: the request that first carries
    that result links the call to that agent, whatever the content matched before."""
    s = Session(TrialId("t"), "k")
    call = ToolCall("c1", "multi_agent_v1__spawn_agent", json.dumps({"message": "Look"}))
    other = ToolCall("c2", "multi_agent_v1__spawn_agent", json.dumps({"items": [{"text": "Look"}]}))
    assert spawns_of([call, other]) == (Spawn("c1", "Look"), Spawn("c2", "Look"))
    _add(s, None, b"m0", TurnAgent(spawns=spawns_of([call, other])))
    history = [
        *_user("Task"),
        ChatMessage("assistant", "", tool_calls=(call, other)),
        ChatMessage("tool", json.dumps({"agent_id": "T2", "nickname": "Volta"}), tool_call_id="c1"),
        ChatMessage("tool", json.dumps({"agent_id": "T1", "nickname": "Kant"}), tool_call_id="c2"),
    ]
    main = _attribute(s, AgentClaim("main", None, None), 0, history)
    assert main.results == (SpawnResult("c1", "T2"), SpawnResult("c2", "T1"))
    _add(s, 0, b"m1", main)
    thread = _attribute(s, AgentClaim("T1", "T0", "subagent", True), None, _user("Look"))
    assert thread.spawned_by == SpawnedBy(0, "c2")
    # The next request sends the same results again: nothing new to record.
    again = [*history, ChatMessage("assistant", "Both started."), *_user("Go on")[1:]]
    assert _attribute(s, AgentClaim("main", None, None), 1, again).results == ()


def test_a_turns_kind_is_its_own() -> None:
    """A title request (no tools, the title instruction) and a compaction request are the
    main agent's side kinds by content; the main agent's next turn is main again; a header
    kind wins."""
    s = Session(TrialId("t"), "k")
    title = [
        ChatMessage("system", f"You are Claude.\n\n{TITLE_INSTRUCTIONS[0]} (3-7 words)."),
        ChatMessage("user", "<session>\nFix the bug\n</session>"),
    ]
    assert _attribute(s, None, None, title, tools=()) == TurnAgent("main", None, "auxiliary")
    _add(s, None, b"m0", MAIN_AGENT)
    compact = [
        *_user("Fix the bug"),
        ChatMessage("assistant", "Fixed."),
        ChatMessage(
            "user",
            "Your task is to create a detailed summary of the conversation so far, paying "
            "close attention to the user's explicit requests.",
        ),
    ]
    assert _attribute(s, None, 0, compact).kind == "compaction"
    _add(s, 0, b"c0", TurnAgent("main", None, "compaction"))
    assert _attribute(s, None, 1, _user("Go on")) == MAIN_AGENT
    side = AgentClaim("main", None, "auxiliary")
    assert _attribute(s, side, 0, _user("Go on")) == TurnAgent("main", None, "auxiliary")


def test_a_hold_goes_when_its_request_ends_after_the_call_got_its_turn() -> None:
    """A sub-agent's first request holds a call still streaming; the reply is recorded
    meanwhile, then the request ends without a turn: the call is free again."""
    s = Session(TrialId("t"), "k")
    s.spawning.sent("main", [Spawn("c1", "Look")])
    first = _attribute(s, None, None, _user("Look"))
    held = s.spawning.hold(first)
    assert held == (None, "c1")
    _add(s, None, b"m0", TurnAgent(spawns=(Spawn("c1", "Look"),)))
    assert s.spawning.reserved == {(0, "c1"): "c1"}
    s.spawning.release(held, first.id)
    assert s.spawning.reserved == {}
    assert _attribute(s, None, None, _user("Look")).spawned_by == SpawnedBy(0, "c1")


def test_a_root_nothing_names_is_the_sub_agent_whose_first_request_holds_its_call() -> None:
    """A second root with the message of a call whose sub-agent's first request is still
    running is that sub-agent's (not the main agent's), of its own kind."""
    s = Session(TrialId("t"), "k")
    _spawning(s, "Look")
    s.spawning.hold(_attribute(s, None, None, _user("Look")))
    assert _attribute(s, None, None, _user("Look")) == TurnAgent("c1", "main", "subagent")


def test_a_side_request_of_a_sub_agent_nothing_names_is_still_the_sub_agents() -> None:
    """A compaction that a sub-agent sends as a new root keeps its agent; only the kind
    is the request's."""
    s = Session(TrialId("t"), "k")
    _spawning(s, "Look at a.py")
    _add(s, None, b"s0", _attribute(s, None, None, _user("Look at a.py")))
    compact = [
        *_user("Look at a.py"),
        ChatMessage(
            "user", "Your task is to create a detailed summary of the conversation so far."
        ),
    ]
    assert _attribute(s, None, None, compact) == TurnAgent("c1", "main", "compaction")


def test_headers_and_results_past_the_json_parsers_depth_are_ignored() -> None:
    """Deeply nested JSON in Codex's turn metadata, a spawning call's arguments or its
    result says nothing; it never fails the request."""
    nested = "[" * 4000 + "]" * 4000  # within the metadata's size bound, past the depth
    assert agent_claim({"thread-id": "T0", "x-codex-turn-metadata": nested}) == AgentClaim(
        "main", None, None
    )
    assert spawn_message(ToolCall("c1", "Agent", nested)) is None
    assert spawned_agent('{"agent_id": ' + nested + "}") is None
