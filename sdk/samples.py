"""Turning a session's export into training samples.

Policies for a session tree with several branches:

* ``all``: one sample per trajectory (root-to-leaf path), each with the trial's reward.
* ``longest``: only the trajectory with the most sampled tokens.
* ``last``: only the trajectory that ends with the most recent turn.

A turn before a fork belongs to several trajectories. ``shared_turns`` decides how often
its sampled tokens are trained:

* ``once`` (default): in exactly one of the samples that are kept, the one with the most
  sampled tokens among those containing the turn (the earliest in export order on a tie);
  in the others the turn stays as context with mask 0. Ownership is decided after the
  branch policy, the prompt limit and ``stale="drop"`` have left out what they leave out,
  so a turn a kept sample shares with a dropped branch is trained in the kept one. Every
  sampled token of a kept trajectory is then trained exactly once (unless stale or past
  ``max_response_tokens``).
* ``each``: with mask 1 in every trajectory that contains it (a shared prefix is trained
  as many times as there are branches after it).

A reward given as a dict of named components is reduced to one number by ``reward_key``
(a component name) or, by default, their sum.

Length limits: a response longer than ``max_response_tokens`` is cut at its end (the
logprobs of what remains were computed on exactly that prefix) and says so in
``response_truncated``. A prompt longer than ``max_prompt_tokens`` is never cut and
trained: its recorded logprobs were computed on the whole prompt, not on what would be
left. ``overlong_prompt`` says what happens instead:

* ``drop`` (default): no sample.
* ``mask``: a sample that trains nothing (mask all 0), its prompt cut to the last
  ``max_prompt_tokens`` ids so it fits; ``prompt_truncated`` says so. For trainers that
  need one sample per rollout (the verl adapter).

Policy versions: every sample carries ``response_versions``, aligned with
``response_ids``: the weights version that sampled each token, -1 where the mask is 0
(``min_version`` / ``max_version`` over the sampled tokens). With ``current_version`` (the
version the trainer is about to update from) a staleness limit applies: a sampled token
more than ``max_staleness`` versions older than it (default 1: one step off-policy, what
asynchronous trainers bound by default) is stale. ``stale`` says what happens then:

* ``mask`` (default): the stale tokens are masked (they stay as context), fresher tokens
  of the same sample still train, so a long episode that spans updates is not lost.
* ``drop``: a sample with any stale token is dropped (sample-level staleness, as replay
  buffers bounded by an off-policy threshold do).

Without ``current_version`` nothing is stale (a synchronous trainer samples each batch
with the weights it trains).

Agents: every trajectory is one agent's (``agent_id``, ``agent_kind``: the trial's main
agent ``main``, or a sub-agent it spawned; the kinds are ``main``, ``subagent``,
``compaction`` and ``auxiliary``), and every sample carries them. ``agents="all"`` (default)
keeps every agent's, ``"main"`` the main agent's only (its compaction and side requests
included, unless ``kinds`` leaves them out); ``kinds`` keeps the given kinds only
(``TRAINED_KINDS`` leaves out auxiliary requests: titles, summaries asked on the side).
The branch policy applies per agent: ``longest`` keeps each agent's longest trajectory.
A sample's reward is its agent's in ``agent_rewards`` where the trainer gave one, else
the trial's.

Outcomes: the export's ``outcome`` says how the episode ended (``completed``,
``agent_error``, ``infra_error``, ``timeout``, ``budget_exhausted``; None from a proxy
that predates them), carried on every sample. An ``infra_error`` episode is not the
policy's doing: ``infra_error="drop"`` (default) makes no sample of it, ``"mask"`` keeps
its samples with mask all 0 and no reward. A missing reward stays None, never 0;
``failure_reward`` (None by default) is the reward of an ``agent_error``, ``timeout`` or
``budget_exhausted`` episode that has none.

Only what the agent received is trained: a turn whose reply never reached the client
(``delivered: false``: the client left mid-reply, or the proxy died between recording the
reply and writing it) or that a retry replaced (another turn's ``retry_of``) is left out,
unless a later turn continues it (the agent evidently had it). A trajectory ends before its
first such turn; one that is then a part of another is dropped, one that starts with one is
dropped. ``keep_undelivered=True`` trains the export as it is.

Images: a trajectory of a vision-language model carries ``multi_modal_data.images``, one
entry per image occurrence in ``prompt_ids + response_ids``, in order, each with the
half-open ``span`` of its (expanded) placeholder tokens there. Every sample keeps the
images inside its own ids (``Sample.images``, spans in ``prompt_ids + response_ids`` of
the sample). A cut never splits an image: a prompt cut to ``max_prompt_tokens`` is cut
after any image it would split (the prompt is then shorter), a response cut at
``max_response_tokens`` (or where the agent stopped receiving) is cut before it, and the
images left outside are dropped with their tokens. The bytes are not in the export: the
agent loop fills ``SampleImage.data`` from the proxy (``ProxyClient.fill_images``).

Routing (rollout routing replay, R3, for a mixture-of-experts policy): a session created
with ``routed_experts`` exports, per trajectory, the experts every token was routed to at
every MoE layer: ``routed_experts = {"dtype": "uint8" | "uint16", "shape": [rows, layers,
top_k], "data": base64 of the C-order (little-endian) array, "missing": [[start, end],
...]}``, row ``i`` for position ``i`` of ``prompt_ids + response_ids`` and ``rows`` one
less than their length (the last token is never run forward). Every sample of such a
trajectory carries ``Sample.routed_experts``, the rows of its own ids (``len(prompt_ids +
response_ids) - 1`` of them, cut and shifted with its prompt and response). Rows in
``missing`` are zeros the engine could not give: a sampled token after such a row was
computed with routing nobody knows, so the trajectory ends before its first turn that the
proxy marks ``routing_missing`` or that samples a token after a missing row, as it ends
before an undelivered turn (whatever ``keep_undelivered`` says); one left empty is
dropped.
"""

