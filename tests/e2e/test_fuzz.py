"""Fuzzing the agent APIs with hypothesis against the real proxy and worker: malformed
bodies, wrong types, missing and mistyped fields for chat completions, Anthropic messages
and Responses never produce a 5xx, and a refused request leaves the session unchanged."""

from __future__ import annotations

import json
import os
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_relay.embedded import RunningProxy

pytestmark = pytest.mark.e2e

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)

# A valid, cheap request per API (one sampled token); mutations start from these.
BASES: dict[str, dict[str, Any]] = {
    "chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    },
    "messages": {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "m", "input": "hi", "max_output_tokens": 1},
}
# Fields worth replacing besides the base's own: tools, options, roles, content blocks.
EXTRA_FIELDS = [
    "tools",
    "tool_choice",
    "stop",
    "stop_sequences",
    "temperature",
    "top_p",
    "seed",
    "system",
    "instructions",
    "logprobs",
    "top_logprobs",
    "stream_options",
    "previous_response_id",
    "response_format",
    "metadata",
]
TOKEN_FIELDS = {"max_tokens", "max_output_tokens", "max_completion_tokens"}


@st.composite
def bodies(draw: st.DrawFn, api: str) -> bytes:
    base = json.loads(json.dumps(BASES[api]))
    kind = draw(st.sampled_from(["bytes", "json", "replace", "drop", "message"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "replace":
        field = draw(st.sampled_from(sorted(base) + EXTRA_FIELDS))
        value = draw(JSON_VALUES)
        if field in TOKEN_FIELDS and isinstance(value, int) and value > 4:
            value = 4  # keep accepted requests cheap
        base[field] = value
    elif kind == "drop":
        del base[draw(st.sampled_from(sorted(base)))]
    else:
        message = draw(
            st.dictionaries(
                st.sampled_from(["role", "content", "type", "tool_calls", "name", "tool_call_id"]),
                JSON_VALUES,
                max_size=4,
            )
        )
        key = "input" if api == "responses" else "messages"
        base[key] = [message]
    return json.dumps(base).encode()


async def _turns(http: aiohttp.ClientSession, url: str, trial_id: str) -> int:
    async with http.get(f"{url}/sessions/{trial_id}") as response:
        assert response.status == 200
        summary: dict[str, Any] = await response.json()
        turns: int = summary["turns"]
        return turns


async def _fuzz(stack: RunningProxy, api: str, body: bytes) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/sessions", json={}) as response:
            created = await response.json()
        headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {created['api_key']}",
            "x-api-key": created["api_key"],
        }
        before = await _turns(http, stack.url, created["trial_id"])
        async with http.post(f"{created['base_url']}/{api}", data=body, headers=headers) as r:
            status = r.status
            text = await r.text()
        after = await _turns(http, stack.url, created["trial_id"])
    assert status < 500, (status, body, text)
    if status >= 400:
        assert after == before, (status, body, text)
        error = json.loads(text)
        assert ("error" in error) if api != "messages" else (error["type"] == "error")
    else:
        assert after > before, (status, body)


# Derandomized (the same examples every run) so CI is stable; RELAY_FUZZ_RANDOM=1 explores
# new examples and RELAY_FUZZ_EXAMPLES sets how many per API.
FUZZ = settings(
    max_examples=int(os.environ.get("RELAY_FUZZ_EXAMPLES", "40")),
    derandomize=not os.environ.get("RELAY_FUZZ_RANDOM"),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(body=bodies("chat/completions"))
async def test_fuzz_chat_completions(stack: RunningProxy, body: bytes) -> None:
    """Chat completions: any body gets a 2xx or a 4xx in OpenAI's error shape."""
    await _fuzz(stack, "chat/completions", body)


@FUZZ
@given(body=bodies("messages"))
async def test_fuzz_anthropic_messages(stack: RunningProxy, body: bytes) -> None:
    """Anthropic messages: any body gets a 2xx or a 4xx in Anthropic's error shape."""
    await _fuzz(stack, "messages", body)


@FUZZ
@given(body=bodies("responses"))
async def test_fuzz_responses(stack: RunningProxy, body: bytes) -> None:
    """Responses: any body gets a 2xx or a 4xx in OpenAI's error shape."""
    await _fuzz(stack, "responses", body)
