"""A trial's session: a tree of turns.

Every model call is a *turn*: a node holding the context tokens that were added before it
(mask 0: a full rendering for a branch root; the bridge plus the new messages otherwise)
and the tokens the model sampled (mask 1) with their logprobs. A node's full prompt is the
concatenation of its ancestors' tokens and its own context tokens, so a prefix shared by
many turns is stored once. Every root-to-leaf path is one trajectory.

A request continues the node whose key (the hash of tools + messages up to and including
the assistant message that node returned) matches a prefix of the request's messages. The
longest such prefix wins; any node may be continued, not only the latest. A request that
continues nothing starts a new root.

Turns and their metadata are msgspec Structs that the cyclic garbage collector does not
track (``gc=False``; they can hold no reference cycles: ids, arrays, bytes, numbers,
strings and plain dicts). A proxy holds millions of them, and a full collection that had
to scan them too stalled every session for ~50 ms more per 10,000 sessions of 8 turns.
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import msgspec

from proxy.chat.history import HistoryMemory
from proxy.exceptions import ConflictError
from proxy.images import ImageData
from proxy.sessions.agents import MAIN_AGENT, Spawns, TurnAgent
from proxy.sessions.options import SessionOptions
from proxy.sessions.routing import TurnRouting, export_routing
from proxy.sessions.spawns import SpawnLedger
from proxy.sessions.teacher import TurnTeacher, export_teacher

TrialId = NewType("TrialId", str)


class SessionState(enum.Enum):
    ACTIVE = "active"
    COMPLETED = "completed"
    DELETED = "deleted"


class CompletedBy(enum.Enum):
    TRAINER = "trainer"
    IDLE_TIMEOUT = "idle_timeout"  # no request for longer than the idle timeout
    MAX_AGE = "max_age"  # older than the maximum session age


class Outcome(enum.Enum):
    """How a trial's episode ended, for the trainer to act on."""

    COMPLETED = "completed"  # the agent finished; the reward grades it
    AGENT_ERROR = "agent_error"  # the agent failed: the policy's doing
    INFRA_ERROR = "infra_error"  # the proxy, a worker or the sandbox failed: not the policy's
    TIMEOUT = "timeout"  # the episode ran out of time
    BUDGET_EXHAUSTED = "budget_exhausted"  # the trial's turn or token budget was spent


_ALLOWED = {
    SessionState.ACTIVE: {SessionState.COMPLETED, SessionState.DELETED},
    SessionState.COMPLETED: {SessionState.DELETED},
    SessionState.DELETED: set(),
}


class TurnMeta(msgspec.Struct, gc=False):
    """Facts recorded per turn (JSON-serialisable)."""

    api: str
    model: str
    requested_model: str
    worker_id: str
    finish_reason: str
    sampling: dict[str, Any]
    created_at: float
    queue_seconds: float
    engine_seconds: float
    branch_reason: str  # "continued" | "new_session" | "history_rewritten" | ...
    tool_calls: int = 0
    malformed_tool_call: str | None = None
    truncated: bool = False  # the client went away before the reply was complete
    stop_sequence: str | None = None  # the stop string that ended the reply
    tool_choice_unmet: bool = False  # a tool call was required but the model made none
    # Earlier assistant messages of the request that carried their reasoning back (what
    # the agent does with reasoning: under the default history policy the context keeps
    # the sampled reasoning either way).
    reasoning_returned: int = 0
    # Stopped by a max_tokens the agent did not ask for (the session's or the proxy's).
    capped: bool = False
    extra: dict[str, str | int | float] = {}  # msgspec gives each turn its own dict
    # Which policy version sampled which completion tokens: [version, start, end] spans
    # over the turn's completion, in order (one span unless a weight update preempted the
    # reply and it went on with the new weights).
    versions: list[list[int]] = []
    # Whether the reply's last byte was handed to the client, or a later turn continued it
    # (the agent had it). The proxy records a turn with False and sets it after the commit,
    # so a crash in between leaves False; True by default for turns made elsewhere.
    delivered: bool = True
    retry_of: int | None = None  # the earlier turn whose attempt this one repeats
    replays: int = 0  # retries answered with this recorded reply
    # Retries are recognised by these (never exported): the hash of the request's raw
    # body, and the client's own request id (x-client-request-id / Idempotency-Key).
    request_hash: str = ""
    client_request_id: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "api": self.api,
            "model": self.model,
            "requested_model": self.requested_model,
            "worker_id": self.worker_id,
            "finish_reason": self.finish_reason,
            "sampling": self.sampling,
            "created_at": self.created_at,
            "queue_seconds": round(self.queue_seconds, 6),
            "engine_seconds": round(self.engine_seconds, 6),
            "branch_reason": self.branch_reason,
            "tool_calls": self.tool_calls,
            "malformed_tool_call": self.malformed_tool_call,
            "truncated": self.truncated,
            "stop_sequence": self.stop_sequence,
            "tool_choice_unmet": self.tool_choice_unmet,
            "reasoning_returned": self.reasoning_returned,
            "capped": self.capped,
            "extra": self.extra,
            "delivered": self.delivered,
            "retry_of": self.retry_of,
            "replays": self.replays,
        }


