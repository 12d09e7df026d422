"""Several choices of one request: seeds per choice and interleaved streaming."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from proxy.api.openai.choices import _interleave, choice_requests
from proxy.exceptions import UpstreamError
from proxy.sampling import AgentSampling
from proxy.turns import TextDelta, TurnEvent, TurnRequest


def _turn(seed: int | None) -> TurnRequest:
    return TurnRequest("openai.chat", "m", (), (), AgentSampling(seed=seed))


def test_choices_get_consecutive_seeds() -> None:
    """Choice i samples with seed + i; without a seed every choice is left unseeded."""
    assert [t.sampling.seed for t in choice_requests(_turn(10), 3)] == [10, 11, 12]
    assert [t.sampling.seed for t in choice_requests(_turn(None), 2)] == [None, None]


async def _texts(
    words: list[str], gate: asyncio.Event | None = None, closed: list[str] | None = None
) -> AsyncGenerator[TurnEvent, None]:
    try:
        for word in words:
            if gate is not None:
                await gate.wait()
            yield TextDelta(word)
    finally:
        if closed is not None:
            closed.append(words[0])


async def test_events_are_interleaved_as_they_come() -> None:
    """A fast choice is not held back by a slow one: its deltas arrive first."""
    gate = asyncio.Event()
    merged = _interleave([_texts(["slow"], gate), _texts(["a", "b"])])
    first = [await anext(merged), await anext(merged)]
    assert first == [(1, TextDelta("a")), (1, TextDelta("b"))]
    gate.set()
    assert [e async for e in merged] == [(0, TextDelta("slow"))]


async def test_an_error_of_one_choice_ends_the_stream_and_stops_the_others() -> None:
    """A choice that fails raises through the merged stream; the others are stopped."""
    closed: list[str] = []

    async def failing() -> AsyncGenerator[TurnEvent, None]:
        yield TextDelta("x")
        raise UpstreamError("worker lost")

    merged = _interleave([_texts(["never"], asyncio.Event(), closed), failing()])
    with pytest.raises(UpstreamError):
        async for _ in merged:
            pass
    await merged.aclose()
    assert closed == ["never"]
