"""Bad input gets a clear OpenAI-style error and changes nothing."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from proxy.appkeys import SESSIONS
from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient

pytestmark = pytest.mark.e2e


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _snapshot(client: ProxyClient, trial_id: str) -> tuple[Any, Any]:
    summary = await client.get_session(trial_id)
    summary.pop("updated_at")
    return summary, await client.trajectories(trial_id)


async def _post(
    http: aiohttp.ClientSession, url: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, dict[str, Any], aiohttp.typedefs.LooseHeaders]:
    payload = raw if raw is not None else json.dumps(body).encode()
    kwargs: dict[str, Any] = {"data": io.BytesIO(payload)}
    async with http.post(url, **kwargs) as response:
        return response.status, await response.json(content_type=None), response.headers


@pytest.fixture
async def primed(proxy_client: ProxyClient, http: aiohttp.ClientSession) -> tuple[str, str]:
    """A session with one recorded turn."""
    trial = await proxy_client.create_session()
    status, _, _ = await _post(
        http,
        f"{trial.base_url}/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert status == 200
    return trial.trial_id, trial.base_url


GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("raw", "body", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"", None, "invalid_json"),
        (None, [1, 2, 3], "invalid_request"),
        (None, {"model": "m"}, "invalid_request"),
        (None, {"model": "m", "messages": []}, "invalid_request"),
        (None, {"model": "m", "messages": "hello"}, "invalid_request"),
        (None, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "invalid_request"),
        (None, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "invalid_request"),
        (None, {"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "invalid_message"),
        (None, GOOD | {"temperature": "hot"}, "invalid_request"),
        (None, GOOD | {"max_tokens": -5}, "invalid_request"),
        (None, GOOD | {"top_p": 3}, "invalid_request"),
        (
            None,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "unsupported_content",
        ),
        (
            None,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "invalid_request",
        ),
        (
            None,
            GOOD | {"tools": [{"type": "function", "function": {"name": ""}}]},
            "invalid_request",
        ),
    ],
)
async def test_malformed_requests_are_400_and_change_nothing(
    primed: tuple[str, str],
    proxy_client: ProxyClient,
    http: aiohttp.ClientSession,
    raw: bytes | None,
    body: Any,
    code: str,
) -> None:
    """Malformed JSON, wrong types and invalid messages are 400 with an OpenAI error body."""
    trial_id, base_url = primed
    before = await _snapshot(proxy_client, trial_id)
    status, payload, _ = await _post(http, f"{base_url}/chat/completions", body, raw)
    assert status == 400
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["code"] == code
    assert payload["error"]["message"]
    assert "Traceback" not in payload["error"]["message"]
    assert await _snapshot(proxy_client, trial_id) == before


async def test_unknown_trial_is_404(http: aiohttp.ClientSession, stack: RunningProxy) -> None:
    """A trial the proxy never registered is 404 trial_not_found."""
    status, payload, _ = await _post(http, f"{stack.url}/nope/v1/chat/completions", GOOD)
    assert status == 404
    assert payload["error"]["code"] == "trial_not_found"


async def test_completed_and_deleted_sessions_are_409(
    primed: tuple[str, str], proxy_client: ProxyClient, http: aiohttp.ClientSession
) -> None:
    """Agent calls after completion or deletion are 409 and record nothing."""
    trial_id, base_url = primed
    await proxy_client.complete(trial_id, reward={"pass": 1.0})
    before = await _snapshot(proxy_client, trial_id)
    status, payload, _ = await _post(http, f"{base_url}/chat/completions", GOOD)
    assert status == 409
    assert payload["error"]["code"] == "session_completed"
    assert await _snapshot(proxy_client, trial_id) == before
    await proxy_client.delete(trial_id)
    status, payload, _ = await _post(http, f"{base_url}/chat/completions", GOOD)
    assert status == 409
    assert payload["error"]["code"] == "session_deleted"


async def test_body_over_limit_is_413(
    primed: tuple[str, str], proxy_client: ProxyClient, http: aiohttp.ClientSession
) -> None:
    """A body over --max-body-bytes is 413 in the OpenAI error shape."""
    trial_id, base_url = primed
    before = await _snapshot(proxy_client, trial_id)
    big = GOOD | {"messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}
    status, payload, _ = await _post(http, f"{base_url}/chat/completions", big)
    assert status == 413
    assert payload["error"]["code"] == "body_too_large"
    assert await _snapshot(proxy_client, trial_id) == before


async def test_no_worker_is_503_with_retry_after(
    tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    """Without a worker, a call waits the configured bound and gets 503 + Retry-After."""
    running = await start_proxy(ProxyConfig(port=0, worker_wait_seconds=0.2, cache_dir=tmp_path))
    try:
        async with ProxyClient(running.url) as client:
            assert not await client.ready()
            trial = await client.create_session()
            status, payload, headers = await _post(http, f"{trial.base_url}/chat/completions", GOOD)
            assert status == 503
            assert payload["error"]["code"] == "no_worker"
            assert headers["Retry-After"] == "5"
            summary = await client.get_session(trial.trial_id)
            assert summary["turns"] == 0
            assert summary["server_errors"] == 1  # not the agent's doing
    finally:
        await running.stop()


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/sessions", {"trial_id": "has space"}, 400, "invalid_trial_id"),
        ("/sessions", {"sampling": {"temperature": "x"}}, 400, "invalid_sampling"),
        ("/sessions", {"unknown_field": 1}, 400, "invalid_request"),
        ("/sessions", {"history": "forget"}, 400, "invalid_option"),
        ("/sessions", {"cap_finish": "end_turn"}, 400, "invalid_option"),
        ("/sessions", {"chat_template_kwargs": ["thinking"]}, 400, "invalid_option"),
        ("/sessions", {"chat_template_kwargs": {"tools": []}}, 400, "invalid_option"),
        ("/sessions", {"chat_template_kwargs": {"x": "y" * 5000}}, 400, "invalid_option"),
        ("/sessions/x/complete", {"reward": "great"}, 404, "trial_not_found"),
    ],
)
async def test_session_api_errors(
    stack: RunningProxy, http: aiohttp.ClientSession, path: str, body: Any, status: int, code: str
) -> None:
    """The session API validates its input the same way, and a refused registration
    registers nothing."""
    before = len(stack.app[SESSIONS])
    got, payload, _ = await _post(http, f"{stack.url}{path}", body)
    assert got == status
    assert payload["error"]["code"] == code
    assert len(stack.app[SESSIONS]) == before


async def test_duplicate_trial_id_is_409(
    proxy_client: ProxyClient, http: aiohttp.ClientSession, stack: RunningProxy
) -> None:
    """Registering an existing trial id is 409 and leaves the first session intact."""
    trial = await proxy_client.create_session()
    status, payload, _ = await _post(http, f"{stack.url}/sessions/{trial.trial_id}", {})
    assert status == 409
    assert payload["error"]["code"] == "trial_exists"
    again = await proxy_client.get_session(trial.trial_id)
    assert again["status"] == "active"


async def test_bad_reward_is_400_and_session_stays_active(
    proxy_client: ProxyClient, http: aiohttp.ClientSession, stack: RunningProxy
) -> None:
    """A malformed reward does not complete the session."""
    trial = await proxy_client.create_session()
    status, _payload, _ = await _post(
        http, f"{stack.url}/sessions/{trial.trial_id}/complete", {"reward": "great"}
    )
    assert status == 400
    assert (await proxy_client.get_session(trial.trial_id))["status"] == "active"


async def test_unknown_route_is_json_404(http: aiohttp.ClientSession, stack: RunningProxy) -> None:
    """Unknown paths answer in the same error shape."""
    async with http.get(f"{stack.url}/no/such/route") as response:
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "route_not_found"
