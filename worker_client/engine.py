"""The engine interface every backend implements.

An engine is token-in/token-out: it never sees messages or chat templates (the proxy owns
those). It receives prompt token ids and sampling settings and yields the sampled token ids
with their log-probabilities, as they are produced.

Logprob semantics (``LogprobsMode``):

* ``RAW``: ``log_softmax`` of the model's unmodified logits at each position. This is the
  distribution a trainer re-computes when it teacher-forces the policy, so it is the default.
* ``PROCESSED``: ``log_softmax`` after temperature, top-k and top-p were applied, i.e. the
  distribution the token was actually drawn from.

At temperature 1.0 with top-p 1.0 and top-k off, both are identical.

Routing (a mixture-of-experts model whose card has a ``routing`` shape): ``generate`` with
``routed_experts_from=k`` ends with a chunk whose ``routed_experts`` are the experts every
MoE layer chose for positions ``k`` up to the last one run forward, of ``prompt_ids +
generated ids`` (all but the last generated token), or from an earlier start, never a
later one (``relay.protocol``'s "Routing rows"). An aborted request's last chunk carries
the rows it has. Without ``routed_experts_from`` nothing is captured. A card without
``routing`` refuses the question (``refuse_routing``).

Scoring (a teacher's engine): ``PromptScorer.prompt_logprobs`` is teacher forcing, the
logprobs of given ids under the model with no sampling; an engine that cannot score is
not served as a teacher.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from relay.protocol import RoutedExperts, RoutingShape


class FinishReason(enum.StrEnum):
    """Why a generation ended."""

    STOP = "stop"  # a stop token was sampled (it is included in the output)
    LENGTH = "length"  # max_tokens or the model's context window was reached
    ABORT = "abort"  # aborted by the caller


class LogprobsMode(enum.StrEnum):
    RAW = "raw"
    PROCESSED = "processed"


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Sampling settings for one generation.

    ``top_k <= 0`` disables top-k. ``stop_token_ids`` end the generation when sampled;
    the stop token is part of the output (a trainer must learn to emit it).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class TokenChunk:
    """Tokens sampled since the previous chunk. The last chunk carries ``finish_reason``."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    # Backend-specific facts worth recording per turn (e.g. the policy version).
    extra: dict[str, str | int | float] = field(default_factory=dict)
    # The last chunk of a request asked for routing: its rows (see the module docstring).
    routed_experts: RoutedExperts | None = None


@dataclass(slots=True, frozen=True)
class ModelCard:
    """What a worker announces about a model it serves. ``image_token_id``: a
    vision-language model's image placeholder (None: it takes no images). ``routing``: a
    mixture-of-experts model's routing shape, when its engine reports routing (None: a
    dense model, or an engine that cannot). ``engine``: the engine's settings that decide
    what it computes (vLLM: the dtype it serves, ``enforce_eager``, ``max_model_len``, the
    engine arguments given), JSON values. ``routing_unavailable``: why the engine cannot
    report a mixture-of-experts model's routing (None: it can, or the model is dense)."""

    name: str
    max_model_len: int
    logprobs_mode: LogprobsMode
    backend: str
    image_token_id: int | None = None
    routing: RoutingShape | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    routing_unavailable: str | None = None

    @property
    def vision(self) -> bool:
        return self.image_token_id is not None


@dataclass(slots=True, frozen=True)
class ImageSpan:
    """An image in a prompt: its bytes as the agent sent them (PNG, JPEG, WebP, GIF), their
    sha256, and the half-open range ``[start, end)`` of its placeholder tokens in the prompt
    ids, which are expanded: one token per image token the model's forward fills with the
    image's features."""

    sha256: str
    data: bytes
    start: int
    end: int


