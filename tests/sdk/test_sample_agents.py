"""Samples that know their agent, and what an episode's outcome does to them."""

from __future__ import annotations

from typing import Any

import pytest

from sdk.samples import TRAINED_KINDS, BranchPolicy, build_samples, main_sample


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
    """``longest`` keeps each agent's longest trajectory, not one for the whole trial."""
    samples = build_samples(_export(), policy=BranchPolicy.LONGEST)
    assert [(s.agent_id, s.sampled_tokens) for s in samples] == [("main", 3), ("a1", 4)]


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
    del export["outcome"]
    samples = build_samples(export, policy=BranchPolicy.LONGEST)
    assert [(s.agent_id, s.agent_kind, s.outcome) for s in samples] == [("main", "main", None)]