from __future__ import annotations

import base64
import enum
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class BranchPolicy(enum.StrEnum):
    ALL = "all"
    LONGEST = "longest"
    LAST = "last"


class SharedTurns(enum.StrEnum):
    ONCE = "once"
    EACH = "each"


class OverlongPrompt(enum.StrEnum):
    DROP = "drop"
    MASK = "mask"


class StaleTokens(enum.StrEnum):
    MASK = "mask"
    DROP = "drop"


class AgentSelection(enum.StrEnum):
    ALL = "all"
    MAIN = "main"


class InfraErrors(enum.StrEnum):
    DROP = "drop"
    MASK = "mask"


MAIN_AGENT = "main"
AGENT_KINDS = frozenset({"main", "subagent", "compaction", "auxiliary"})
# Every kind but the side requests an agent makes (titles, summaries asked for aside).
TRAINED_KINDS = frozenset({"main", "subagent", "compaction"})
# Outcomes that are the policy's doing, and may get ``failure_reward``.
POLICY_FAILURES = frozenset({"agent_error", "timeout", "budget_exhausted"})


DEFAULT_MAX_STALENESS = 1


@dataclass(slots=True)
class SampleImage:
    """One image occurrence in a sample: its placeholder tokens are ``[start, end)`` of
    ``prompt_ids + response_ids``; ``data`` is the image as the agent sent it (None until
    fetched from the proxy)."""

    sha256: str
    mime: str
    width: int
    height: int
    start: int
    end: int
    data: bytes | None = None

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @classmethod
    def from_export(cls, entry: dict[str, Any]) -> SampleImage:
        start, end = (int(x) for x in entry["span"])
        if not 0 <= start < end:
            raise ValueError(f"image {str(entry.get('sha256'))[:12]}: bad span {entry['span']}")
        return cls(
            sha256=str(entry["sha256"]),
            mime=str(entry.get("mime") or "application/octet-stream"),
            width=int(entry.get("width") or 0),
            height=int(entry.get("height") or 0),
            start=start,
            end=end,
        )


def export_images(traj: dict[str, Any]) -> list[SampleImage]:
    """The images of an exported trajectory, in order (none: no ``multi_modal_data`` key,
    or an empty list)."""
    data = traj.get("multi_modal_data") or {}
    entries = (data.get("images") or []) if isinstance(data, dict) else []
    images = [SampleImage.from_export(e) for e in entries]
    for before, after in itertools.pairwise(images):
        if after.start < before.end:
            raise ValueError(
                f"image spans {before.span} and {after.span} overlap or are out of order"
            )
    return images


# The dtypes an export's routing may come in (at most 256 experts: uint8).
ROUTING_DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2")}


