"""A streamed reply's deltas are written by the relay as each engine step arrives (no
task switch per step), in every agent API, on the real proxy, worker and official clients
(the worker's engine scripted to stream a few words one token per step, scored by the tiny
model): the client reads the same text as the whole reply, and the steps really went
through the relay's writer."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from relay.pool import Delivery, RelayCall, TokensEvent
from sdk.client import ProxyClient
from tests.scripted_worker import PacedScriptedEngine, tiny_reply

# A reply of a few words (more than 8 characters, less than the requests' 24 tokens).
STORY = "Once upon a time the agent read the file."


@pytest.fixture
def written_by_relay(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tokens each step the relay wrote itself had."""
    taken: list[int] = []
    real = RelayCall._take

    def spy(call: RelayCall, sink: Any, tokens: TokensEvent, may_hold: bool) -> Delivery:
        count = len(tokens.token_ids)
        delivery = real(call, sink, tokens, may_hold)
        if delivery is Delivery.WRITTEN:
            taken.append(count)
        return delivery

    monkeypatch.setattr(RelayCall, "_take", spy)
    return taken


async def test_chat_stream_written_by_the_relay(
    scripted_client: ProxyClient,
    scripted: PacedScriptedEngine,
    written_by_relay: list[int],
) -> None:
    """Chat deltas add up to the whole reply; all but the first step went through the relay."""
    scripted.script(tiny_reply(STORY), tiny_reply(STORY))
    trial = await scripted_client.create_session()
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
        kwargs: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "user", "content": "tell me"}],
            "max_tokens": 24,
            "seed": 1,
        }
        whole = await client.chat.completions.create(**kwargs)
        text = whole.choices[0].message.content or ""
        assert len(text) >= 8
        written_by_relay.clear()
        stream = await client.chat.completions.create(stream=True, **kwargs)
        pieces = [
            c.choices[0].delta.content
            async for c in stream
            if c.choices and c.choices[0].delta.content
        ]
    assert "".join(pieces) == text
    assert len(written_by_relay) >= len(pieces) - 1 > 0


async def test_anthropic_stream_written_by_the_relay(
    scripted_client: ProxyClient,
    scripted: PacedScriptedEngine,
    written_by_relay: list[int],
) -> None:
    """Anthropic text deltas add up to the whole reply, written by the relay."""
    scripted.script(tiny_reply(STORY), tiny_reply(STORY))
    trial = await scripted_client.create_session(sampling={"seed": 1, "max_tokens": 24})
    async with AsyncAnthropic(base_url=trial.anthropic_base_url, api_key=trial.api_key) as client:
        request: dict[str, Any] = {
            "model": "m",
            "max_tokens": 24,
            "messages": [{"role": "user", "content": "tell me"}],
        }
        whole = await client.messages.create(**request)
        text = "".join(b.text for b in whole.content if b.type == "text")
        assert len(text) >= 8
        written_by_relay.clear()
        async with client.messages.stream(**request) as stream:
            streamed = "".join([piece async for piece in stream.text_stream])
    assert streamed == text
    assert written_by_relay


async def test_responses_stream_written_by_the_relay(
    scripted_client: ProxyClient,
    scripted: PacedScriptedEngine,
    written_by_relay: list[int],
) -> None:
    """Responses text deltas add up to the whole reply, written by the relay."""
    scripted.script(tiny_reply(STORY), tiny_reply(STORY))
    trial = await scripted_client.create_session(sampling={"seed": 1, "max_tokens": 24})
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
        request: dict[str, Any] = {"model": "m", "input": "tell me", "max_output_tokens": 24}
        whole = await client.responses.create(**request)
        assert len(whole.output_text) >= 8
        written_by_relay.clear()
        deltas = [
            event.delta
            async for event in await client.responses.create(stream=True, **request)
            if event.type == "response.output_text.delta"
        ]
    assert "".join(deltas) == whole.output_text
    assert written_by_relay


async def test_completions_stream_written_by_the_relay_after_its_first_chunk(
    scripted_client: ProxyClient,
    scripted: PacedScriptedEngine,
    written_by_relay: list[int],
) -> None:
    """The legacy API has no opening event: its first chunk goes out through aiohttp,
    the later ones through the relay."""
    # A plain completion is not a chat turn: it is the text alone, up to the cap.
    scripted.script(STORY, STORY)
    trial = await scripted_client.create_session()
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key) as client:
        kwargs: dict[str, Any] = {
            "model": "m",
            "prompt": "once upon a time",
            "max_tokens": 24,
            "seed": 1,
        }
        whole = await client.completions.create(**kwargs)
        text = whole.choices[0].text
        assert len(text) >= 8
        written_by_relay.clear()
        stream = await client.completions.create(stream=True, **kwargs)
        pieces = [c.choices[0].text async for c in stream if c.choices and c.choices[0].text]
    assert "".join(pieces) == text
    assert len(written_by_relay) >= len(pieces) - 2 > 0
