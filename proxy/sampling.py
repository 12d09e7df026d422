"""Sampling belongs to the trainer, not the agent.

The session's sampling settings (given when the trainer registered the trial) override
what the agent asks for; ``max_tokens`` is a cap at every level (agent, session, the
proxy's global ``--max-tokens``, the room left in the context window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.exceptions import BadRequestError, ContextLengthError
from relay import protocol

SESSION_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "seed"}


@dataclass(slots=True, frozen=True)
class AgentSampling:
    """What the agent asked for (None: not given)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


def validate_session_sampling(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequestError("sampling must be an object", code="invalid_sampling")
    unknown = set(raw) - SESSION_SAMPLING_KEYS
    if unknown:
        raise BadRequestError(
            f"unknown sampling keys: {sorted(unknown)}; allowed: {sorted(SESSION_SAMPLING_KEYS)}",
            code="invalid_sampling",
        )
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            continue
        integral = key in {"top_k", "max_tokens", "seed"}
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequestError(f"sampling.{key} must be a number", code="invalid_sampling")
        if integral and not float(value).is_integer():
            raise BadRequestError(f"sampling.{key} must be an integer", code="invalid_sampling")
        out[key] = int(value) if integral else float(value)
    if out.get("max_tokens", 1) < 1:
        raise BadRequestError("sampling.max_tokens must be >= 1", code="invalid_sampling")
    if not 0.0 < out.get("top_p", 1.0) <= 1.0:
        raise BadRequestError("sampling.top_p must be in (0, 1]", code="invalid_sampling")
    if out.get("temperature", 1.0) < 0.0:
        raise BadRequestError("sampling.temperature must be >= 0", code="invalid_sampling")
    return out


def resolve_sampling(
    agent: AgentSampling,
    session: dict[str, Any],
    *,
    global_max_tokens: int,
    prompt_len: int,
    max_model_len: int,
    stop_token_ids: tuple[int, ...],
) -> protocol.Sampling:
    room = max_model_len - prompt_len
    if room <= 0:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens; the model's context window is {max_model_len}"
        )
    caps = [global_max_tokens, room]
    if "max_tokens" in session:
        caps.append(int(session["max_tokens"]))
    if agent.max_tokens is not None:
        caps.append(agent.max_tokens)

    def pick(key: str, asked: float | None, default: float) -> float:
        if key in session:
            return float(session[key])
        return default if asked is None else asked

    seed = session.get("seed", agent.seed)
    return protocol.Sampling(
        max_tokens=max(1, min(caps)),
        temperature=pick("temperature", agent.temperature, 1.0),
        top_p=pick("top_p", agent.top_p, 1.0),
        top_k=int(pick("top_k", agent.top_k, 0)),
        seed=None if seed is None else int(seed),
        stop_token_ids=list(stop_token_ids),
    )


def sampling_record(sampling: protocol.Sampling) -> dict[str, Any]:
    return {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": sampling.seed,
    }