class PlacedImage(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """An image in a prompt: the sha256 of its bytes and the half-open range of its
    placeholder tokens in the prompt ids (the tokens the model's forward fills with the
    image's features)."""

    sha256: str
    start: int
    end: int


class TurnNode(msgspec.Struct, gc=False, eq=False):
    index: int
    parent: int | None
    context_ids: array[int]  # mask 0
    completion_ids: array[int]  # mask 1
    logprobs: array[float]  # one per completion id
    prompt_len: int  # tokens before completion_ids (ancestors + own context)
    key: bytes  # identifies the context after this turn's assistant message
    meta: TurnMeta
    children: int = 0
    # The images among its context tokens, in order, placed in the whole prompt.
    images: tuple[PlacedImage, ...] = ()
    # Its routing rows, in a session that asked for them (proxy.sessions.routing): the
    # positions [parent's end - 1 (0 for a root), end - 1).
    routing: TurnRouting | None = None
    # The agent that made it (proxy.sessions.agents).
    agent: TurnAgent = MAIN_AGENT
    # A teacher's logprob of each token it sampled (proxy.sessions.teacher); None: none.
    teacher: TurnTeacher | None = None

    @property
    def end(self) -> int:
        return self.prompt_len + len(self.completion_ids)

    @property
    def routing_missing(self) -> bool:
        """Whether rows of its positions never came (a trainer replaying routing leaves
        it out)."""
        return self.routing is None or bool(self.routing.missing)


# A trajectory's kind: the first of these among its turns' (a main chain that ends in a
# compaction or a side request is still the main agent's).
_KIND_ORDER = ("main", "subagent", "compaction", "auxiliary")


def _trajectory_kind(path: Sequence[TurnNode]) -> str:
    kinds = {node.agent.kind for node in path}
    return next((kind for kind in _KIND_ORDER if kind in kinds), path[-1].agent.kind)


def node_versions(node: TurnNode) -> list[tuple[int, int, int]]:
    """The turn's version spans, covering every completion token: a turn recorded before
    versions were kept per token falls back to its ``extra["policy_version"]``, else 0
    (the weights the workers started with)."""
    n = len(node.completion_ids)
    spans = [(int(v), int(lo), int(hi)) for v, lo, hi in node.meta.versions]
    if spans and spans[0][1] == 0 and spans[-1][2] == n:
        return spans
    fallback = node.meta.extra.get("policy_version", 0)
    version = int(fallback) if isinstance(fallback, int | float) else 0
    return [(version, 0, n)] if n else []


@dataclass(slots=True, frozen=True)
class PromptPlan:
    """What a turn will send to the engine, decided before any I/O."""

    parent: int | None
    context_ids: list[int]  # the tokens this turn adds before sampling (mask 0)
    # The full prompt. Continued turns build it as an int32 array: the context's tokens are
    # copied, not turned into Python ints, and the relay packs it without a conversion.
    prompt_ids: Sequence[int]
    request_key: bytes  # key of tools + all request messages
    branch_reason: str
    # The images among context_ids, placed in prompt_ids (the parent's are the parent's).
    images: tuple[PlacedImage, ...] = ()


@dataclass(slots=True)
class Session:
    trial_id: TrialId
    api_key: str
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    options: SessionOptions = field(default_factory=SessionOptions)
    state: SessionState = SessionState.ACTIVE
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    completed_at: float | None = None
    # Who completed the session: the trainer, or the proxy when it expired.
    completed_by: CompletedBy | None = None
    # When the trajectories of the completed session were first fetched (retention starts).
    fetched_at: float | None = None
    reward: float | dict[str, float] | None = None
    # Rewards the trainer gave single agents (by agent id); the others get ``reward``.
    agent_rewards: dict[str, float] = field(default_factory=dict)
    # How the episode ended: set when it is completed (``budget_exhausted`` as soon as a
    # request finds the budget spent).
    outcome: Outcome | None = None
    # Requests of the trial the proxy answered with a server error (5xx: no worker, a
    # worker that failed or was lost, the store): whatever the agent did next was not
    # only its own doing.
    server_errors: int = 0
    nodes: list[TurnNode] = field(default_factory=list)
    by_key: dict[bytes, int] = field(default_factory=dict)
    # A context key's latest turn of an agent whose turn with that key is no longer the
    # one in ``by_key`` (another agent's turn has the same key): few, or none.
    by_agent_key: dict[tuple[str, bytes], int] = field(default_factory=dict)
    # Each agent's first turn's agent record, and that turn's index, by agent id.
    agents: dict[str, TurnAgent] = field(default_factory=dict)
    first_turns: dict[str, int] = field(default_factory=dict)
    # The spawning calls its turns made and sent, and which agent took each.
    spawning: SpawnLedger = field(default_factory=SpawnLedger)
    sampled_tokens: int = 0  # tokens the policy sampled in this session
    # The latest turn recorded for each request body hash (retries are found by it).
    by_request: dict[str, int] = field(default_factory=dict)
    # Tokens the session stores: every turn's context and sampled tokens.
    stored_tokens: int = 0
    # The images its turns' prompts hold, by the sha256 of their bytes: each stored once,
    # however many turns' histories repeat it.
    images: dict[str, ImageData] = field(default_factory=dict)
    # Caches that keep a turn's cost to what it adds (in memory only, rebuilt on a miss,
    # dropped when the session stops taking requests): the histories lately sent, and
    # the whole context that ends with one turn (the turn the next request most likely
    # continues).
    history: HistoryMemory = field(default_factory=HistoryMemory, repr=False, compare=False)
    last_context: tuple[int, array[int]] | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"<Session {self.trial_id} {self.state.value} turns={len(self.nodes)}>"

    # ------------------------------------------------------------------ state

    def transition(self, state: SessionState, *, by: CompletedBy = CompletedBy.TRAINER) -> None:
        if state not in _ALLOWED[self.state]:
            raise ConflictError(
                f"session {self.trial_id} is {self.state.value}", code=f"session_{self.state.value}"
            )
        self.state = state
        self.updated_at = time.time()
        self.history.forget()
        self.last_context = None
        if state is SessionState.COMPLETED:
            self.completed_at = self.updated_at
            self.completed_by = by
            if by is not CompletedBy.TRAINER and self.outcome is None:
                self.outcome = Outcome.TIMEOUT  # expired: the episode ran out of time

    def require_active(self) -> None:
        if self.state is not SessionState.ACTIVE:
            raise ConflictError(
                f"session {self.trial_id} is {self.state.value}; it accepts no more requests",
                code=f"session_{self.state.value}",
            )

    # ------------------------------------------------------------------ tokens

    def path(self, index: int) -> list[TurnNode]:
        """Nodes from the root down to ``index``."""
        out: list[TurnNode] = []
        at: int | None = index
        while at is not None:
            node = self.nodes[at]
            out.append(node)
            at = node.parent
        out.reverse()
        return out

    def context_ids(self, index: int) -> array[int]:
        """Every token of the context that ends with node ``index``'s completion (a new
        array, the caller's to extend).

        The last one built is kept: an agent continues the turn it was just answered
        with, whose context is then the kept one plus that turn's tokens (copied, not
        gathered again from every turn before it)."""
        kept = self.last_context  # read once: a render in a thread may replace it
        node = self.nodes[index]
        if kept is not None and kept[0] == index:
            return kept[1][:]
        if kept is not None and kept[0] == node.parent:
            ids = kept[1][:]
            ids.extend(node.context_ids)
            ids.extend(node.completion_ids)
        else:
            ids = array("i")
            for step in self.path(index):
                ids.extend(step.context_ids)
                ids.extend(step.completion_ids)
        self.last_context = (index, ids[:])
        return ids

    def prompt_images(self, index: int | None) -> list[PlacedImage]:
        """The images of the context that ends with node ``index``'s completion, in order
        (none for None: a new root)."""
        if index is None or not self.images:
            return []
        return [image for step in self.path(index) for image in step.images]

    def find_continuation(
        self, keys: Sequence[bytes], agent: str | None = None
    ) -> tuple[int, int] | None:
        """The node whose context is the longest proper prefix of the request, as
        ``(node index, number of request messages it covers)``, or None; with ``agent``,
        only a node of that agent.

        ``keys[k]`` is the key of the request's first k messages; at least one message
        must be new, so the whole request is not a candidate."""
        for k in range(len(keys) - 2, 0, -1):
            index = self.turn_with_key(keys[k], agent)
            if index is not None:
                return index, k
        return None

    def turn_with_key(self, key: bytes, agent: str | None = None) -> int | None:
        """The latest turn whose context is ``key`` (of ``agent``, when given)."""
        index = self.by_key.get(key)
        if agent is None or index is None or self.nodes[index].agent.id == agent:
            return index
        return self.by_agent_key.get((agent, key))

    def agent(self, agent_id: str) -> TurnAgent | None:
        """The agent with this id, as its first turn recorded it (None: no turn yet)."""
        return self.agents.get(agent_id)

    def add_turn(self, node: TurnNode) -> None:
        if node.parent is not None:
            self.nodes[node.parent].children += 1
        self.nodes.append(node)
        self.stored_tokens += len(node.context_ids) + len(node.completion_ids)
        self.sampled_tokens += len(node.completion_ids)
        agent = node.agent
        earlier = self.by_key.get(node.key)
        if earlier is not None and self.nodes[earlier].agent.id != agent.id:
            # Another agent's turn had this key: it stays findable for its own agent.
            self.by_agent_key[(self.nodes[earlier].agent.id, node.key)] = earlier
        if (agent.id, node.key) in self.by_agent_key:
            self.by_agent_key[(agent.id, node.key)] = node.index
        self.by_key[node.key] = node.index
        if agent.id not in self.agents:
            self.agents[agent.id] = agent
            self.first_turns[agent.id] = node.index
        if agent.spawns or agent.spawned_by is not None or agent.results:
            self.spawning.record(node.index, agent)
        if node.meta.request_hash:
            self.by_request[node.meta.request_hash] = node.index
        self.updated_at = time.time()

    def spawns(self) -> Spawns:
        """Its spawning calls as attribution sees them (``SpawnLedger.view``)."""
        return self.spawning.view(lambda turn: self.nodes[turn].children > 0)

    def spawned_by(self, node: TurnNode) -> dict[str, Any] | None:
        """The call that started ``node``'s agent, on that agent's first turn (None on
        any other turn, and for an agent no call started)."""
        if self.first_turns.get(node.agent.id) != node.index:
            return None
        key = self.spawning.started_by(node.agent)
        return None if key is None else {"turn": key[0], "tool_call_id": key[1]}

    # ------------------------------------------------------------------ export

    def leaves(self) -> Iterator[TurnNode]:
        return (n for n in self.nodes if n.children == 0)

    def trajectory(self, leaf: TurnNode) -> dict[str, Any]:
        path = self.path(leaf.index)
        root = path[0]
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        turns: list[dict[str, Any]] = []
        for i, node in enumerate(path):
            if i > 0:
                response.extend(node.context_ids)
                mask.extend([0] * len(node.context_ids))
                logprobs.extend([0.0] * len(node.context_ids))
                versions.extend([-1] * len(node.context_ids))
            start = len(response)
            response.extend(node.completion_ids)
            mask.extend([1] * len(node.completion_ids))
            logprobs.extend(node.logprobs)
            spans = node_versions(node)
            for version, lo, hi in spans:
                versions.extend([version] * (hi - lo))
            turns.append(
                {
                    "turn": node.index,
                    "parent": node.parent,
                    "prompt_tokens": node.prompt_len,
                    "completion_tokens": len(node.completion_ids),
                    "response_start": start,
                    "response_end": len(response),
                    **node.meta.as_dict(),
                    "versions": [[v, start + lo, start + hi] for v, lo, hi in spans],
                    "agent": node.agent.as_dict(),
                    "spawned_by": self.spawned_by(node),
                }
            )
            if self.options.routed_experts:
                turns[-1]["routing_missing"] = node.routing_missing
        out: dict[str, Any] = {
            # A trajectory is one agent's: a turn continues only its own agent's turns.
            "agent_id": leaf.agent.id,
            "agent_kind": _trajectory_kind(path),
            "prompt_ids": root.context_ids.tolist(),
            "response_ids": response,
            "response_mask": mask,
            "response_logprobs": logprobs,
            "response_versions": versions,
            "turns": turns,
            # Its path in GET /sessions/<trial>/tree: these nodes' ids concatenated are
            # prompt_ids + response_ids (proxy.sessions.tree).
            "nodes": [node.index for node in path],
        }
        placed = [image for node in path for image in node.images]
        if placed:
            # Spans index prompt_ids + response_ids: a prompt's positions are the same in
            # every turn of the path.
            out["multi_modal_data"] = {"images": [self.image_entry(i) for i in placed]}
        teacher = export_teacher(path)
        if teacher is not None:  # aligned with response_ids, 0.0 where the mask is 0
            out["teacher_model"], out["teacher_logprobs"] = teacher
        if self.options.routed_experts:
            # Row i is position i of prompt_ids + response_ids; each turn's rows follow
            # its parent's.
            out["routed_experts"] = export_routing(
                [
                    (0 if i == 0 else path[i - 1].end - 1, node.end - 1, node.routing)
                    for i, node in enumerate(path)
                ]
            )
        return out

    def image_entry(self, placed: PlacedImage) -> dict[str, Any]:
        """An image of the session as the export names it (``span`` in positions of a
        trajectory's ``prompt_ids + response_ids``)."""
        image = self.images[placed.sha256]
        return {
            "sha256": placed.sha256,
            "mime": image.media_type.value,
            "width": image.width,
            "height": image.height,
            "span": [placed.start, placed.end],
        }

    def export(self) -> dict[str, Any]:
        return {
            "trial_id": self.trial_id,
            "status": self.state.value,
            "outcome": self.outcome.value if self.outcome is not None else None,
            "reward": self.reward,
            "agent_rewards": self.agent_rewards,
            "trajectories": [self.trajectory(leaf) for leaf in self.leaves()],
        }

    def agent_list(self) -> list[dict[str, Any]]:
        """The session's agents in the order they first made a turn: one entry per agent
        and kind (an agent's compaction or side requests are entries of their own, with its
        id), each with the turns it made."""
        entries: dict[tuple[str, str], dict[str, Any]] = {}
        for node in self.nodes:
            agent = node.agent
            entry = entries.get((agent.id, agent.kind))
            if entry is None:
                entry = entries[(agent.id, agent.kind)] = {
                    **agent.as_dict(),
                    "spawned_by": None,
                    "turns": [],
                }
            if entry["spawned_by"] is None:
                entry["spawned_by"] = self.spawned_by(node)
            entry["turns"].append(node.index)
        return list(entries.values())

    def summary(self, base_url: str) -> dict[str, Any]:
        sampled = sum(len(n.completion_ids) for n in self.nodes)
        context = sum(len(n.context_ids) for n in self.nodes)
        return {
            "trial_id": self.trial_id,
            "status": self.state.value,
            "base_url": base_url,
            "model": self.model,
            "metadata": self.metadata,
            "sampling": self.sampling,
            **self.options.as_dict(),
            "outcome": self.outcome.value if self.outcome is not None else None,
            "reward": self.reward,
            "agent_rewards": self.agent_rewards,
            "turns": len(self.nodes),
            "agents": len(self.agents),
            "branches": sum(1 for _ in self.leaves()),
            "undelivered_turns": sum(1 for n in self.nodes if not n.meta.delivered),
            "server_errors": self.server_errors,
            **(
                {"routing_missing_turns": sum(1 for n in self.nodes if n.routing_missing)}
                if self.options.routed_experts
                else {}
            ),
            "tokens": {"sampled": sampled, "context": context, "stored": sampled + context},
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "completed_at": self.completed_at,
            "completed_by": self.completed_by.value if self.completed_by is not None else None,
        }
