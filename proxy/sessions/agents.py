"""Which agent made a turn, as a turn records it, and what a request's headers say of it.

Agents that delegate (Claude Code's Agent tool, Codex's spawned threads) send their
sub-agents' requests to the same base URL as the main agent's. Every turn records
``agent: {"id", "parent", "kind"}``: the main agent is ``id: "main"``, ``parent: None``;
a sub-agent keeps the id its agent sent (else the id of the call that spawned it), and
``parent`` is the id of the agent that spawned it (``"main"`` for a first-level one).
``kind`` is the turn's own: ``main``, ``subagent``, ``compaction`` or ``auxiliary``.

This module holds the records (``TurnAgent``, the spawning calls a reply made, the spawn
results a request carried) and reads the headers, most trusted first:

1. the agent's own. Claude Code (2.1.113 and later) sends ``x-claude-code-agent-id`` on a
   sub-agent's requests, with ``x-claude-code-parent-agent-id`` on a nested one's, and the
   main thread sends neither; with ``CLAUDE_CODE_GATEWAY_HINT_HEADERS=1`` every request
   also says its class (``x-claude-code-request-class``: main, subagent, workflow,
   compaction, auxiliary, side_reply). Codex sends ``thread-id`` on every request,
   ``x-codex-parent-thread-id`` on a spawned thread's, ``x-openai-subagent`` (review,
   compact, memory_consolidation, collab_spawn, ...) on a sub-agent's, and
   ``x-codex-turn-metadata`` (JSON: ``thread_source``, ``request_kind``, ...);
2. a harness's, for agents that send nothing: ``x-relay-agent-id``,
   ``x-relay-parent-agent-id``, ``x-relay-agent-kind`` (checked: a bad value is refused).

Deciding a turn's agent from these, the request and the session is
``proxy.turns.attribution``'s (a pure step of the turn's plan).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import msgspec

from proxy.chat.messages import ToolCall
from proxy.exceptions import BadRequestError

__all__ = [
    "AGENT_KINDS",
    "HARNESS_HEADERS",
    "MAIN",
    "MAIN_AGENT",
    "NO_SPAWNS",
    "AgentClaim",
    "CallKey",
    "Spawn",
    "SpawnCall",
    "SpawnResult",
    "SpawnedBy",
    "Spawns",
    "TurnAgent",
    "agent_claim",
    "agent_header_text",
    "spawn_message",
    "spawned_agent",
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
CODEX_TURN_METADATA = "x-codex-turn-metadata"
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
# The tools that spawn a sub-agent: Claude Code's Agent (Task before 2.1) with the
# sub-agent's first message in ``prompt``; Codex's ``spawn_agent`` (in its
# ``multi_agent_v1`` namespace, which the model sees flattened) with it in ``message`` or
# as ``items[].text``.
_CLAUDE_SPAWN_TOOLS = frozenset({"Agent", "Task"})
_CODEX_SPAWN_TOOLS = frozenset({"spawn_agent", "multi_agent_v1__spawn_agent"})
_MAX_ID = 200


class SpawnedBy(msgspec.Struct, frozen=True, gc=False):
    """The parent's turn whose reply made the call, and the call's id. ``turn`` is None on
    a sub-agent that started while that reply was still streaming (the turn had no index
    yet): the session finds it by the call's id."""

    turn: int | None
    tool_call_id: str


