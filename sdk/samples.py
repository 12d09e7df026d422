"""Turning a session's export into training samples.

Policies for a session tree with several branches:

* ``all``: one sample per trajectory (root-to-leaf path), each with the trial's reward.
* ``longest``: only the trajectory with the most sampled tokens.
* ``last``: only the trajectory that ends with the most recent turn.

A reward given as a dict of named components is reduced to one number by ``reward_key``
(a component name) or, by default, their sum. Length limits truncate explicitly: a
truncated sample says so in ``prompt_truncated`` / ``response_truncated``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class BranchPolicy(enum.StrEnum):
    ALL = "all"
    LONGEST = "longest"
    LAST = "last"


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

    @property
    def sampled_tokens(self) -> int:
        return sum(self.response_mask)

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
) -> list[Sample]:
    trajectories: list[dict[str, Any]] = export.get("trajectories", [])
    if not trajectories:
        return []
    chosen = list(enumerate(trajectories))
    if policy is BranchPolicy.LONGEST:
        chosen = [max(chosen, key=lambda it: sum(it[1]["response_mask"]))]
    elif policy is BranchPolicy.LAST:
        chosen = [max(chosen, key=lambda it: max(t["turn"] for t in it[1]["turns"]))]
    reward = scalar_reward(export.get("reward"), reward_key)
    samples: list[Sample] = []
    for branch, traj in chosen:
        prompt = list(traj["prompt_ids"])
        response = list(traj["response_ids"])
        mask = list(traj["response_mask"])
        logprobs = list(traj["response_logprobs"])
        prompt_truncated = max_prompt_tokens is not None and len(prompt) > max_prompt_tokens
        if prompt_truncated:
            assert max_prompt_tokens is not None
            # keep the end: it is what the model saw last
            prompt = prompt[len(prompt) - max_prompt_tokens :]
        response_truncated = max_response_tokens is not None and len(response) > max_response_tokens
        if response_truncated:
            assert max_response_tokens is not None
            response = response[:max_response_tokens]
            mask = mask[:max_response_tokens]
            logprobs = logprobs[:max_response_tokens]
        samples.append(
            Sample(
                trial_id=str(export.get("trial_id", "")),
                prompt_ids=prompt,
                response_ids=response,
                response_mask=mask,
                response_logprobs=logprobs,
                reward=reward,
                num_turns=len(traj["turns"]),
                branch=branch,
                prompt_truncated=prompt_truncated,
                response_truncated=response_truncated,
                turns=list(traj["turns"]),
            )
        )
    return samples
