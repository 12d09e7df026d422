"""Agents and segments: which turns of an export train, as whose, and in which piece of
the episode (``sdk.samples.build_samples`` applies them).

Every exported turn says its agent (``agent: {"id", "parent", "kind"}``): the trial's main
agent ``main`` or a sub-agent it spawned (its own id), and the kind of request: ``main``
(the main agent's own turns), ``subagent``, ``compaction`` (the conversation summarised to
go on in less context) or ``auxiliary`` (a title, a summary asked on the side). A path holds
one agent's turns, but the main agent's may mix kinds: its compaction and side requests
carry its id. A turn without ``agent`` (an export from before agents) is its trajectory's
``agent_id`` / ``agent_kind``, the main agent's when it says none.

Kept turns: ``agents`` (every agent's, or the main agent's only) and ``kinds`` (None: every
kind) decide per turn. A turn not kept is context (mask 0 over its sampled span) where a
kept turn follows it on the path, and cut where it trails: the trajectory ends after its
last kept turn. A trajectory with no kept turn makes no sample, and one that the cut leaves
a part of another is dropped (nothing is trained twice). A turn not kept never decides
whether the turns around it train.

Whose a trajectory is: ``agent_id`` is the agent of its kept turns, and ``agent_kind`` the
first of ``main``, ``subagent``, ``compaction``, ``auxiliary`` among their kinds (``main``
as soon as one main turn is kept), never the kind of its leaf alone.

Segments: a root of the session's tree and the turns under it are one segment of their
agent's episode, ``segment`` being the root turn's index. The main agent has several when
it starts over as a new root after a compaction (Claude Code's auto-compaction), a
sub-agent when its chain is rewritten, and a side request sent as a new root (a title) is a
segment of its own. Every segment trains, each with the episode's reward: the branch policy
chooses within each (agent, segment), never between segments. Within one, it looks at the
turns of its principal kind (the first of ``main``, ``subagent``, ``compaction``,
``auxiliary`` among the kept turns of its trajectories: ``main`` for the main agent's
chain):

* ``longest``: the trajectory with the most sampled tokens in turns of that kind (then in
  all its kept turns; the first in export order on a tie);
* ``last``: the trajectory holding the newest turn of that kind, the one that ends soonest
  after it on a tie: the chain that ends in the agent's last turn, never a compaction
  request or a side request forked off it;
* ``all``: every trajectory.

``main_sample`` is the sample a trainer that takes one completion per episode trains: the
main agent's that holds its newest main turn (the chain that ends in its answer, in its
last segment). ``segments`` lists an agent's segments among samples, for a trainer to say
what it left out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # samples.py imports this module
    from sdk.samples import Sample


class BranchPolicy(enum.StrEnum):
    ALL = "all"
    LONGEST = "longest"
    LAST = "last"


MAIN_AGENT = "main"
# In the order that names a trajectory's kind: the first among its kept turns'.
KIND_ORDER = ("main", "subagent", "compaction", "auxiliary")
AGENT_KINDS = frozenset(KIND_ORDER)
# Every kind but the side requests an agent makes (titles, summaries asked for aside).
TRAINED_KINDS = frozenset({"main", "subagent", "compaction"})

# Whether a turn of this agent id and kind is kept.
Keep = Callable[[str, str], bool]


def keeper(main_only: bool, kinds: Collection[str] | None) -> Keep:
    """The turns kept: the main agent's only or every agent's, of ``kinds`` (None: all)."""
    unknown = set(kinds or ()) - AGENT_KINDS
    if unknown:
        raise ValueError(f"unknown agent kinds {sorted(unknown)}; kinds: {sorted(AGENT_KINDS)}")
    allowed = None if kinds is None else frozenset(kinds)

    def keep(agent_id: str, kind: str) -> bool:
        return (not main_only or agent_id == MAIN_AGENT) and (allowed is None or kind in allowed)

    return keep


def turn_agent(turn: dict[str, Any], default: tuple[str, str]) -> tuple[str, str]:
    """A turn's agent id and kind; ``default`` for a turn that does not say."""
    agent = turn.get("agent")
    if isinstance(agent, dict) and agent.get("id") is not None:
        return str(agent["id"]), str(agent.get("kind") or default[1])
    return default


def trajectory_default(traj: dict[str, Any]) -> tuple[str, str]:
    """What a trajectory says of its turns' agent (an export from before agents: main)."""
    return str(traj.get("agent_id") or MAIN_AGENT), str(traj.get("agent_kind") or "main")


def first_kind(kinds: Collection[str]) -> str:
    """The kind that names a set of turns' kinds (``main`` when one is main)."""
    return min(kinds, key=lambda k: KIND_ORDER.index(k) if k in KIND_ORDER else len(KIND_ORDER))


# Per-response-token lists of a trajectory whose names do not start with ``response_``.
_PER_RESPONSE_TOKEN = frozenset({"teacher_logprobs"})


def cut_trajectory(traj: dict[str, Any], turns: int) -> dict[str, Any]:
    """``traj`` ending after its first ``turns`` turns: every per-response-token list cut
    at the end of the last one (``traj`` itself when it has no more)."""
    path = traj["turns"]
    if turns >= len(path):
        return traj
    end = path[turns - 1]["response_end"]
    length = len(traj["response_ids"])
    kept = {
        key: value[:end]
        if (key.startswith("response_") or key in _PER_RESPONSE_TOKEN)
        and isinstance(value, list)
        and len(value) == length
        else value
        for key, value in traj.items()
    }
    kept["turns"] = path[:turns]
    return kept


