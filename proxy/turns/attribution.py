"""Which agent made a turn, and what spawned it: a pure function of the request (its
headers' claim and its messages) and the session's spawning calls.

The rules, in order:

1. **The kind is the turn's own**: what the agent's headers say (Claude Code's request
   class, Codex's sub-agent source and turn metadata, a harness's kind), else what the
   request is: Claude Code's title request (no tools, a system prompt with its title
   instruction) is ``auxiliary``; a request with tools whose last user message opens with
   Claude Code's summary instruction is ``compaction``; else the agent's own kind (``main`` for the main agent, ``subagent``).
2. **A turn that continues another is its agent's**: the turn it continues was found
   among its own agent's turns (``Session.find_continuation``).
3. **A new root named by headers** is that agent. A sub-agent's first turn takes a call
   by content: the call whose result named the agent (Codex returns the new thread's id,
   which is the sub-agent's ``thread-id``), else the call of its parent agent whose
   message the sub-agent's first message is, **exactly**, after the agent's own framing
   (Claude Code's ``<system-reminder>`` blocks, Codex's ``<environment_context>``), else
   the longest call message it contains; never a call already taken. Calls with the same
   message are taken in the order they were made. The header names the agent, the content
   names the call: both must be right.
4. **A new root nothing names**: the sub-agent of the call it matches the same way among
   the calls not yet answered (its id is then the call's id), or the sub-agent whose call
   it matches when that call was taken (a sub-agent that rewrote its history), else the
   main agent.

A call is known from the moment the agent is sent it (a streamed reply's calls before the
reply is recorded), held by a sub-agent's first request from its plan until its turn is
recorded (then taken for good) or it is refused or ends without a turn (then let go): a
refused request takes nothing. Everything else is read from the recorded turns, so a
restarted proxy decides the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.chat.messages import ChatMessage, Tool
from proxy.sessions.agents import (
    MAIN,
    AgentClaim,
    SpawnCall,
    SpawnedBy,
    SpawnResult,
    Spawns,
    TurnAgent,
    spawned_agent,
)

__all__ = ["RequestView", "attribute", "request_view"]

# What Claude Code's title request (no tools, one user message) says in its system prompt:
# 2.1.197's, then 2.1.332's (which sends its request class instead, where allowed to).
TITLE_INSTRUCTIONS = (
    "Generate a concise, sentence-case title",
    "You are naming a coding session so the user can pick it out of a long list",
)
# What Claude Code's compaction request (/compact and the automatic one) says in the text
# block it adds to the conversation's last user message, in 2.1.197 and 2.1.332 alike.
# Codex sends its compaction with its turn metadata.
COMPACTION_INSTRUCTION = "Your task is to create a detailed summary of the conversation so far"
# How far into a system prompt or a last message these are looked for (they open them).
_LOOK = 4096
# Blocks an agent puts around the message it was given: not part of that message.
_FRAMING = re.compile(
    r"<(system-reminder|environment_context|user_instructions)>.*?</\1>", re.DOTALL
)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What attribution reads of a request's messages."""

    kind: str | None = None  # what the request is, by its content (None: it does not say)
    first_message: str | None = None  # its first user message without the agent's framing
    results: tuple[SpawnResult, ...] = ()  # the spawning calls' results it carries


def request_view(
    messages: Sequence[ChatMessage], tools: Sequence[Tool], spawns: Spawns
) -> RequestView:
    """The request as attribution sees it; its first message and spawn results are read
    only where the session has spawning calls."""
    if not spawns.calls:
        return RequestView(_content_kind(messages, tools))
    return RequestView(
        _content_kind(messages, tools), _first_message(messages), _results(messages, spawns)
    )


