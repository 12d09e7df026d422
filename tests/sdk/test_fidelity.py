"""The fidelity check compares recorded logprobs with a scorer on sampled positions only."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sdk.fidelity import check_fidelity

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