@dataclass(slots=True, frozen=True)
class ExportRouting:
    """An exported trajectory's routing: ``rows`` ``[positions, layers, top_k]``, row ``i``
    for position ``i`` of its ``prompt_ids + response_ids``; ``missing``: half-open ranges
    of rows the engine could not give (zeros there)."""

    rows: np.ndarray[Any, Any]
    missing: tuple[tuple[int, int], ...] = ()

    @property
    def first_missing(self) -> int | None:
        return min((start for start, _ in self.missing), default=None)


def encode_routing(
    rows: np.ndarray[Any, Any], missing: Sequence[tuple[int, int]] = ()
) -> dict[str, Any]:
    """The export's ``routed_experts`` entry for ``rows`` (uint8 or uint16)."""
    name = {np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "uint16"}.get(rows.dtype)
    if name is None or rows.ndim != 3:
        raise ValueError(
            f"routing rows must be [rows, layers, top_k] uint8/uint16, not {rows.dtype}"
        )
    data = np.ascontiguousarray(rows, dtype=ROUTING_DTYPES[name]).tobytes()
    return {
        "dtype": name,
        "shape": list(rows.shape),
        "data": base64.b64encode(data).decode("ascii"),
        "missing": [[int(a), int(b)] for a, b in missing],
    }


def export_routing(traj: dict[str, Any]) -> ExportRouting | None:
    """The routing of an exported trajectory (None: it has none), checked against its ids."""
    entry = traj.get("routed_experts")
    if entry is None:
        return None
    if isinstance(entry, ExportRouting):
        return entry
    dtype = ROUTING_DTYPES.get(str(entry.get("dtype")))
    if dtype is None:
        raise ValueError(f"routed_experts: unknown dtype {entry.get('dtype')!r}")
    shape = tuple(int(x) for x in entry["shape"])
    expected = len(traj["prompt_ids"]) + len(traj["response_ids"]) - 1
    if len(shape) != 3 or shape[0] != max(expected, 0):
        raise ValueError(
            f"routed_experts of shape {list(shape)} for {expected + 1} ids: expected "
            f"[{expected}, layers, top_k] (one row per id but the last)"
        )
    raw = base64.b64decode(entry["data"], validate=True)
    if len(raw) != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"routed_experts: {len(raw)} bytes for shape {list(shape)} {dtype}")
    rows = np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    missing: list[tuple[int, int]] = []
    for pair in entry.get("missing") or []:
        start, end = (int(x) for x in pair)
        if not 0 <= start < end <= shape[0]:
            raise ValueError(f"routed_experts: missing range {pair} outside {shape[0]} rows")
        missing.append((start, end))
    return ExportRouting(rows.astype(dtype.newbyteorder("="), copy=False), tuple(sorted(missing)))


def routing_missing(turn: dict[str, Any], prompt_length: int, routing: ExportRouting) -> bool:
    """Whether ``turn`` samples a token after a row its engine could not give (or the proxy
    says so): its logprobs were computed with routing that cannot be replayed."""
    if turn.get("routing_missing"):
        return True
    first = routing.first_missing
    # The token at position p is computed from the rows of positions before p.
    return first is not None and prompt_length + int(turn["response_end"]) - 1 > first


@dataclass(slots=True)
class Sample:
    trial_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward: float | None
    num_turns: int
    branch: int
    prompt_truncated: bool = False
    response_truncated: bool = False
    turns: list[dict[str, Any]] = field(default_factory=list)
    # Per response token, the version of the weights that sampled it (-1: mask 0).
    response_versions: list[int] = field(default_factory=list)
    stale_tokens: int = 0  # sampled tokens masked for being older than the limit
    # The images inside prompt_ids + response_ids, in order (empty: a text sample).
    images: list[SampleImage] = field(default_factory=list)
    # R3: the experts each position of prompt_ids + response_ids but the last was routed
    # to at rollout, [len(ids) - 1, layers, top_k] (None: the session recorded no routing).
    routed_experts: np.ndarray[Any, Any] | None = None
    # The agent whose trajectory it is ("main": the trial's main agent) and its kind.
    agent_id: str = MAIN_AGENT
    agent_kind: str = "main"
    # How the episode ended (None: the export does not say).
    outcome: str | None = None

    @property
    def sampled_tokens(self) -> int:
        return sum(self.response_mask)

    @property
    def min_version(self) -> int | None:
        """The oldest weights that sampled a trained token (None: no token trains)."""
        trained = [v for v, m in zip(self.response_versions, self.response_mask, strict=True) if m]
        return min(trained) if trained else None

    @property
    def max_version(self) -> int | None:
        """The newest weights that sampled a trained token (None: no token trains)."""
        trained = [v for v, m in zip(self.response_versions, self.response_mask, strict=True) if m]
        return max(trained) if trained else None

    @property
    def policy_versions(self) -> list[int | None]:
        """Per turn, the weights version the worker reported (``extra["policy_version"]``),
        None for a turn from a worker that reports none."""
        versions: list[int | None] = []
        for turn in self.turns:
            value = (turn.get("extra") or {}).get("policy_version")
            versions.append(int(value) if isinstance(value, int | float) else None)
        return versions


