"""Teacher forcing on vLLM: its prompt logprobs, read for the ids asked.

vLLM scores a prompt when asked for ``SamplingParams(prompt_logprobs=k)``: each prompt
position but the first gets the logprob of its own token (beside the top ``k``). It has no
request that only scores, so one token is generated (``max_tokens=1``) and dropped. What
is read are the prompt token's own entries, never the top ones.

Not run here: the real engine runs only in ``make test-vllm``'s side environment.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from worker_client.exceptions import EngineError


def scoring_params(vllm: Any) -> Any:
    """The ``vllm.SamplingParams`` of a score request: prompt logprobs, one token, the
    final output only (nothing streams)."""
    output_kind = importlib.import_module(f"{vllm.__name__}.sampling_params").RequestOutputKind
    return vllm.SamplingParams(
        n=1,
        max_tokens=1,
        # 1, not 0: the prompt token's own entry comes with any k, and 0 is read as "none"
        # by some releases' checks.
        prompt_logprobs=1,
        detokenize=False,
        output_kind=output_kind.FINAL_ONLY,
    )


def prompt_logprobs_from(output: Any, ids: Sequence[int], start: int) -> list[float]:
    """The logprob of each of ``ids[start:]`` in a ``vllm.RequestOutput`` of ``ids``
    asked with prompt logprobs (``output.prompt_logprobs``: one entry per prompt position,
    None for the first, each mapping token ids to ``Logprob``)."""
    entries = output.prompt_logprobs
    if entries is None or len(entries) != len(ids):
        have = "none" if entries is None else str(len(entries))
        raise EngineError(
            f"vLLM returned {have} prompt logprobs for the {len(ids)} ids of request "
            f"{output.request_id} (was it sent with prompt_logprobs?)"
        )
    out: list[float] = []
    for position in range(start, len(ids)):
        entry = entries[position]
        found = entry.get(ids[position]) if entry else None
        if found is None:
            raise EngineError(
                f"vLLM returned no logprob for id {ids[position]} at position {position} "
                f"of request {output.request_id}"
            )
        out.append(float(found.logprob))
    return out
