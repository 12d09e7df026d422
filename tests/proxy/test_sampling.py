"""Sampling resolution: the trainer's settings win, max_tokens is a cap everywhere."""

from __future__ import annotations

import pytest

from proxy.exceptions import BadRequestError, ContextLengthError
from proxy.sampling import AgentSampling, resolve_sampling, validate_session_sampling


def test_session_overrides_agent() -> None:
    """Temperature/top_p/top_k/seed from the session beat the agent's."""
    s = resolve_sampling(
        AgentSampling(temperature=0.1, top_p=0.5, top_k=5, seed=1),
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 9},
        global_max_tokens=100,
        prompt_len=1,
        max_model_len=1000,
        stop_token_ids=(2,),
    )
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 1.0, 0, 9)
    assert s.stop_token_ids == [2]


def test_agent_values_used_when_session_silent() -> None:
    """Without session settings the agent's values apply; defaults are 1.0/1.0/off."""
    s = resolve_sampling(
        AgentSampling(temperature=0.3),
        {},
        global_max_tokens=100,
        prompt_len=1,
        max_model_len=1000,
        stop_token_ids=(),
    )
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.3, 1.0, 0, None)


@pytest.mark.parametrize(
    ("agent_max", "session_max", "global_max", "room", "expected"),
    [
        (32000, None, 4096, 10000, 4096),  # agents ask for 32k: the global cap wins
        (50, None, 4096, 10000, 50),
        (None, 64, 4096, 10000, 64),
        (5000, 8000, 9000, 300, 300),  # the context window leaves 300 tokens
    ],
)
def test_max_tokens_is_the_smallest_cap(
    agent_max: int | None, session_max: int | None, global_max: int, room: int, expected: int
) -> None:
    """max_tokens is min(agent, session, global, room left in the window)."""
    session = {} if session_max is None else {"max_tokens": session_max}
    s = resolve_sampling(
        AgentSampling(max_tokens=agent_max),
        session,
        global_max_tokens=global_max,
        prompt_len=1000,
        max_model_len=1000 + room,
        stop_token_ids=(),
    )
    assert s.max_tokens == expected


def test_full_context_is_an_error() -> None:
    """A prompt that fills the window is rejected before reaching a worker."""
    with pytest.raises(ContextLengthError):
        resolve_sampling(
            AgentSampling(),
            {},
            global_max_tokens=10,
            prompt_len=100,
            max_model_len=100,
            stop_token_ids=(),
        )


@pytest.mark.parametrize(
    "raw",
    [
        "hot",
        {"temperature": "1"},
        {"colour": 1},
        {"max_tokens": 0},
        {"top_p": 1.5},
        {"temperature": -1},
        {"top_k": 1.5},
        {"seed": True},
    ],
)
def test_invalid_session_sampling_is_rejected(raw: object) -> None:
    """Bad sampling settings at registration are a 400, never stored."""
    with pytest.raises(BadRequestError):
        validate_session_sampling(raw)


def test_valid_session_sampling_is_normalised() -> None:
    """Integers stay integers and None values are dropped."""
    assert validate_session_sampling({"temperature": 1, "max_tokens": 64.0, "seed": None}) == {
        "temperature": 1.0,
        "max_tokens": 64,
    }
