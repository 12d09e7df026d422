"""Limits on messages per request, tokens per session and sessions in total: a clear 4xx
in the caller's API format, and the session unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient
from sdk.exceptions import ProxyRequestError
from tests.e2e.conftest import TIMEOUT_FACTOR

pytestmark = pytest.mark.e2e

MAX_MESSAGES = 6
MAX_SESSION_TOKENS = 100
MAX_SESSIONS = 3


@pytest.fixture(scope="module")
async def limited(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=8,
        max_messages=MAX_MESSAGES,
        max_session_tokens=MAX_SESSION_TOKENS,
        max_sessions=MAX_SESSIONS,
        cache_dir=tmp_path_factory.mktemp("limited-cache"),
    )
    running = await start_proxy(config)
    start_hf_worker(running, tiny_model_dir, worker_id="limited-hf")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


@pytest.fixture
async def client(limited: RunningProxy) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(limited.url, admin_token="") as proxy:
        yield proxy
        for session in (await proxy.list_sessions(limit=1000))["sessions"]:
            await proxy.delete(session["trial_id"])


def _conversation(count: int) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": f"m{i}"} for i in range(count - 1)] + [
        {"role": "user", "content": "last"}
    ]


async def _post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        return response.status, await response.json(content_type=None)


async def test_too_many_messages_in_each_api_format(client: ProxyClient) -> None:
    """One message over the limit is a 400 in the OpenAI or Anthropic shape; nothing is
    recorded; at the limit the request is served."""
    trial = await client.create_session()
    over = _conversation(MAX_MESSAGES + 1)
    status, body = await _post(
        f"{trial.base_url}/chat/completions", {"model": "m", "messages": over, "max_tokens": 2}
    )
    assert status == 400
    assert body["error"]["code"] == "too_many_messages"
    assert str(MAX_MESSAGES) in body["error"]["message"]
    status, body = await _post(
        f"{trial.base_url}/messages", {"model": "m", "messages": over, "max_tokens": 2}
    )
    assert status == 400
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert (await client.get_session(trial.trial_id))["turns"] == 0
    status, body = await _post(
        f"{trial.base_url}/chat/completions",
        {"model": "m", "messages": _conversation(MAX_MESSAGES), "max_tokens": 2},
    )
    assert status == 200, body
    assert (await client.get_session(trial.trial_id))["turns"] == 1


async def test_session_token_budget_caps_then_refuses(client: ProxyClient) -> None:
    """A session never stores more than its budget: the last turns are capped, then a
    request that fits no sampled token is refused and changes nothing."""
    trial = await client.create_session()
    agent = openai.AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
    refused: openai.BadRequestError | None = None
    last: dict[str, Any] = await client.get_session(trial.trial_id)
    # Each request starts a new branch (the messages continue no earlier turn), so every
    # turn stores its whole prompt and the budget runs out after a few turns.
    for i in range(MAX_SESSION_TOKENS):  # each turn stores at least one token
        try:
            await agent.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"hi {i}"}]
            )
        except openai.BadRequestError as exc:
            refused = exc
            break
        last = await client.get_session(trial.trial_id)
        assert last["tokens"]["stored"] <= MAX_SESSION_TOKENS
    await agent.close()
    assert refused is not None
    assert isinstance(refused.body, dict)
    assert refused.body["code"] == "session_token_limit"
    assert last["turns"] >= 2
    summary = await client.get_session(trial.trial_id)
    assert (summary["turns"], summary["tokens"]) == (last["turns"], last["tokens"])


async def test_prompt_over_the_budget_is_refused_at_once(client: ProxyClient) -> None:
    """A first request whose prompt alone exceeds the budget records nothing."""
    trial = await client.create_session()
    status, body = await _post(
        f"{trial.base_url}/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "word " * 300}]},
    )
    assert status == 400
    assert body["error"]["code"] == "session_token_limit"
    assert (await client.get_session(trial.trial_id))["turns"] == 0


async def test_sessions_in_total(client: ProxyClient, limited: RunningProxy) -> None:
    """Registering beyond the limit is a 429 with Retry-After; deleting frees a place."""
    held = len((await client.list_sessions(limit=1000))["sessions"])
    created = [await client.create_session() for _ in range(MAX_SESSIONS - held)]
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{limited.url}/sessions", json={}) as response,
    ):
        assert response.status == 429
        assert response.headers["Retry-After"].isdigit()
        body = await response.json()
    assert body["error"]["code"] == "too_many_sessions"
    with pytest.raises(ProxyRequestError) as exc:
        await client.create_session("one-too-many")
    assert exc.value.status == 429
    assert len((await client.list_sessions(limit=1000))["sessions"]) == MAX_SESSIONS
    await client.delete(created[0].trial_id)
    await client.create_session("fits-again")
