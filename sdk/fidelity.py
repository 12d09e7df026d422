"""Checking recorded trajectories against the policy itself.

A trajectory is faithful when teacher-forcing the model on ``prompt_ids + response_ids``
gives, at every sampled position, the logprob that was recorded while sampling. This is
the check a trainer relies on: if it holds, the PPO ratio at the first step is exactly 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# score(prompt_ids, response_ids) -> logprob of each response id under the model
Scorer = Callable[[Sequence[int], Sequence[int]], list[float]]


@dataclass(slots=True, frozen=True)
class FidelityReport:
    trajectories: int
    sampled_tokens: int
    max_abs_error: float
    worst_position: tuple[int, int] | None  # (trajectory, response index)

    def ok(self, tolerance: float = 1e-4) -> bool:
        return self.sampled_tokens > 0 and self.max_abs_error <= tolerance


def check_fidelity(export: dict[str, Any], score: Scorer) -> FidelityReport:
    worst = 0.0
    where: tuple[int, int] | None = None
    sampled = 0
    trajectories = export["trajectories"]
    for t, traj in enumerate(trajectories):
        expected = score(traj["prompt_ids"], traj["response_ids"])
        if len(expected) != len(traj["response_ids"]):
            raise ValueError("scorer returned a wrong number of logprobs")
        for i, (m, recorded, actual) in enumerate(
            zip(traj["response_mask"], traj["response_logprobs"], expected, strict=True)
        ):
            if not m:
                continue
            sampled += 1
            err = abs(recorded - actual)
            if err > worst or where is None:
                worst, where = max(worst, err), (t, i)
    return FidelityReport(len(trajectories), sampled, worst, where)


def check_fidelity_by_version(
    export: dict[str, Any], scorers: Mapping[int, Scorer]
) -> FidelityReport:
    """``check_fidelity`` for trajectories sampled by several policy versions: each sampled
    token is scored by the model of the version that sampled it (``response_versions``);
    ``scorers`` maps a version to its model's scorer."""
    worst = 0.0
    where: tuple[int, int] | None = None
    sampled = 0
    trajectories = export["trajectories"]
    for t, traj in enumerate(trajectories):
        versions = traj["response_versions"]
        needed = {v for v, m in zip(versions, traj["response_mask"], strict=True) if m}
        missing = needed - scorers.keys()
        if missing:
            raise ValueError(f"no scorer for versions {sorted(missing)}")
        expected = {v: scorers[v](traj["prompt_ids"], traj["response_ids"]) for v in needed}
        for i, (m, recorded) in enumerate(
            zip(traj["response_mask"], traj["response_logprobs"], strict=True)
        ):
            if not m:
                continue
            sampled += 1
            err = abs(recorded - expected[versions[i]][i])
            if err > worst or where is None:
                worst, where = max(worst, err), (t, i)
    return FidelityReport(len(trajectories), sampled, worst, where)
