"""Samples that know their agent, and what an episode's outcome does to them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from sdk.samples import (
    TRAINED_KINDS,
    BranchPolicy,
    build_samples,
    main_sample,
    segments,
    untrained_segments,
)


def _traj(turn: int, agent: str, kind: str, sampled: int) -> dict[str, Any]:
    return {
        "agent_id": agent,
        "agent_kind": kind,
        "prompt_ids": [1, 2],
        "response_ids": [5] * sampled,
        "response_mask": [1] * sampled,
        "response_logprobs": [-0.5] * sampled,
        "turns": [
            {
                "turn": turn,
                "parent": None,
                "response_start": 0,
                "response_end": sampled,
                "delivered": True,
                "agent": {"id": agent, "parent": None, "kind": kind},
            }
        ],
    }


def _export(**fields: Any) -> dict[str, Any]:
    return {
        "trial_id": "t",
        "status": "completed",
        "outcome": "completed",
        "reward": 1.0,
        "agent_rewards": {},
        "trajectories": [
            _traj(0, "a1", "subagent", 2),
            _traj(1, "main", "main", 3),
            _traj(2, "main", "auxiliary", 1),
            _traj(3, "a1", "subagent", 4),
        ],
        **fields,
    }


def test_every_agent_is_kept_by_default_and_each_sample_says_whose() -> None:
    samples = build_samples(_export())
    assert [(s.agent_id, s.agent_kind) for s in samples] == [
        ("a1", "subagent"),
        ("main", "main"),
        ("main", "auxiliary"),
        ("a1", "subagent"),
    ]
    assert {s.outcome for s in samples} == {"completed"}
    assert main_sample(samples).agent_id == "main"


def test_the_main_agent_only_or_given_kinds() -> None:
    """``agents="main"`` keeps the main agent's (its side requests too); ``kinds`` keeps
    the kinds given: ``TRAINED_KINDS`` leaves out the auxiliary requests."""
    assert [s.agent_kind for s in build_samples(_export(), agents="main")] == [
        "main",
        "auxiliary",
    ]
    kept = build_samples(_export(), kinds=TRAINED_KINDS)
    assert [s.agent_kind for s in kept] == ["subagent", "main", "subagent"]
    with pytest.raises(ValueError, match="unknown agent kinds"):
        build_samples(_export(), kinds={"boss"})


def test_the_branch_policy_applies_per_agent() -> None:
    """``longest`` keeps each agent's longest trajectory (of each segment: here every
    agent has one root), not one for the whole trial."""
    export = _episode(
        _path([(0, None, "main"), (1, 0, "main")]),
        _path([(0, None, "main"), (2, 0, "main"), (6, 2, "main")]),
        _path([(3, None, "subagent"), (4, 3, "subagent"), (5, 4, "subagent")], agent="a1"),
        _path([(3, None, "subagent"), (7, 3, "subagent")], agent="a1"),
    )
    samples = build_samples(export, policy=BranchPolicy.LONGEST)
    assert [(s.agent_id, _turns(s)) for s in samples] == [("main", [0, 2, 6]), ("a1", [3, 4, 5])]


def test_an_agents_own_reward_wins_over_the_trials() -> None:
    samples = build_samples(_export(agent_rewards={"a1": 0.25}))
    assert [s.reward for s in samples] == [0.25, 1.0, 1.0, 0.25]


def test_an_infra_error_is_dropped_or_masked_never_a_zero() -> None:
    """An infra failure is not the policy's: no sample by default; with ``mask`` its
    samples train nothing and carry no reward."""
    export = _export(outcome="infra_error", reward=None)
    assert build_samples(export) == []
    masked = build_samples(export, infra_error="mask")
    assert len(masked) == 4
    assert all(s.reward is None and s.sampled_tokens == 0 for s in masked)


def test_a_missing_reward_stays_missing_unless_the_trainer_sets_a_failure_reward() -> None:
    """A timeout without a reward is None, not 0; ``failure_reward`` gives the policy's
    failures (agent_error, timeout, budget_exhausted) a reward, never a completed one's."""
    timeout = _export(outcome="timeout", reward=None)
    assert {s.reward for s in build_samples(timeout)} == {None}
    assert {s.reward for s in build_samples(timeout, failure_reward=0.0)} == {0.0}
    unrewarded = _export(reward=None)
    assert {s.reward for s in build_samples(unrewarded, failure_reward=0.0)} == {None}


def test_an_export_from_before_agents_is_the_main_agents() -> None:
    export = _export()
    for traj in export["trajectories"]:
        del traj["agent_id"], traj["agent_kind"]
        for turn in traj["turns"]:
            del turn["agent"]
    del export["outcome"]
    samples = build_samples(export, policy=BranchPolicy.LONGEST)
    # Every trajectory is a root of its own: a segment of the main agent's episode each.
    assert [(s.agent_id, s.agent_kind, s.outcome) for s in samples] == [("main", "main", None)] * 4
    assert segments(samples) == [0, 1, 2, 3]