def scalar_reward(reward: float | dict[str, float] | None, key: str | None = None) -> float | None:
    if reward is None or isinstance(reward, int | float):
        return None if reward is None else float(reward)
    if key is not None:
        return float(reward[key])
    return float(sum(reward.values()))


def build_samples(
    export: dict[str, Any],
    *,
    policy: BranchPolicy = BranchPolicy.ALL,
    reward_key: str | None = None,
    max_prompt_tokens: int | None = None,
    max_response_tokens: int | None = None,
    shared_turns: SharedTurns = SharedTurns.ONCE,
    overlong_prompt: OverlongPrompt = OverlongPrompt.DROP,
    current_version: int | None = None,
    max_staleness: int = DEFAULT_MAX_STALENESS,
    stale: StaleTokens = StaleTokens.MASK,
    keep_undelivered: bool = False,
    agents: AgentSelection | str = AgentSelection.ALL,
    kinds: Collection[str] | None = None,
    infra_error: InfraErrors | str = InfraErrors.DROP,
    failure_reward: float | None = None,
) -> list[Sample]:
    agents, infra_error = AgentSelection(agents), InfraErrors(infra_error)
    unknown = set(kinds or ()) - AGENT_KINDS
    if unknown:
        raise ValueError(f"unknown agent kinds {sorted(unknown)}; kinds: {sorted(AGENT_KINDS)}")
    outcome = export.get("outcome")
    if outcome == "infra_error" and infra_error is InfraErrors.DROP:
        return []
    origin, trajectories = _received(export.get("trajectories", []), keep_undelivered)
    if not trajectories:
        return []
    candidates = [
        (i, traj)
        for i, traj in enumerate(trajectories)
        if (agents is AgentSelection.ALL or _agent(traj)[0] == MAIN_AGENT)
        and (kinds is None or _agent(traj)[1] in kinds)
    ]
    chosen = [pick for group in _by_agent(candidates) for pick in _chosen(group, policy)]
    chosen.sort(key=lambda item: item[0])
    reward = scalar_reward(export.get("reward"), reward_key)
    if reward is None and outcome in POLICY_FAILURES:
        reward = failure_reward
    agent_rewards = export.get("agent_rewards") or {}
    drafts: list[_Draft] = []
    for branch, traj in chosen:
        draft = _draft(branch, traj, max_prompt_tokens, max_response_tokens, overlong_prompt)
        if draft is None:
            continue
        oldest = None if current_version is None else current_version - max_staleness
        if oldest is not None and stale is StaleTokens.DROP and draft.stale_at(oldest):
            continue
        drafts.append(draft)
    # Shared turns go to one of the trajectories that are kept and can train: deciding
    # among all of them would leave a turn shared with a dropped branch trained nowhere.
    owners = (
        _owners([(d.branch, d.traj) for d in drafts if not d.prompt_truncated])
        if shared_turns is SharedTurns.ONCE
        else None
    )
    samples: list[Sample] = []
    for draft in drafts:
        traj, mask = draft.traj, draft.mask
        if owners is not None:
            for turn in traj["turns"]:
                if owners.get(turn["turn"], draft.branch) != draft.branch:
                    start, end = turn["response_start"], turn["response_end"]
                    mask[start:end] = [0] * len(mask[start:end])
        stale_tokens = 0
        if current_version is not None:
            stale_at = draft.stale_at(current_version - max_staleness)
            for i in stale_at:
                mask[i] = 0
            stale_tokens = len(stale_at)
        agent_id, agent_kind = _agent(traj)
        sample_reward = reward
        if agent_id in agent_rewards:
            sample_reward = scalar_reward(agent_rewards[agent_id], reward_key)
        if outcome == "infra_error":  # kept to fill a batch, never trained or rewarded
            mask = [0] * len(mask)
            sample_reward = None
        samples.append(
            Sample(
                trial_id=str(export.get("trial_id", "")),
                prompt_ids=draft.prompt,
                response_ids=draft.response,
                response_mask=mask,
                response_logprobs=draft.logprobs,
                reward=sample_reward,
                num_turns=len(traj["turns"]),
                branch=origin[draft.branch],
                prompt_truncated=draft.prompt_truncated,
                response_truncated=draft.response_truncated,
                turns=list(traj["turns"]),
                response_versions=[
                    v if m else -1 for v, m in zip(draft.versions, mask, strict=True)
                ],
                stale_tokens=stale_tokens,
                images=draft.images,
                routed_experts=draft.routed_experts,
                agent_id=agent_id,
                agent_kind=agent_kind,
                outcome=None if outcome is None else str(outcome),
            )
        )
    return samples


