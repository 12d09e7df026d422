"""Teacher forcing through the worker pool: one ``Score`` request, its logprobs back.

A score request travels as any request does (``relay.pool``: the fair queue, a worker's
slot, its images sent first, re-dispatched when its worker is lost, cancelled when its
caller goes away); only workers that speak protocol 6 take it. Its ``Done`` carries the
scored ids with their logprobs, which are checked against the ids asked for: a worker
that scored other ids is an error, never a silent misalignment.
"""

from __future__ import annotations

from collections.abc import Sequence

from relay import protocol
from relay.exceptions import WorkerFailedError
from relay.images import PromptImage
from relay.pool import RestartedEvent, TokensEvent, WorkerPool


async def score(
    pool: WorkerPool,
    model: str,
    ids: Sequence[int],
    start: int,
    *,
    images: Sequence[PromptImage] = (),
    affinity: str | None = None,
) -> list[float]:
    """The logprob of each of ``ids[start:]`` given the ids before it (and ``images`` at
    their spans) under ``model``. Raises what ``WorkerPool.start`` raises when no worker
    takes it, and ``WorkerFailedError`` when the worker fails it."""
    if not 0 < start < len(ids):
        # Checked here: a frame the endpoint refuses would end the worker's connection.
        raise ValueError(f"scoring from {start} of {len(ids)} ids: the first id has no logprob")
    expected = list(ids[start:])
    call = await pool.start(
        model,
        ids,
        protocol.Sampling(max_tokens=len(expected)),
        affinity=affinity,
        images=images,
        score_from=start,
    )
    scored: list[int] = []
    logprobs: list[float] = []
    try:
        # The events end with the call's FinishedEvent, or raise its error.
        async for event in call.events(wake_after=None):
            if isinstance(event, TokensEvent):
                scored.extend(event.token_ids)
                logprobs.extend(event.logprobs)
            elif isinstance(event, RestartedEvent):  # its worker was lost: scored anew
                scored.clear()
                logprobs.clear()
    finally:
        await call.cancel()  # nothing once it finished; frees the worker's slot otherwise
    if scored != expected or len(logprobs) != len(expected):
        raise WorkerFailedError(
            "bad_scores",
            f"model {model} scored {len(scored)} ids ({len(logprobs)} logprobs), "
            f"not the {len(expected)} asked",
        )
    return logprobs
