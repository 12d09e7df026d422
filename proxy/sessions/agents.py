"""Which agent made a turn: the trial's main agent, or a sub-agent it spawned.

Agents that delegate (Claude Code's Agent tool, Codex's spawned threads) send their
sub-agents' requests to the same base URL as the main agent's. Every turn records
``agent: {"id", "parent", "kind"}``: the main agent is ``id: "main"``, ``parent: None``,
``kind: "main"``; a sub-agent keeps the id its agent sent, and ``parent`` is the id of the
agent that spawned it (``"main"`` for a first-level one). Where it comes from, most trusted
first:

1. the agent's own headers. Claude Code (2.1.113 and later) sends
   ``x-claude-code-agent-id`` on a sub-agent's requests, with
   ``x-claude-code-parent-agent-id`` on a nested one's, and the main thread sends neither;
   with ``CLAUDE_CODE_GATEWAY_HINT_HEADERS=1`` every request also says its class
   (``x-claude-code-request-class``: main, subagent, workflow, compaction, auxiliary,
   side_reply). Codex sends ``thread-id`` on every request, ``x-codex-parent-thread-id``
   on a spawned thread's, and ``x-openai-subagent`` (review, compact,
   memory_consolidation, collab_spawn, ...) on a sub-agent's;
2. a harness's headers, for agents that send nothing: ``x-relay-agent-id``,
   ``x-relay-parent-agent-id``, ``x-relay-agent-kind`` (checked: a bad value is refused);
3. the content: a new root whose first user message holds the ``prompt`` of an Agent or
   Task tool call the trial's agent made, not yet answered nor taken by another sub-agent,
   is that call's sub-agent (its id is then the call's id).

A sub-agent's first turn records ``spawned_by``: the turn whose reply made the call and
the call's id as the agent received it (no agent sends it; it is found by the prompt, for
sub-agents named by headers too). A turn only continues a turn of its own agent, so
concurrent sub-agents never grow into each other's chains; a turn nothing names continues
whichever chain its messages extend and belongs to that chain's agent.

Everything here is a pure function of the request's headers and the session's turns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

import msgspec

from proxy.exceptions import BadRequestError

if TYPE_CHECKING:  # the session holds these structs; only its type is needed here
    from proxy.chat.messages import ChatMessage, ToolCall
    from proxy.sessions.model import Session

__all__ = [
    "AGENT_KINDS",
    "HARNESS_HEADERS",
    "MAIN",
    "AgentClaim",
    "Spawn",
    "SpawnedBy",
    "TurnAgent",
    "agent_claim",
    "agent_header_text",
    "attribute",
    "spawns_of",
]

MAIN = "main"
AGENT_KINDS = ("main", "subagent", "compaction", "auxiliary")
# A harness's own headers, for agents that say nothing of their agents.
HARNESS_AGENT_ID = "x-relay-agent-id"
HARNESS_PARENT_ID = "x-relay-parent-agent-id"
HARNESS_KIND = "x-relay-agent-kind"
HARNESS_HEADERS = (HARNESS_AGENT_ID, HARNESS_PARENT_ID, HARNESS_KIND)
# Claude Code's.
CLAUDE_AGENT_ID = "x-claude-code-agent-id"
CLAUDE_PARENT_ID = "x-claude-code-parent-agent-id"
CLAUDE_REQUEST_CLASS = "x-claude-code-request-class"
# Codex's.
CODEX_THREAD_ID = "thread-id"
CODEX_PARENT_THREAD_ID = "x-codex-parent-thread-id"
CODEX_SUBAGENT = "x-openai-subagent"
# Every header that can name an agent (a retry is the same request only from one agent).
AGENT_HEADERS = (
    CLAUDE_AGENT_ID,
    CLAUDE_PARENT_ID,
    CLAUDE_REQUEST_CLASS,
    CODEX_THREAD_ID,
    CODEX_PARENT_THREAD_ID,
    CODEX_SUBAGENT,
    *HARNESS_HEADERS,
)

# Claude Code's request classes, as kinds (a workflow step is a sub-agent's work, a side
# reply a request on the side).
_CLAUDE_CLASSES = {
    "main": "main",
    "subagent": "subagent",
    "workflow": "subagent",
    "compaction": "compaction",
    "auxiliary": "auxiliary",
    "side_reply": "auxiliary",
}
# Codex's sub-agent sources, as kinds; a label not listed is a sub-agent's on a thread of
# its own and a request on the side on the main thread.
_CODEX_SOURCES = {
    "compact": "compaction",
    "memory_consolidation": "auxiliary",
    "collab_spawn": "subagent",
}
# The tools that spawn a sub-agent, and the argument that is its first message.
SPAWN_TOOLS = {"Agent": "prompt", "Task": "prompt"}
_MAX_ID = 200


class SpawnedBy(msgspec.Struct, frozen=True, gc=False):
    """The parent's turn whose reply made the call, and the call's id."""

    turn: int
    tool_call_id: str


class Spawn(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """An Agent/Task call a turn's reply made: its id and the prompt it gives the
    sub-agent."""

    tool_call_id: str
    prompt: str


class TurnAgent(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The agent a turn belongs to (stored with the turn)."""

    id: str = MAIN
    parent: str | None = None
    kind: str = "main"
    spawned_by: SpawnedBy | None = None  # on a sub-agent's first turn
    spawns: tuple[Spawn, ...] = ()  # the sub-agents its reply asked for

    def as_dict(self) -> dict[str, str | None]:
        return {"id": self.id, "parent": self.parent, "kind": self.kind}