def main_sample(samples: Sequence[Sample]) -> Sample:
    """The sample a trainer that takes one completion per prompt trains: the main agent's
    (its first), else the first."""
    return next((s for s in samples if s.agent_id == MAIN_AGENT), samples[0])


def _agent(traj: dict[str, Any]) -> tuple[str, str]:
    """A trajectory's agent id and kind (an export from before agents: the main agent)."""
    return str(traj.get("agent_id", MAIN_AGENT)), str(traj.get("agent_kind", "main"))


def _by_agent(
    candidates: list[tuple[int, dict[str, Any]]],
) -> list[list[tuple[int, dict[str, Any]]]]:
    """The trajectories grouped by agent, in order of each agent's first."""
    groups: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for item in candidates:
        groups.setdefault(_agent(item[1])[0], []).append(item)
    return list(groups.values())


def _chosen(
    candidates: list[tuple[int, dict[str, Any]]], policy: BranchPolicy
) -> list[tuple[int, dict[str, Any]]]:
    """The trajectories the branch policy keeps, with their index among the received."""
    if policy is BranchPolicy.LONGEST:
        return [max(candidates, key=lambda it: sum(it[1]["response_mask"]))]
    if policy is BranchPolicy.LAST:
        return [max(candidates, key=lambda it: max(t["turn"] for t in it[1]["turns"]))]
    return candidates


@dataclass(slots=True)
class _Draft:
    """One kept trajectory cut to the length limits, before shared turns and staleness
    are masked."""

    branch: int
    traj: dict[str, Any]
    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_truncated: bool
    response_truncated: bool
    images: list[SampleImage] = field(default_factory=list)
    routed_experts: np.ndarray[Any, Any] | None = None

    def stale_at(self, oldest: int) -> list[int]:
        """Positions of the trained tokens sampled by a version older than ``oldest``."""
        return [
            i
            for i, (v, m) in enumerate(zip(self.versions, self.mask, strict=True))
            if m and v < oldest
        ]


def _draft(
    branch: int,
    traj: dict[str, Any],
    max_prompt_tokens: int | None,
    max_response_tokens: int | None,
    overlong_prompt: OverlongPrompt,
) -> _Draft | None:
    """The trajectory within the length limits; None when its prompt drops it."""
    prompt = list(traj["prompt_ids"])
    response = list(traj["response_ids"])
    mask = list(traj["response_mask"])
    logprobs = list(traj["response_logprobs"])
    versions = _versions(traj, len(response))
    images = export_images(traj)
    routing = export_routing(traj)
    cut = 0  # ids cut from the prompt's start
    prompt_truncated = max_prompt_tokens is not None and len(prompt) > max_prompt_tokens
    if prompt_truncated:
        assert max_prompt_tokens is not None
        if overlong_prompt is OverlongPrompt.DROP:
            return None
        # Kept so the batch has it, but trains nothing: the cut prompt is not what the
        # recorded logprobs were computed on. An image is never split: the cut moves
        # past it, and the images before the cut go with their tokens.
        cut = len(prompt) - max_prompt_tokens
        for image in images:
            if image.start < cut < image.end:
                cut = image.end
        prompt = prompt[cut:]
        mask = [0] * len(mask)
        images = [
            SampleImage(i.sha256, i.mime, i.width, i.height, i.start - cut, i.end - cut)
            for i in images
            if i.start >= cut
        ]
    response_truncated = max_response_tokens is not None and len(response) > max_response_tokens
    keep = max_response_tokens if response_truncated else len(response)
    assert keep is not None
    # An image the response cut (or the end of what the agent received) would split is
    # left out whole: the response ends before it.
    for image in images:
        if image.start < len(prompt) + keep < image.end:
            keep = max(image.start - len(prompt), 0)
            response_truncated = True
    if keep < len(response):
        response = response[:keep]
        mask = mask[:keep]
        logprobs = logprobs[:keep]
        versions = versions[:keep]
    images = [i for i in images if i.end <= len(prompt) + len(response)]
    rows = None
    if routing is not None:
        # The rows of this sample's ids (shifted with a cut prompt), none for its last id.
        rows = routing.rows[cut : cut + max(len(prompt) + len(response) - 1, 0)]
    return _Draft(
        branch,
        traj,
        prompt,
        response,
        mask,
        logprobs,
        versions,
        prompt_truncated,
        response_truncated,
        images,
        rows,
    )