def _content_kind(messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> str | None:
    if not messages:
        return None
    first, last = messages[0], messages[-1]
    if not tools and first.role == "system":
        if any(first.content.find(m, 0, _LOOK) >= 0 for m in TITLE_INSTRUCTIONS):
            return "auxiliary"
    elif tools and last.role == "user" and last.content.find(COMPACTION_INSTRUCTION, 0, _LOOK) >= 0:
        return "compaction"
    return None


def _first_message(messages: Sequence[ChatMessage]) -> str | None:
    for message in messages:
        if message.role != "user":
            continue
        text = _FRAMING.sub("", message.content).strip()
        if text:
            return text
    return None


def _results(messages: Sequence[ChatMessage], spawns: Spawns) -> tuple[SpawnResult, ...]:
    """The spawn results the request carries that say something new: an agent's history
    sends every earlier result again, and the turn that first brought one recorded it."""
    ids = {call.tool_call_id for call in spawns.calls}
    known = {(call_id, agent) for (_, call_id), agent in spawns.taken.items()}
    out: list[SpawnResult] = []
    for message in messages:
        if message.role == "tool" and message.tool_call_id in ids:
            agent = spawned_agent(message.content)
            if agent is not None and (message.tool_call_id, agent) not in known:
                out.append(SpawnResult(message.tool_call_id, agent))
    return tuple(out)


def attribute(
    claim: AgentClaim | None,
    parent: TurnAgent | None,
    request: RequestView,
    spawns: Spawns,
    known: Mapping[str, TurnAgent],
) -> TurnAgent:
    """The agent of a turn that continues a turn of ``parent`` (None: a new root), with
    the spawn results its request carries."""
    kind = (claim.kind if claim is not None else None) or request.kind
    if parent is not None:
        agent = TurnAgent(parent.id, parent.parent, kind or _own_kind(parent.id))
    elif claim is not None and claim.id != MAIN:
        agent = _named(claim, kind, request, spawns, known)
    elif claim is not None:
        agent = TurnAgent(MAIN, None, kind or "main")
    else:
        agent = _unnamed(request, spawns, known)
        if kind is not None:  # a side request or a compaction of whichever agent it is
            agent = TurnAgent(agent.id, agent.parent, kind, agent.spawned_by)
    if request.results:
        return TurnAgent(
            agent.id, agent.parent, agent.kind, agent.spawned_by, results=request.results
        )
    return agent


def _own_kind(agent: str) -> str:
    return "main" if agent == MAIN else "subagent"


def _named(
    claim: AgentClaim,
    kind: str | None,
    request: RequestView,
    spawns: Spawns,
    known: Mapping[str, TurnAgent],
) -> TurnAgent:
    """A new root of the sub-agent the headers name."""
    before = known.get(claim.id)
    if before is not None:  # a sub-agent seen before, on a new root (a rewritten chain)
        return TurnAgent(before.id, before.parent, kind or "subagent")
    spawner = claim.parent or MAIN
    if claim.parent_is_thread and spawner not in known:
        spawner = MAIN  # a parent thread that made no turn as a sub-agent is the main one
    call = spawns.linked(claim.id)
    if call is None and request.first_message is not None:
        call = _matching(request.first_message, spawns, spawner, open_only=False)
    spawned = None if call is None else SpawnedBy(call.turn, call.tool_call_id)
    return TurnAgent(claim.id, spawner, kind or "subagent", spawned)


def _unnamed(request: RequestView, spawns: Spawns, known: Mapping[str, TurnAgent]) -> TurnAgent:
    """A new root no header names: a spawned sub-agent's, or the main agent's."""
    text = request.first_message
    if text is None:
        return TurnAgent()
    call = _matching(text, spawns, None, open_only=True)
    if call is not None:
        spawned = SpawnedBy(call.turn, call.tool_call_id)
        return TurnAgent(call.tool_call_id, call.agent, "subagent", spawned)
    taken = _taken(text, spawns)
    if taken is None:
        return TurnAgent()
    taker, call = taken
    before = known.get(taker)
    if before is not None:
        return TurnAgent(before.id, before.parent, _own_kind(before.id))
    return TurnAgent(taker, call.agent, "subagent")  # its first request is still running


def _matching(
    text: str, spawns: Spawns, spawner: str | None, *, open_only: bool
) -> SpawnCall | None:
    """The call ``text`` is the message of: exactly, else the longest message it holds;
    among the calls not taken (of ``spawner``, when given; not answered with
    ``open_only``). A named sub-agent prefers calls not yet answered."""
    free = [
        call
        for call in spawns.calls
        if call.key not in spawns.taken
        and (spawner is None or call.agent == spawner)
        and not (open_only and call.answered)
    ]
    free.sort(key=lambda call: call.answered)  # stable: in order made within each
    for call in free:
        if call.message == text:
            return call
    inside = [call for call in free if call.message in text]
    return max(inside, key=lambda call: len(call.message), default=None)


def _taken(text: str, spawns: Spawns) -> tuple[str, SpawnCall] | None:
    """The agent that took the latest call ``text`` is the message of, and that call."""
    for call in reversed(spawns.calls):
        agent = spawns.taken.get(call.key)
        if agent is not None and (call.message == text or call.message in text):
            return agent, call
    return None