@runtime_checkable
class Engine(Protocol):
    """A token-in/token-out generation backend."""

    @property
    def card(self) -> ModelCard: ...

    def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Stream the sampled tokens of one request (its ``images`` where their spans say,
        for a model whose card names an image token). Must end with a chunk that has a
        ``finish_reason``, and with ``routed_experts_from`` the routing rows from there
        (for a model whose card has a routing shape). Raises ``EngineError`` subclasses
        on failure."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a queued or running request; its stream ends with ``FinishReason.ABORT``.
        An id the engine is not serving is ignored (ids may be reused later)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class PromptScorer(Protocol):
    """An engine that scores ids by teacher forcing (a teacher: ``--teacher``)."""

    async def prompt_logprobs(
        self,
        request_id: str,
        ids: Sequence[int],
        start: int,
        images: Sequence[ImageSpan] = (),
    ) -> list[float]:
        """The RAW logprob (``log_softmax`` of the unmodified logits, whatever the card's
        ``logprobs_mode``) of each of ``ids[start:]`` given every id before it, with
        ``images`` where their spans say (as ``generate`` places them); ``0 < start <
        len(ids) <= max_model_len``. Raises ``EngineError`` subclasses on failure."""
        ...


def check_scoring(card: ModelCard, ids: Sequence[int], start: int) -> None:
    """Refuse a score request no backend can serve: nothing to score, or more ids than
    the window (a scored sequence needs no room after it)."""
    from worker_client.exceptions import EngineError, PromptTooLongError

    if not 0 < start < len(ids):
        raise EngineError(f"scoring from {start} of {len(ids)} ids: the first id has no logprob")
    if len(ids) > card.max_model_len:
        raise PromptTooLongError(
            f"{len(ids)} ids to score do not fit the {card.max_model_len}-token window"
        )


# The ``logit_bias`` that keeps a token from being sampled: the lowest OpenAI's API, vLLM
# and SGLang take, which leaves it a probability below e^-100 of the best token's.
NEVER_SAMPLED_BIAS = -100.0


def placeholder_ids(config: Any) -> tuple[int, ...]:
    """The tokens a vision-language model's processor reads as media slots (its
    ``image_token_id`` and ``video_token_id``; ``config`` a transformers config or the
    parsed ``config.json``), which every engine keeps from being sampled: a sampled one,
    carried verbatim into the next turn's prompt, would be counted as an image or a video
    there, and the prompt's expansion would no longer be the images it carries. A trained
    model gives them next to no probability; the recorded logprobs are the engine's as
    ever (raw: the model's distribution; processed: the one sampled from, without them)."""
    found = []
    for key in ("image_token_id", "video_token_id"):
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found.append(value)
    return tuple(found)


def id_list(ids: Sequence[int]) -> list[int]:
    """Token ids as a list, for an engine API that takes one. A prompt comes from the
    relay as an int32 array: its ``tolist`` is a few times faster than ``list``."""
    return ids.tolist() if isinstance(ids, array) else list(ids)


def refuse_images(card: ModelCard, images: Sequence[ImageSpan]) -> None:
    """A backend that runs no images fails a request that has some (the proxy sends none
    to a model whose card names no image token)."""
    if images:
        from worker_client.exceptions import EngineError

        raise EngineError(f"model {card.name} ({card.backend} backend) does not take images")


def refuse_routing(card: ModelCard, routed_experts_from: int | None) -> RoutingShape | None:
    """The card's routing shape when a request asks for routing (None when it does not);
    a request that asks it of a model whose card has none fails (the proxy asks only of a
    model announced with a routing shape), and so does a negative start."""
    if routed_experts_from is None:
        return None
    from worker_client.exceptions import EngineError

    if card.routing is None:
        raise EngineError(
            f"model {card.name} ({card.backend} backend) reports no routing: a dense model, "
            "or an engine started without returning routed experts"
        )
    if routed_experts_from < 0:
        raise EngineError(f"routed experts asked from position {routed_experts_from}")
    return card.routing


def check_prompt(card: ModelCard, prompt_ids: Sequence[int]) -> int:
    """Refuse a prompt no backend can serve; return how many tokens fit after it."""
    from worker_client.exceptions import EngineError, PromptTooLongError

    if not prompt_ids:
        raise EngineError("the prompt is empty")
    room = card.max_model_len - len(prompt_ids)
    if room <= 0:
        raise PromptTooLongError(
            f"prompt of {len(prompt_ids)} tokens does not fit the {card.max_model_len}-token window"
        )
    return room
