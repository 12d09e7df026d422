"""The ``verl`` backend: serve the proxy from inside a verl training job.

It wraps verl's rollout client (``verl.workers.rollout.llm_server.LLMServerClient``, or
anything with the same ``generate(request_id, *, prompt_ids, sampling_params) ->
TokenOutput``), which is token-in/token-out already: verl's own vLLM/SGLang replicas
sample, with the weights the trainer has just synced. Mapping (checked against verl 0.9.1):

* sampling: ``temperature``, ``top_p``, ``top_k`` (``-1`` = off, verl's convention),
  ``max_tokens``, ``logprobs: True`` (verl's servers then return ``log_probs``), ``seed``
  and ``stop_token_ids`` when set;
* ``TokenOutput.stop_reason``: ``"aborted"`` → ``ABORT``; ``"completed"`` covers both a
  stop and the length limit, so ``LENGTH`` is derived: ``max_tokens`` ids of which the
  last is no stop token;
* the policy version is verl's ``extra_fields["global_steps"]`` (set by the trainer on each
  weight sync), recorded per turn as ``extra["policy_version"]``.

verl answers a request in one piece, so a turn arrives as one chunk (no token streaming).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any, Protocol

from worker_client.engine import (
    FinishReason,
    ImageSpan,
    LogprobsMode,
    ModelCard,
    SamplingParams,
    TokenChunk,
    check_prompt,
    id_list,
    refuse_images,
    refuse_routing,
)
from worker_client.exceptions import EngineError
from worker_client.policy import POLICY_VERSION

BACKEND = "verl"


class RolloutClient(Protocol):
    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> Any: ...


def verl_sampling(sampling: SamplingParams) -> dict[str, Any]:
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_tokens,
        "logprobs": True,
    }
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params


def chunk_from_token_output(
    output: Any, sampling: SamplingParams, eos_token_ids: frozenset[int]
) -> TokenChunk:
    """verl's ``TokenOutput`` as the final ``TokenChunk`` of a request."""
    token_ids = [int(t) for t in output.token_ids]
    logprobs = output.log_probs
    if token_ids and (logprobs is None or len(logprobs) != len(token_ids)):
        raise EngineError("verl returned token ids without one logprob each (logprobs off?)")
    extra: dict[str, str | int | float] = {}
    steps = (output.extra_fields or {}).get("global_steps")
    if isinstance(steps, int | float):
        extra[POLICY_VERSION] = int(steps)
    reason = output.stop_reason
    if reason == "aborted":
        finish = FinishReason.ABORT
    elif reason in (None, "completed"):
        stops = eos_token_ids | set(sampling.stop_token_ids)
        hit_limit = len(token_ids) >= sampling.max_tokens
        finish = (
            FinishReason.LENGTH
            if hit_limit and not (token_ids and token_ids[-1] in stops)
            else FinishReason.STOP
        )
    else:
        raise EngineError(f"verl ended the request with stop reason {reason!r}")
    return TokenChunk(token_ids, [float(x) for x in logprobs or []], finish, extra)


class VerlEngine:
    def __init__(
        self,
        client: RolloutClient,
        *,
        name: str,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        logprobs_mode: LogprobsMode = LogprobsMode.RAW,
    ) -> None:
        self.client = client
        self._card = ModelCard(name, max_model_len, logprobs_mode, BACKEND)
        self.eos_token_ids = frozenset(eos_token_ids)

    def __repr__(self) -> str:
        return f"<VerlEngine {self._card.name}>"

    @property
    def card(self) -> ModelCard:
        return self._card

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        refuse_routing(self._card, routed_experts_from)
        refuse_images(self._card, images)
        check_prompt(self._card, prompt_ids)
        try:
            output = await self.client.generate(
                request_id, prompt_ids=id_list(prompt_ids), sampling_params=verl_sampling(sampling)
            )
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(
                f"verl failed request {request_id}: {type(exc).__name__}: {exc}"
            ) from exc
        yield chunk_from_token_output(output, sampling, self.eos_token_ids)

    async def abort(self, request_id: str) -> None:
        # verl aborts through its replicas' pause (pause_generation); a single request
        # cannot be recalled, its reply is dropped by the proxy.
        return None

    async def close(self) -> None:
        return None