# Episodes built turn by turn: per turn (index, parent, kind), each sampling 2 tokens that
# name it (100 * (index + 1) + j) after 1 context token (none before a root's).
Step = tuple[int, int | None, str]


def _path(steps: list[Step], agent: str = "main") -> dict[str, Any]:
    response: list[int] = []
    mask: list[int] = []
    turns: list[dict[str, Any]] = []
    for position, (index, parent, kind) in enumerate(steps):
        if position:
            response.append(7)
            mask.append(0)
        start = len(response)
        response.extend([100 * (index + 1), 100 * (index + 1) + 1])
        mask.extend([1, 1])
        turns.append(
            {
                "turn": index,
                "parent": parent,
                "response_start": start,
                "response_end": len(response),
                "delivered": True,
                "retry_of": None,
                "agent": {"id": agent, "parent": None if agent == "main" else "main", "kind": kind},
                "spawned_by": None,
            }
        )
    return {
        "agent_id": agent,
        "agent_kind": steps[-1][2],  # as proxies before per-turn kinds said: the leaf's
        "prompt_ids": [1, 2],
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": [-0.5 if m else 0.0 for m in mask],
        "turns": turns,
    }


def _episode(*paths: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "trial_id": "t",
        "status": "completed",
        "outcome": "completed",
        "reward": 1.0,
        "agent_rewards": {},
        "trajectories": list(paths),
        **fields,
    }