def newest_version(export: dict[str, Any]) -> int | None:
    """The newest weights version that sampled any token of the export (None: none says)."""
    newest: int | None = None
    for traj in export.get("trajectories", []):
        versions = _versions(traj, len(traj["response_ids"]))
        top = max((v for v in versions if v >= 0), default=None)
        if top is not None and (newest is None or top > newest):
            newest = top
    return newest


def _versions(traj: dict[str, Any], length: int) -> list[int]:
    """The trajectory's ``response_versions``; an export from before versions were kept
    per token gets each turn's ``extra["policy_version"]`` (0 when it has none)."""
    versions = traj.get("response_versions")
    if versions is not None:
        return list(versions)
    out = [-1] * length
    for turn in traj["turns"]:
        value = (turn.get("extra") or {}).get("policy_version", 0)
        version = int(value) if isinstance(value, int | float) else 0
        for i in range(turn["response_start"], turn["response_end"]):
            out[i] = version
    return out


def _owners(trajectories: list[tuple[int, dict[str, Any]]]) -> dict[int, int]:
    """Per turn index, the trajectory (by its branch number) that trains it: the one with
    the most sampled tokens among those given that contain it, the earliest on a tie."""
    owners: dict[int, int] = {}
    sampled = {branch: sum(traj["response_mask"]) for branch, traj in trajectories}
    for branch, traj in trajectories:
        for turn in traj["turns"]:
            held = owners.get(turn["turn"])
            if held is None or sampled[branch] > sampled[held]:
                owners[turn["turn"]] = branch
    return owners


def _received(
    trajectories: list[dict[str, Any]], keep_undelivered: bool = False
) -> tuple[list[int], list[dict[str, Any]]]:
    """The trajectories cut to what the agent received and to what their routing can
    replay: each ends before its first turn that was not delivered or was superseded by a
    retry (unless a later turn continues it; not checked with ``keep_undelivered``), or
    that samples after a missing routing row; one left empty, or equal to the start of
    another, is dropped. Returns each kept one's index in the export with it (its routing
    decoded). Exports without the fields count as delivered."""
    turns = [turn for traj in trajectories for turn in traj["turns"]]
    continued = {t["parent"] for t in turns if t.get("parent") is not None}
    superseded = {t["retry_of"] for t in turns if t.get("retry_of") is not None}

    def received(turn: dict[str, Any]) -> bool:
        index = turn["turn"]
        return index in continued or (bool(turn.get("delivered", True)) and index not in superseded)

    cut: list[tuple[int, dict[str, Any]]] = []
    for index, traj in enumerate(trajectories):
        routing = export_routing(traj)
        if routing is not None:  # decoded once, checked against the whole trajectory
            traj = {**traj, "routed_experts": routing}
        path = traj["turns"]
        n = 0
        while n < len(path) and (keep_undelivered or received(path[n])):
            if routing is not None and routing_missing(path[n], len(traj["prompt_ids"]), routing):
                break
            n += 1
        if n == len(path):
            cut.append((index, traj))
        elif n > 0:
            end = path[n - 1]["response_end"]
            length = len(traj["response_ids"])
            kept = {
                key: value[:end]
                if key.startswith("response_") and isinstance(value, list) and len(value) == length
                else value
                for key, value in traj.items()
            }
            kept["turns"] = path[:n]
            cut.append((index, kept))
    paths = [tuple(t["turn"] for t in traj["turns"]) for _, traj in cut]
    out: list[tuple[int, dict[str, Any]]] = []
    for i, item in enumerate(cut):
        mine = paths[i]
        inside = any(
            j != i and other[: len(mine)] == mine and (len(other) > len(mine) or j < i)
            for j, other in enumerate(paths)
        )
        if not inside:
            out.append(item)
    return [i for i, _ in out], [traj for _, traj in out]