MAIN_AGENT = TurnAgent()


@dataclass(frozen=True, slots=True)
class AgentClaim:
    """What a request's headers say of its agent. ``parent`` None: not said (resolved
    against the session); ``kind`` None: not said."""

    id: str
    parent: str | None = None
    kind: str | None = None
    # Codex names a parent by its thread id, and the main thread's id is not "main".
    parent_is_thread: bool = False


def _own_id(value: str | None) -> str | None:
    """An id an agent sent (percent-encoded where not ASCII, as Claude Code does), cut to
    a bound; None when empty."""
    if value is None:
        return None
    text = unquote(value.strip())[:_MAX_ID]
    return text or None


def _harness_id(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    text = value.strip()
    if not text or len(text) > _MAX_ID or not text.isprintable():
        raise BadRequestError(
            f"{name} must be 1 to {_MAX_ID} printable characters", code="invalid_agent"
        )
    return text


def agent_claim(headers: Mapping[str, str]) -> AgentClaim | None:
    """The agent a request's headers name (None: they name none). A harness header with a
    bad value raises ``BadRequestError`` (``invalid_agent``); an agent's own headers are
    taken as far as they make sense."""
    harness = _harness_claim(headers)  # checked even where the agent's own headers win
    claude = _claude_claim(headers)
    if claude is not None:
        return claude
    codex = _codex_claim(headers)
    if codex is not None:
        return codex
    return harness


def _claude_claim(headers: Mapping[str, str]) -> AgentClaim | None:
    agent = _own_id(headers.get(CLAUDE_AGENT_ID))
    kind = _CLAUDE_CLASSES.get(headers.get(CLAUDE_REQUEST_CLASS, "").strip().lower())
    if agent is not None and agent != MAIN:
        parent = _own_id(headers.get(CLAUDE_PARENT_ID)) or MAIN
        return AgentClaim(agent, parent, kind if kind != "main" else "subagent")
    if kind is not None:  # the main thread, saying what its request is for
        return AgentClaim(MAIN, None, kind if kind != "subagent" else "main")
    return None


def _codex_claim(headers: Mapping[str, str]) -> AgentClaim | None:
    thread = _own_id(headers.get(CODEX_THREAD_ID))
    parent = _own_id(headers.get(CODEX_PARENT_THREAD_ID))
    source = headers.get(CODEX_SUBAGENT, "").strip().lower()
    if thread is not None and parent is not None and thread != parent:
        return AgentClaim(thread, parent, _CODEX_SOURCES.get(source, "subagent"), True)
    if source:
        return AgentClaim(MAIN, None, _CODEX_SOURCES.get(source, "auxiliary"))
    if thread is not None:
        return AgentClaim(MAIN, None, None)
    return None


def _harness_claim(headers: Mapping[str, str]) -> AgentClaim | None:
    agent = _harness_id(headers, HARNESS_AGENT_ID)
    parent = _harness_id(headers, HARNESS_PARENT_ID)
    raw_kind = headers.get(HARNESS_KIND)
    kind = None if raw_kind is None else raw_kind.strip().lower()
    if kind is not None and kind not in AGENT_KINDS:
        raise BadRequestError(
            f"{HARNESS_KIND} must be one of: {', '.join(AGENT_KINDS)}", code="invalid_agent"
        )
    if agent is None:
        if parent is not None:
            raise BadRequestError(
                f"{HARNESS_PARENT_ID} needs {HARNESS_AGENT_ID}", code="invalid_agent"
            )
        return None if kind is None else AgentClaim(MAIN, None, kind)
    if agent == MAIN:
        if parent is not None:
            raise BadRequestError("the main agent has no parent", code="invalid_agent")
        return AgentClaim(MAIN, None, kind)
    if parent == agent:
        raise BadRequestError("an agent cannot be its own parent", code="invalid_agent")
    if kind == "main":
        raise BadRequestError(
            f'kind "main" is the main agent\'s ({HARNESS_AGENT_ID}: main)', code="invalid_agent"
        )
    return AgentClaim(agent, parent or MAIN, kind)


def agent_header_text(headers: Mapping[str, str]) -> str:
    """The agent headers of a request, as one string (what a retry's hash adds to the
    body: two agents' identical bodies are two requests)."""
    return "\0".join(headers.get(name, "") for name in AGENT_HEADERS)


# ---------------------------------------------------------------------- attribution


def spawns_of(tool_calls: Sequence[ToolCall]) -> tuple[Spawn, ...]:
    """The Agent/Task calls among a reply's tool calls, with their prompts."""
    out: list[Spawn] = []
    for call in tool_calls:
        argument = SPAWN_TOOLS.get(call.name)
        if argument is None:
            continue
        try:
            value = json.loads(call.arguments)
        except ValueError:
            continue
        prompt = value.get(argument) if isinstance(value, dict) else None
        if isinstance(prompt, str) and prompt.strip():
            out.append(Spawn(call.id, prompt.strip()))
    return tuple(out)


def _first_user_text(messages: Sequence[ChatMessage]) -> str | None:
    for message in messages:
        if message.role == "user":
            return message.content
    return None


def attribute(
    session: Session,
    claim: AgentClaim | None,
    parent: int | None,
    messages: Sequence[ChatMessage],
) -> TurnAgent:
    """The agent of a turn that continues ``parent`` (None: a new root). A continued turn
    of a claim continues a turn of the same agent (``Session.find_continuation``)."""
    if parent is not None:
        before = session.nodes[parent].agent
        if claim is None:
            return TurnAgent(before.id, before.parent, before.kind)
        return TurnAgent(before.id, before.parent, claim.kind or before.kind)
    text = _first_user_text(messages)
    if claim is None:
        if text is None:
            return MAIN_AGENT
        found = session.find_spawn(text, claim=None)
        if found is None:
            return MAIN_AGENT
        entry, fresh = found
        known = None if fresh else session.agent(entry.claimed_by or "")
        if known is not None:  # a new root of a sub-agent found earlier (a rewritten chain)
            return TurnAgent(known.id, known.parent, known.kind)
        spawner = session.nodes[entry.turn].agent.id
        return TurnAgent(
            entry.spawn.tool_call_id,
            spawner,
            "subagent",
            SpawnedBy(entry.turn, entry.spawn.tool_call_id),
        )
    if claim.id == MAIN:
        return TurnAgent(MAIN, None, claim.kind or "main")
    known = session.agent(claim.id)
    resolved = claim.parent
    if claim.parent_is_thread and resolved is not None and session.agent(resolved) is None:
        resolved = MAIN  # a parent thread that made no turn as a sub-agent is the main one
    kind = claim.kind or "subagent"
    if known is not None:
        return TurnAgent(known.id, known.parent, kind)
    spawned_by = None
    if text is not None:
        found = session.find_spawn(text, claim=claim.id)
        if found is not None and found[1]:
            entry = found[0]
            spawned_by = SpawnedBy(entry.turn, entry.spawn.tool_call_id)
    return TurnAgent(claim.id, resolved or MAIN, kind, spawned_by)