def _trained(samples: list[Any]) -> Counter[int]:
    """How many times each turn's sampled tokens are trained over ``samples``."""
    counts: Counter[int] = Counter()
    for sample in samples:
        for token, bit in zip(sample.response_ids, sample.response_mask, strict=True):
            if bit and token >= 100:
                counts[token // 100 - 1] += 1
    return counts


def _turns(sample: Any) -> list[int]:
    return [t["turn"] for t in sample.turns]


MAIN_ONLY = frozenset({"main", "subagent"})


@pytest.mark.parametrize("policy", list(BranchPolicy))
def test_main_turns_stay_trained_before_a_continuing_side_request(policy: BranchPolicy) -> None:
    """An auxiliary request that continues the main chain (agent main, a child of its last
    turn) is cut when ``kinds`` leaves it out: the main turns still train."""
    export = _episode(_path([(0, None, "main"), (1, 0, "main"), (2, 1, "auxiliary")]))
    (sample,) = build_samples(export, policy=policy, kinds=TRAINED_KINDS)
    assert _turns(sample) == [0, 1]
    assert (sample.agent_id, sample.agent_kind, sample.segment) == ("main", "main", 0)
    assert _trained([sample]) == {0: 2, 1: 2}
    assert 300 not in sample.response_ids  # the side request's reply is cut, not masked
    (whole,) = build_samples(export, policy=policy)
    assert _trained([whole]) == {0: 2, 1: 2, 2: 2}
    assert whole.agent_kind == "main"


def _titled() -> dict[str, Any]:
    """A title request first (agent main, auxiliary, a root), the main chain 1 -> 2, and a
    summary asked on the side last (another auxiliary root)."""
    return _episode(
        _path([(0, None, "auxiliary")]),
        _path([(1, None, "main"), (2, 1, "main")]),
        _path([(3, None, "auxiliary")]),
    )


@pytest.mark.parametrize("policy", [BranchPolicy.LAST, BranchPolicy.ALL, BranchPolicy.LONGEST])
def test_a_title_request_never_stands_for_the_main_agent(policy: BranchPolicy) -> None:
    """A title sent as a root of its own never stands for the main agent: main_sample is
    the main chain, and TRAINED_KINDS leaves the title out."""
    samples = build_samples(_titled(), policy=policy)
    main = main_sample(samples)
    assert _turns(main) == [1, 2]
    assert (main.agent_kind, main.segment) == ("main", 1)
    assert _trained(samples)[1] == _trained(samples)[2] == 2
    # The title's root is no piece of the episode that a one-sample trainer leaves out.
    assert segments(samples) == [1]
    assert untrained_segments(samples, main) == 0
    kept = build_samples(_titled(), policy=policy, kinds=TRAINED_KINDS)
    assert [_turns(s) for s in kept] == [[1, 2]]
    assert main_sample(kept) is kept[0]


def _compacted() -> dict[str, Any]:
    """/compact: the main chain 0 -> 1 -> 2, a compaction request forked off turn 2, and the
    main agent restarting from the summary as a new root 4 -> 5."""
    return _episode(
        _path([(0, None, "main"), (1, 0, "main"), (2, 1, "main"), (3, 2, "compaction")]),
        _path([(4, None, "main"), (5, 4, "main")]),
        reward=0.7,
    )


@pytest.mark.parametrize("policy", [BranchPolicy.LAST, BranchPolicy.LONGEST])
def test_every_segment_of_a_compacted_episode_trains_once(policy: BranchPolicy) -> None:
    """After /compact the main agent starts a new root: each segment trains once, every
    main turn in one sample, the compaction request only where kinds keep it."""
    samples = build_samples(_compacted(), policy=policy, kinds=MAIN_ONLY)
    assert [(s.agent_id, s.agent_kind, s.segment) for s in samples] == [
        ("main", "main", 0),
        ("main", "main", 4),
    ]
    assert [_turns(s) for s in samples] == [[0, 1, 2], [4, 5]]
    assert _trained(samples) == {0: 2, 1: 2, 2: 2, 4: 2, 5: 2}  # the compaction: cut
    assert main_sample(samples).segment == 4
    assert segments(samples) == [0, 4]
    # What a trainer of one completion per episode (TRL, verl) leaves out.
    assert untrained_segments(samples, main_sample(samples)) == 1
    # Kept, the compaction request trains in its segment, which stays the main agent's.
    whole = build_samples(_compacted(), policy=policy)
    assert [(s.agent_kind, s.segment) for s in whole] == [("main", 0), ("main", 4)]
    assert _trained(whole) == {0: 2, 1: 2, 2: 2, 3: 2, 4: 2, 5: 2}
    assert main_sample(whole).segment == 4


@pytest.mark.parametrize("policy", [BranchPolicy.LAST, BranchPolicy.LONGEST])
def test_a_compaction_branch_is_never_chosen_over_the_main_chain(policy: BranchPolicy) -> None:
    """The compaction request forked off turn 1 is newer and longer than the main turn
    after it, and still the branch policy keeps the main chain."""
    compaction = _path([(0, None, "main"), (1, 0, "main"), (3, 1, "compaction")])
    compaction["response_ids"] += [9] * 6
    compaction["response_mask"] += [1] * 6
    compaction["response_logprobs"] += [-0.5] * 6
    compaction["turns"][-1]["response_end"] += 6
    export = _episode(_path([(0, None, "main"), (1, 0, "main"), (2, 1, "main")]), compaction)
    (sample,) = build_samples(export, policy=policy)
    assert _turns(sample) == [0, 1, 2]
    assert main_sample(build_samples(export)).branch == 0


def test_a_compaction_turn_inside_a_path_is_context_when_left_out() -> None:
    """A turn of a kind left out that a kept turn follows stays as context (mask 0)."""
    export = _episode(_path([(0, None, "main"), (1, 0, "compaction"), (2, 1, "main")]))
    (sample,) = build_samples(export, kinds={"main"})
    assert _turns(sample) == [0, 1, 2]
    assert 200 in sample.response_ids
    assert _trained([sample]) == {0: 2, 2: 2}
    assert sample.agent_kind == "main"
    (whole,) = build_samples(export)
    assert _trained([whole]) == {0: 2, 1: 2, 2: 2}


def test_a_path_with_no_kept_turn_makes_no_sample() -> None:
    """A path whose turns are all of kinds left out makes no sample."""
    export = _episode(_path([(0, None, "compaction"), (1, 0, "auxiliary")]))
    assert build_samples(export, kinds=TRAINED_KINDS - {"compaction"}) == []
    (sample,) = build_samples(export, kinds=TRAINED_KINDS)
    assert (_turns(sample), sample.agent_kind) == ([0], "compaction")


def test_every_segment_gets_the_episodes_reward() -> None:
    """Every segment carries the episode's reward (an agent's own where the trainer gave
    one)."""
    for policy in BranchPolicy:
        assert {s.reward for s in build_samples(_compacted(), policy=policy)} == {0.7}
    export = dict(_compacted(), agent_rewards={"main": 0.25})
    rewarded = build_samples(export, policy=BranchPolicy.LAST)
    assert [s.reward for s in rewarded] == [0.25, 0.25]


def test_a_sub_agents_rewritten_chain_is_a_segment_of_it() -> None:
    """A sub-agent that starts over (a new root with its id) has two segments; within each
    the branch policy keeps one branch."""
    export = _episode(
        _path([(0, None, "main"), (4, 0, "main")]),
        _path([(1, None, "subagent"), (2, 1, "subagent")], agent="a1"),
        _path([(1, None, "subagent"), (3, 1, "subagent")], agent="a1"),
        _path([(5, None, "subagent")], agent="a1"),
    )
    samples = build_samples(export, policy=BranchPolicy.LAST)
    assert [(s.agent_id, s.segment, _turns(s)) for s in samples] == [
        ("main", 0, [0, 4]),
        ("a1", 1, [1, 3]),
        ("a1", 5, [5]),
    ]
    assert segments(samples, "a1") == [1, 5]
    assert main_sample(samples).agent_id == "main"
