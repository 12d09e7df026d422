"""Checking recorded trajectories against the policy itself.

A trajectory is faithful when teacher-forcing the model on ``prompt_ids + response_ids``
gives, at every sampled position, the logprob that was recorded while sampling. This is
the check a trainer relies on: if it holds, the PPO ratio at the first step is exactly 1.

A trajectory with images (a vision-language model's) is faithful only with the pixels the
worker saw: it is re-scored with its recorded images at their spans, through a scorer that
takes them, ``score(prompt_ids, response_ids, images)`` (``sdk.images.VisionScorer.score``;
the ``hf`` engine's ``score`` for images in the prompt). Scoring its ids alone would check
another input than the one sampled (the image features missing from the forward, as in a
training batch without ``pixel_values``), so a trajectory with images and no bytes for them
is an error, never a silent text-only check. ``check_samples`` checks built samples, whose
images carry their bytes (``Sample.images``); ``check_fidelity`` takes an export and the
bytes by sha256.

A trajectory with routing (a mixture-of-experts policy's, recorded for rollout routing
replay) is faithful as the trainer replays it: re-scored with its routers forced to the
recorded experts, through a scorer that takes them as ``routed_experts=`` (one row per id
but the last: ``sdk.routing.ReplayScorer``). Scoring it with the model's own routing
checks another thing (whether the trainer's router happens to agree), so a scorer that
does not take them fails, never silently checks that. ``check_fidelity`` replays an
export's rows as they are, zeros in its ``missing`` ranges too (the tokens after them
fail); ``check_samples`` checks what trains (built samples leave those turns out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdk.samples import Sample, SampleImage, export_images, export_routing
from worker_client.engine import ImageSpan

# score(prompt_ids, response_ids) -> logprob of each response id under the model; for a
# trajectory with images, score(prompt_ids, response_ids, images) with the images
# (``ImageSpan``: bytes and span in prompt_ids + response_ids) in order; for one with
# routing, score(..., routed_experts=rows) with its rows [len(ids) - 1, layers, top_k].
Scorer = Callable[..., list[float]]


@dataclass(slots=True, frozen=True)
class FidelityReport:
    trajectories: int
    sampled_tokens: int
    max_abs_error: float
    worst_position: tuple[int, int] | None  # (trajectory, response index)
    images: int = 0  # images the check re-scored with

    def ok(self, tolerance: float = 1e-4) -> bool:
        return self.sampled_tokens > 0 and self.max_abs_error <= tolerance


def _spans(
    images: Sequence[SampleImage], data: Mapping[str, bytes] | None, where: str
) -> list[ImageSpan]:
    spans = []
    for image in images:
        found = image.data if image.data is not None else (data or {}).get(image.sha256)
        if found is None:
            raise ValueError(
                f"{where} holds image {image.sha256[:12]} but not its bytes: it can only be "
                "re-scored with the pixels it was sampled with (pass images= by sha256, or "
                "samples whose images were filled: ProxyClient.fill_images)"
            )
        spans.append(ImageSpan(image.sha256, found, image.start, image.end))
    return spans


def _scored(
    score: Scorer,
    prompt: Sequence[int],
    response: Sequence[int],
    spans: Sequence[ImageSpan],
    routing: np.ndarray[Any, Any] | None = None,
) -> list[float]:
    args: list[Any] = [prompt, response, spans] if spans else [prompt, response]
    kwargs = {} if routing is None else {"routed_experts": routing}
    expected = score(*args, **kwargs)
    if len(expected) != len(response):
        raise ValueError("scorer returned a wrong number of logprobs")
    return expected


def _routing_rows(traj: dict[str, Any]) -> np.ndarray[Any, Any] | None:
    routing = export_routing(traj)
    return None if routing is None else routing.rows


class _Worst:
    def __init__(self) -> None:
        self.error = 0.0
        self.where: tuple[int, int] | None = None
        self.sampled = 0

    def add(
        self, t: int, mask: Sequence[int], recorded: Sequence[float], actual: Sequence[float]
    ) -> None:
        for i, (m, r, a) in enumerate(zip(mask, recorded, actual, strict=True)):
            if not m:
                continue
            self.sampled += 1
            err = abs(r - a)
            if err > self.error or self.where is None:
                self.error, self.where = max(self.error, err), (t, i)


def check_fidelity(
    export: dict[str, Any], score: Scorer, *, images: Mapping[str, bytes] | None = None
) -> FidelityReport:
    """Every trajectory of ``export`` re-scored; ``images``: the bytes of its images by
    sha256 (``ProxyClient.image``), required when it has any."""
    worst = _Worst()
    used = 0
    trajectories = export["trajectories"]
    for t, traj in enumerate(trajectories):
        spans = _spans(export_images(traj), images, f"trajectory {t}")
        used += len(spans)
        expected = _scored(
            score, traj["prompt_ids"], traj["response_ids"], spans, _routing_rows(traj)
        )
        worst.add(t, traj["response_mask"], traj["response_logprobs"], expected)
    return FidelityReport(len(trajectories), worst.sampled, worst.error, worst.where, used)


def check_samples(samples: Sequence[Sample], score: Scorer) -> FidelityReport:
    """Built samples re-scored, each with its images' recorded bytes (positions in the
    report are (sample, response index))."""
    worst = _Worst()
    used = 0
    for t, sample in enumerate(samples):
        spans = _spans(sample.images, None, f"sample {t} (trial {sample.trial_id})")
        used += len(spans)
        expected = _scored(
            score, sample.prompt_ids, sample.response_ids, spans, sample.routed_experts
        )
        worst.add(t, sample.response_mask, sample.response_logprobs, expected)
    return FidelityReport(len(samples), worst.sampled, worst.error, worst.where, used)


def check_fidelity_by_version(
    export: dict[str, Any],
    scorers: Mapping[int, Scorer],
    *,
    images: Mapping[str, bytes] | None = None,
) -> FidelityReport:
    """``check_fidelity`` for trajectories sampled by several policy versions: each sampled
    token is scored by the model of the version that sampled it (``response_versions``);
    ``scorers`` maps a version to its model's scorer."""
    worst = _Worst()
    used = 0
    trajectories = export["trajectories"]
    for t, traj in enumerate(trajectories):
        versions = traj["response_versions"]
        needed = {v for v, m in zip(versions, traj["response_mask"], strict=True) if m}
        missing = needed - scorers.keys()
        if missing:
            raise ValueError(f"no scorer for versions {sorted(missing)}")
        spans = _spans(export_images(traj), images, f"trajectory {t}")
        used += len(spans)
        rows = _routing_rows(traj)
        expected = {
            v: _scored(scorers[v], traj["prompt_ids"], traj["response_ids"], spans, rows)
            for v in needed
        }
        actual = [
            expected[v][i] if m else 0.0
            for i, (v, m) in enumerate(zip(versions, traj["response_mask"], strict=True))
        ]
        worst.add(t, traj["response_mask"], traj["response_logprobs"], actual)
    return FidelityReport(len(trajectories), worst.sampled, worst.error, worst.where, used)