class Spawn(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """A spawning call a turn's reply made: its id and the first message it gives the
    sub-agent."""

    tool_call_id: str
    message: str


class SpawnResult(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """A spawning call's result that a request carried back: the call's id and the id of
    the agent it started (Codex's ``spawn_agent`` returns ``{"agent_id": ...}``, Claude
    Code's background launches ``{"agentId": ...}``)."""

    tool_call_id: str
    agent: str


class TurnAgent(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The agent a turn belongs to (stored with the turn)."""

    id: str = MAIN
    parent: str | None = None
    kind: str = "main"
    spawned_by: SpawnedBy | None = None  # on a sub-agent's first turn
    spawns: tuple[Spawn, ...] = ()  # the sub-agents its reply asked for
    # The spawn results its request brought back (they confirm which call started which
    # agent).
    results: tuple[SpawnResult, ...] = ()

    def as_dict(self) -> dict[str, str | None]:
        return {"id": self.id, "parent": self.parent, "kind": self.kind}


MAIN_AGENT = TurnAgent()

# A spawning call, by the turn that made it (None: its reply is still streaming) and its id.
CallKey = tuple[int | None, str]


@dataclass(frozen=True, slots=True)
class SpawnCall:
    """A spawning call the agent was sent."""

    turn: int | None  # the turn whose reply made it; None while that reply streams
    tool_call_id: str
    message: str  # the first message it gives the sub-agent
    agent: str  # the agent that made it
    answered: bool = False  # the turn that made it was continued

    @property
    def key(self) -> CallKey:
        return (self.turn, self.tool_call_id)


@dataclass(frozen=True, slots=True)
class Spawns:
    """A session's spawning calls as attribution sees them: in the order they were made,
    and which agent took each (a recorded first turn, one in flight, a result that
    named the agent)."""

    calls: Sequence[SpawnCall] = ()
    taken: Mapping[CallKey, str] = field(default_factory=dict)

    def linked(self, agent: str) -> SpawnCall | None:
        """The call ``agent`` took (a result named it, or its first request is in flight)."""
        for call in self.calls:
            if self.taken.get(call.key) == agent:
                return call
        return None


NO_SPAWNS = Spawns()


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
    metadata = _codex_metadata(headers)
    parent = _own_id(headers.get(CODEX_PARENT_THREAD_ID))
    if parent is None and _text(metadata.get("thread_source")) == "subagent":
        value = metadata.get("parent_thread_id")
        parent = _own_id(value) if isinstance(value, str) else None
    source = headers.get(CODEX_SUBAGENT, "").strip().lower()
    kind = _CODEX_SOURCES.get(source)
    if _text(metadata.get("request_kind")) == "compaction":
        kind = "compaction"
    if thread is not None and parent is not None and thread != parent:
        return AgentClaim(thread, parent, kind or "subagent", True)
    if source or kind is not None:
        return AgentClaim(MAIN, None, kind or "auxiliary")
    if thread is not None:
        return AgentClaim(MAIN, None, None)
    return None


def _codex_metadata(headers: Mapping[str, str]) -> dict[str, Any]:
    """Codex's turn metadata (a JSON object; anything else says nothing)."""
    raw = headers.get(CODEX_TURN_METADATA)
    if not raw or len(raw) > 8192:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, or nested past the parser's depth
        return {}
    return value if isinstance(value, dict) else {}


def _text(value: object) -> str | None:
    return value.strip().lower() if isinstance(value, str) else None


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


# ---------------------------------------------------------------------- spawning calls


def spawn_message(call: ToolCall) -> str | None:
    """The first message a spawning call gives its sub-agent (None: not a spawning call,
    or one without a message)."""
    if call.name not in _CLAUDE_SPAWN_TOOLS and call.name not in _CODEX_SPAWN_TOOLS:
        return None
    try:
        value = json.loads(call.arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    if call.name in _CLAUDE_SPAWN_TOOLS:
        text = value.get("prompt")
    else:
        text = value.get("message")
        items = value.get("items")
        if not isinstance(text, str) and isinstance(items, list):
            texts = [i.get("text") for i in items if isinstance(i, dict)]
            text = "\n".join(t for t in texts if isinstance(t, str))
    return text.strip() or None if isinstance(text, str) else None


def spawns_of(tool_calls: Sequence[ToolCall]) -> tuple[Spawn, ...]:
    """The spawning calls among a reply's tool calls, with their messages."""
    out: list[Spawn] = []
    for call in tool_calls:
        message = spawn_message(call)
        if message is not None:
            out.append(Spawn(call.id, message))
    return tuple(out)


def spawned_agent(result: str) -> str | None:
    """The agent id a spawning call's result names (``agent_id``: Codex; ``agentId``:
    Claude Code's background launch); None when it names none."""
    if "gent" not in result:
        return None
    try:
        value = json.loads(result)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    agent = value.get("agent_id", value.get("agentId"))
    return _own_id(agent) if isinstance(agent, str) else None