@dataclass(slots=True, frozen=True)
class Kept:
    """A trajectory cut to its kept turns (context masked), with whose it is."""

    index: int  # in the export
    traj: dict[str, Any]
    kinds: tuple[str, ...]  # per turn of traj["turns"]
    kept: tuple[bool, ...]  # per turn: trained (True) or context
    agent_id: str
    agent_kind: str

    @property
    def segment(self) -> int:
        return int(self.traj["turns"][0]["turn"])

    @property
    def path(self) -> tuple[int, ...]:
        return tuple(int(t["turn"]) for t in self.traj["turns"])


def keep_turns(index: int, traj: dict[str, Any], length: int, keep: Keep) -> Kept | None:
    """``traj``'s first ``length`` turns cut after the last kept one, the turns not kept
    before it masked; None when none is kept."""
    default = trajectory_default(traj)
    agents = [turn_agent(turn, default) for turn in traj["turns"][:length]]
    flags = [keep(agent_id, kind) for agent_id, kind in agents]
    last = max((i for i, flag in enumerate(flags) if flag), default=None)
    if last is None:
        return None
    out = cut_trajectory(traj, last + 1)
    agents, flags = agents[: last + 1], flags[: last + 1]
    if not all(flags):
        mask = list(out["response_mask"])
        for turn, flag in zip(out["turns"], flags, strict=True):
            if not flag:
                start, end = turn["response_start"], turn["response_end"]
                mask[start:end] = [0] * len(mask[start:end])
        out = {**out, "response_mask": mask}
    owners = [agent for agent, flag in zip(agents, flags, strict=True) if flag]
    kind = first_kind({kind for _, kind in owners})
    return Kept(index, out, tuple(k for _, k in agents), tuple(flags), owners[-1][0], kind)


def distinct(paths: list[Kept]) -> list[Kept]:
    """``paths`` less each that is the start of another (or equal to an earlier one)."""
    keys = [p.path for p in paths]
    return [
        p
        for i, p in enumerate(paths)
        if not any(
            j != i and other[: len(keys[i])] == keys[i] and (len(other) > len(keys[i]) or j < i)
            for j, other in enumerate(keys)
        )
    ]


def choose(paths: list[Kept], policy: BranchPolicy) -> list[Kept]:
    """What the branch policy keeps of each (agent, segment), in export order."""
    groups: dict[tuple[str, int], list[Kept]] = {}
    for path in paths:
        groups.setdefault((path.agent_id, path.segment), []).append(path)
    chosen = [pick for group in groups.values() for pick in _chosen(group, policy)]
    return sorted(chosen, key=lambda p: p.index)


def _principal(path: Kept, kind: str) -> list[int]:
    """Positions of ``path``'s kept turns of ``kind``."""
    return [
        i
        for i, (k, kept) in enumerate(zip(path.kinds, path.kept, strict=True))
        if kept and k == kind
    ]


def _chosen(group: list[Kept], policy: BranchPolicy) -> list[Kept]:
    if policy is BranchPolicy.ALL:
        return group
    kind = first_kind({k for p in group for k, kept in zip(p.kinds, p.kept, strict=True) if kept})

    def longest(path: Kept) -> tuple[int, int]:
        mask, turns = path.traj["response_mask"], path.traj["turns"]
        principal = sum(
            sum(mask[turns[i]["response_start"] : turns[i]["response_end"]])
            for i in _principal(path, kind)
        )
        return principal, sum(mask)

    def last(path: Kept) -> tuple[int, int]:
        position = max(_principal(path, kind), key=lambda i: path.path[i], default=None)
        if position is None:
            return -1, 0
        return path.path[position], position - len(path.path)

    return [max(group, key=longest if policy is BranchPolicy.LONGEST else last)]


def _main_turn(sample: Sample) -> tuple[int, bool, int] | None:
    """The newest main turn of a main-agent sample (its index, whether the sample trains
    it, and minus how many turns follow it); None: it holds none."""
    default = (sample.agent_id, sample.agent_kind)
    found: tuple[int, bool, int] | None = None
    for position, turn in enumerate(sample.turns):
        if turn_agent(turn, default)[1] != "main":
            continue
        span = sample.response_mask[turn["response_start"] : turn["response_end"]]
        key = (int(turn["turn"]), any(span), position - len(sample.turns))
        if found is None or key > found:
            found = key
    return found


def main_sample(samples: Sequence[Sample]) -> Sample:
    """The sample a trainer that takes one completion per episode trains: the main agent's
    that holds its newest main turn (the chain that ends in its answer: of its last
    segment, never a title or a compaction branch), the one that trains it and ends
    soonest after it when several do; without any, the main agent's first, else the
    first."""
    best: Sample | None = None
    best_key: tuple[int, bool, int] | None = None
    for sample in samples:
        if sample.agent_id != MAIN_AGENT:
            continue
        key = _main_turn(sample)
        if key is not None and (best_key is None or key > best_key):
            best, best_key = sample, key
    if best is not None:
        return best
    return next((s for s in samples if s.agent_id == MAIN_AGENT), samples[0])


def segments(samples: Sequence[Sample], agent_id: str = MAIN_AGENT) -> list[int]:
    """The segments (root turn indices) of ``agent_id``'s samples that train its own
    kind of turn, in order: a side request on a root of its own (a title) or a lone
    compaction request is no piece of the episode."""
    own = "main" if agent_id == MAIN_AGENT else "subagent"
    return sorted({s.segment for s in samples if s.agent_id == agent_id and s.agent_kind == own})


def untrained_segments(samples: Sequence[Sample], chosen: Sample) -> int:
    """How many segments of ``chosen``'s agent a trainer that trains ``chosen`` alone
    (one completion per episode) leaves untrained."""
    return sum(1 for segment in segments(samples, chosen.agent_id) if segment != chosen.segment)
