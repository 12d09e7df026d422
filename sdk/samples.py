"""Turning a session's export into training samples.

Policies for a session tree with several branches, applied per agent and segment (a root
of the tree and the turns under it: see "Agents and segments" below):

* ``all``: one sample per trajectory (root-to-leaf path), each with the trial's reward.
* ``longest``: only the trajectory with the most sampled tokens.
* ``last``: only the trajectory that ends with the agent's most recent turn.

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

Agents and segments (``sdk.segments`` says it exactly): ``agents="all"`` (default) keeps
every agent's turns, ``"main"`` the main agent's only (its compaction and side requests
included, unless ``kinds`` leaves them out); ``kinds`` keeps turns of the given kinds
(``TRAINED_KINDS`` leaves out auxiliary requests: titles, summaries asked on the side). It
decides per turn: a turn left out is context (mask 0) where a kept turn follows it, and
cut where it trails; a trajectory with no kept turn makes no sample. A sample is its kept
turns' agent's (``agent_id``, and ``agent_kind``: ``main`` when it holds a main turn). A
root of the tree and the turns under it are one segment of an agent's episode
(``segment``: the root turn's index; the main agent starts a new one after a compaction):
the branch policy keeps one trajectory per agent and segment, chosen by the turns of the
agent's own kind (``last`` keeps the chain that ends in the agent's last turn, never a
compaction or title branch), so every segment trains once. A sample's reward is its
agent's in ``agent_rewards`` where the trainer gave one, else the trial's (every segment
gets it). ``main_sample`` is the main agent's sample that ends in its answer.

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

import enum
import itertools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdk.sample_routing import ROUTING_DTYPES as ROUTING_DTYPES
from sdk.sample_routing import ExportRouting as ExportRouting
from sdk.sample_routing import encode_routing as encode_routing
from sdk.sample_routing import export_routing as export_routing
from sdk.sample_routing import routing_missing as routing_missing
from sdk.segments import AGENT_KINDS as AGENT_KINDS
from sdk.segments import MAIN_AGENT as MAIN_AGENT
from sdk.segments import TRAINED_KINDS as TRAINED_KINDS
from sdk.segments import BranchPolicy as BranchPolicy
from sdk.segments import Keep, Kept, choose, distinct, keep_turns, keeper
from sdk.segments import main_sample as main_sample
from sdk.segments import segments as segments
from sdk.segments import untrained_segments as untrained_segments


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
    # The agent of its trained turns ("main": the trial's main agent) and their kind
    # ("main" when one is a main turn; see sdk.segments).
    agent_id: str = MAIN_AGENT
    agent_kind: str = "main"
    # How the episode ended (None: the export does not say).
    outcome: str | None = None
    # The segment of the agent's episode it belongs to: the index of its root turn. An
    # agent that starts over as a new root (the main agent after a compaction) has one
    # segment per root, each trained once with the episode's reward (see sdk.segments).
    segment: int = 0
    # On-policy distillation: a teacher's logprob of each response token (0.0 where the
    # mask was 0 in the export), cut as ``response_logprobs`` is, and the teacher's name
    # (None: the session was not scored by one teacher, POST /sessions/<trial>/teacher).
    teacher_logprobs: list[float] | None = None
    teacher_model: str | None = None

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
    keep = keeper(agents is AgentSelection.MAIN, kinds)
    outcome = export.get("outcome")
    if outcome == "infra_error" and infra_error is InfraErrors.DROP:
        return []
    kept = _received(export.get("trajectories", []), keep_undelivered, keep)
    oldest = None if current_version is None else current_version - max_staleness
    drafts: list[_Draft] = []
    for path in choose(kept, BranchPolicy(policy)):
        draft = _draft(path, max_prompt_tokens, max_response_tokens, overlong_prompt)
        if draft is None:
            continue
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
    reward = scalar_reward(export.get("reward"), reward_key)
    if reward is None and outcome in POLICY_FAILURES:
        reward = failure_reward
    rewards = {
        agent: scalar_reward(value, reward_key)
        for agent, value in (export.get("agent_rewards") or {}).items()
    }
    samples: list[Sample] = []
    for draft in drafts:
        if owners is not None:
            draft.disown(owners)
        stale_tokens = draft.mask_stale(oldest)
        sample = draft.sample(str(export.get("trial_id", "")), rewards.get(draft.agent_id, reward))
        sample.stale_tokens = stale_tokens
        sample.outcome = None if outcome is None else str(outcome)
        if outcome == "infra_error":  # kept to fill a batch, never trained or rewarded
            sample.response_mask = [0] * len(sample.response_mask)
            sample.response_versions = [-1] * len(sample.response_versions)
            sample.reward = None
        samples.append(sample)
    return samples


@dataclass(slots=True)
class _Draft:
    """One kept trajectory cut to the length limits, before shared turns and staleness
    are masked."""

    source: Kept
    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_truncated: bool
    response_truncated: bool
    images: list[SampleImage] = field(default_factory=list)
    routed_experts: np.ndarray[Any, Any] | None = None
    teacher: list[float] | None = None  # the teacher's logprobs, cut as ``logprobs``

    @property
    def branch(self) -> int:
        return self.source.index

    @property
    def traj(self) -> dict[str, Any]:
        return self.source.traj

    @property
    def agent_id(self) -> str:
        return self.source.agent_id

    def stale_at(self, oldest: int) -> list[int]:
        """Positions of the trained tokens sampled by a version older than ``oldest``."""
        return [
            i
            for i, (v, m) in enumerate(zip(self.versions, self.mask, strict=True))
            if m and v < oldest
        ]

    def disown(self, owners: dict[int, int]) -> None:
        """Mask the turns another trajectory trains (``owners``: turn -> branch)."""
        for turn in self.traj["turns"]:
            if owners.get(turn["turn"], self.branch) != self.branch:
                start, end = turn["response_start"], turn["response_end"]
                self.mask[start:end] = [0] * len(self.mask[start:end])

    def mask_stale(self, oldest: int | None) -> int:
        """Mask the tokens older than ``oldest`` (None: none is stale); how many."""
        stale = [] if oldest is None else self.stale_at(oldest)
        for i in stale:
            self.mask[i] = 0
        return len(stale)

    def sample(self, trial_id: str, reward: float | None) -> Sample:
        source = self.source
        return Sample(
            trial_id=trial_id,
            prompt_ids=self.prompt,
            response_ids=self.response,
            response_mask=self.mask,
            response_logprobs=self.logprobs,
            reward=reward,
            num_turns=len(self.traj["turns"]),
            branch=self.branch,
            prompt_truncated=self.prompt_truncated,
            response_truncated=self.response_truncated,
            turns=list(self.traj["turns"]),
            response_versions=[
                v if m else -1 for v, m in zip(self.versions, self.mask, strict=True)
            ],
            images=self.images,
            routed_experts=self.routed_experts,
            agent_id=source.agent_id,
            agent_kind=source.agent_kind,
            segment=source.segment,
            teacher_logprobs=self.teacher,
            teacher_model=self.traj.get("teacher_model") if self.teacher is not None else None,
        )


def _draft(
    source: Kept,
    max_prompt_tokens: int | None,
    max_response_tokens: int | None,
    overlong_prompt: OverlongPrompt,
) -> _Draft | None:
    """The trajectory within the length limits; None when its prompt drops it."""
    traj = source.traj
    prompt = list(traj["prompt_ids"])
    response = list(traj["response_ids"])
    mask = list(traj["response_mask"])
    logprobs = list(traj["response_logprobs"])
    teacher = list(traj["teacher_logprobs"]) if "teacher_logprobs" in traj else None
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
        teacher = teacher[:keep] if teacher is not None else None
        versions = versions[:keep]
    images = [i for i in images if i.end <= len(prompt) + len(response)]
    rows = None
    if routing is not None:
        # The rows of this sample's ids (shifted with a cut prompt), none for its last id.
        rows = routing.rows[cut : cut + max(len(prompt) + len(response) - 1, 0)]
    return _Draft(
        source,
        prompt,
        response,
        mask,
        logprobs,
        versions,
        prompt_truncated,
        response_truncated,
        images,
        rows,
        teacher,
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


def _received(trajectories: list[dict[str, Any]], keep_undelivered: bool, keep: Keep) -> list[Kept]:
    """The trajectories cut to what the agent received and to what their routing can
    replay, then to their kept turns (``sdk.segments.keep_turns``): each ends before its
    first turn that was not delivered or was superseded by a retry (unless a later turn
    continues it; not checked with ``keep_undelivered``), or that samples after a missing
    routing row, and after its last kept turn; one left empty, or equal to the start of
    another, is dropped. Each keeps its index in the export (its routing decoded). Exports
    without the fields count as delivered."""
    turns = [turn for traj in trajectories for turn in traj["turns"]]
    continued = {t["parent"] for t in turns if t.get("parent") is not None}
    superseded = {t["retry_of"] for t in turns if t.get("retry_of") is not None}

    def received(turn: dict[str, Any]) -> bool:
        index = turn["turn"]
        return index in continued or (bool(turn.get("delivered", True)) and index not in superseded)

    cut: list[Kept] = []
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
        kept = keep_turns(index, traj, n, keep)
        if kept is not None:
            cut.append(kept)
    return distinct(cut)
