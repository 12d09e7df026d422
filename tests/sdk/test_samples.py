"""Building training samples from a session export."""

from __future__ import annotations

from typing import Any

import pytest

from sdk.samples import BranchPolicy, build_samples, scalar_reward


def _traj(
    prompt: list[int], response: list[int], mask: list[int], turns: list[int]
) -> dict[str, Any]:
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": [-0.1 if m else 0.0 for m in mask],
        "turns": [{"turn": t} for t in turns],
    }


EXPORT = {
    "trial_id": "t1",
    "reward": {"tests": 1.0, "style": 0.5},
    "trajectories": [
        _traj([1, 2], [3, 4, 5], [1, 0, 1], [0, 1]),
        _traj([9], [8, 7, 6, 5, 4], [1, 1, 1, 0, 1], [2, 3]),
        _traj([1, 2], [3, 4, 6], [1, 0, 1], [0, 4]),
    ],
}


def test_all_policy_gives_one_sample_per_trajectory() -> None:
    """Every branch becomes a sample carrying the summed reward."""
    samples = build_samples(EXPORT)
    assert [s.branch for s in samples] == [0, 1, 2]
    assert all(s.reward == 1.5 for s in samples)
    assert samples[1].num_turns == 2
    assert samples[1].sampled_tokens == 4


def test_longest_and_last_policies() -> None:
    """LONGEST keeps the most sampled tokens; LAST keeps the branch with the newest turn."""
    assert [s.branch for s in build_samples(EXPORT, policy=BranchPolicy.LONGEST)] == [1]
    assert [s.branch for s in build_samples(EXPORT, policy=BranchPolicy.LAST)] == [2]


def test_reward_key_selects_a_component() -> None:
    """A named reward component can be chosen instead of the sum."""
    assert build_samples(EXPORT, reward_key="style")[0].reward == 0.5
    assert scalar_reward(None) is None
    assert scalar_reward(2) == 2.0


def test_truncation_is_explicit() -> None:
    """Length limits cut the sample and flag it; untouched samples are not flagged."""
    (long,) = build_samples(
        EXPORT, policy=BranchPolicy.LONGEST, max_response_tokens=2, max_prompt_tokens=0
    )
    assert long.response_ids == [8, 7]
    assert long.response_mask == [1, 1]
    assert len(long.response_logprobs) == 2
    assert long.response_truncated
    assert long.prompt_truncated
    assert long.prompt_ids == []
    (short,) = build_samples(EXPORT, policy=BranchPolicy.LAST, max_response_tokens=10)
    assert not short.response_truncated
    assert not short.prompt_truncated


def test_empty_export_gives_no_samples() -> None:
    """A session without turns yields nothing."""
    assert build_samples({"trial_id": "x", "reward": 1.0, "trajectories": []}) == []


def test_missing_reward_component_raises() -> None:
    """Asking for a component that does not exist is an error, not a silent zero."""
    with pytest.raises(KeyError):
        build_samples(EXPORT, reward_key="nope")
