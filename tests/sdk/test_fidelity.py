"""The fidelity check compares recorded logprobs with a scorer on sampled positions only."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sdk.fidelity import check_fidelity, check_fidelity_by_version

EXPORT = {
    "trajectories": [
        {
            "prompt_ids": [1],
            "response_ids": [5, 6, 7],
            "response_mask": [1, 0, 1],
            "response_logprobs": [-0.5, 0.0, -0.25],
        }
    ]
}


def _scorer(values: list[float]) -> object:
    def score(prompt: Sequence[int], response: Sequence[int]) -> list[float]:
        return list(values)

    return score


def test_matching_logprobs_pass() -> None:
    """Equal logprobs on sampled tokens pass; context positions are ignored."""
    report = check_fidelity(EXPORT, _scorer([-0.5, -9.0, -0.25]))  # type: ignore[arg-type]
    assert report.ok()
    assert report.sampled_tokens == 2


def test_drift_is_reported_with_position() -> None:
    """A mismatch on a sampled token fails and names where."""
    report = check_fidelity(EXPORT, _scorer([-0.5, 0.0, -0.3]))  # type: ignore[arg-type]
    assert not report.ok()
    assert report.worst_position == (0, 2)
    assert report.max_abs_error == pytest.approx(0.05)


def test_nothing_sampled_is_not_ok() -> None:
    """An export without sampled tokens cannot pass a fidelity check."""
    report = check_fidelity({"trajectories": []}, _scorer([]))  # type: ignore[arg-type]
    assert not report.ok()


def test_wrong_length_scorer_raises() -> None:
    """A scorer returning the wrong number of values is an error."""
    with pytest.raises(ValueError, match="wrong number"):
        check_fidelity(EXPORT, _scorer([-0.5]))  # type: ignore[arg-type]


VERSIONED = {
    "trajectories": [
        {
            "prompt_ids": [1],
            "response_ids": [5, 6, 7, 8],
            "response_mask": [1, 0, 1, 1],
            "response_logprobs": [-0.5, 0.0, -0.25, -0.125],
            "response_versions": [1, -1, 2, 2],
        }
    ]
}


def test_each_token_is_scored_by_the_model_of_its_version() -> None:
    """Version 1's scorer checks the first token, version 2's the others: the right
    pairing passes, swapped scorers fail where the two models differ most."""
    v1 = _scorer([-0.5, -9.0, -3.0, -3.0])
    v2 = _scorer([-3.0, -9.0, -0.25, -0.125])
    report = check_fidelity_by_version(VERSIONED, {1: v1, 2: v2})  # type: ignore[dict-item]
    assert report.ok()
    assert report.sampled_tokens == 3
    assert report.max_abs_error == 0.0
    swapped = check_fidelity_by_version(VERSIONED, {1: v2, 2: v1})  # type: ignore[dict-item]
    assert not swapped.ok()
    assert swapped.worst_position == (0, 3)
    assert swapped.max_abs_error == pytest.approx(2.875)


def test_a_version_without_a_scorer_raises() -> None:
    """A sampled token whose version has no scorer is an error naming the version; a
    version seen only on context positions needs none."""
    with pytest.raises(ValueError, match=r"no scorer for versions \[2\]"):
        check_fidelity_by_version(VERSIONED, {1: _scorer([-0.5] * 4)})  # type: ignore[dict-item]
    context_only = {
        "trajectories": [dict(VERSIONED["trajectories"][0], response_mask=[1, 0, 0, 0])]
    }
    report = check_fidelity_by_version(context_only, {1: _scorer([-0.5] * 4)})  # type: ignore[dict-item]
    assert report.ok()
