"""``/metrics`` after real requests through the proxy, relay, worker and tiny model: the
counters move by exactly what was served, and every reply names its request."""

from __future__ import annotations

import aiohttp
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient

pytestmark = pytest.mark.e2e

CHAT = "/{trial_id}/v1/chat/completions"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _scrape(url: str) -> Samples:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _sum(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and wanted <= set(lbl))


async def test_metrics_count_what_was_served(
    stack: RunningProxy, proxy_client: ProxyClient
) -> None:
    """Requests by API/route/status, turns, tokens in and out, latency histograms, errors
    and the pool gauges reflect a plain call, a streamed call and a malformed one."""
    before = await _scrape(stack.url)
    trial = await proxy_client.create_session()
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as c:
        plain = await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=1
        )
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            seed=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        streamed_usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                streamed_usage = chunk.usage
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{trial.base_url}/chat/completions",
            data=b"{not json",
            headers={"X-Request-Id": "bad-1"},
        ) as bad,
    ):
        assert bad.status == 400
        assert bad.headers["X-Request-Id"] == "bad-1"
    after = await _scrape(stack.url)
    assert plain.usage is not None
    assert streamed_usage is not None

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    ok = {"api": "openai.chat", "route": CHAT, "method": "POST"}
    assert delta("relay_http_requests_total", **ok, status="200") == 2
    assert delta("relay_http_requests_total", **ok, status="400") == 1
    assert delta("relay_errors_total", api="openai.chat", code="invalid_json") == 1
    turns = _sum(after, "relay_turns_total", api="openai.chat") - _sum(
        before, "relay_turns_total", api="openai.chat"
    )
    assert turns == 2
    assert delta("relay_prompt_tokens_total", api="openai.chat") == (
        plain.usage.prompt_tokens + streamed_usage.prompt_tokens
    )
    assert delta("relay_completion_tokens_total", api="openai.chat") == (
        plain.usage.completion_tokens + streamed_usage.completion_tokens
    )
    for histogram in (
        "relay_turn_time_to_first_token_seconds",
        "relay_turn_queue_seconds",
        "relay_turn_engine_seconds",
        "relay_turn_proxy_overhead_seconds",
        "relay_turn_duration_seconds",
    ):
        assert delta(f"{histogram}_count") == 2, histogram
    assert delta("relay_http_request_duration_seconds_count", api="openai.chat") == 3
    assert delta("relay_dispatches_total") == 2
    assert _value(after, "relay_workers_connected") == 1
    assert _value(after, "relay_worker_slots") >= 1
    assert _value(after, "relay_sessions_open") >= 1
    assert _value(after, "relay_requests_in_flight") == 0
    assert _value(after, "relay_requests_queued") == 0


async def test_every_reply_carries_a_request_id(stack: RunningProxy) -> None:
    """Replies (also streamed ones and errors) carry X-Request-Id; a sane client id is kept,
    anything else is replaced by a fresh one."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/healthz") as response:
            generated = response.headers["X-Request-Id"]
            assert generated.startswith("req_")
        async with http.get(f"{stack.url}/healthz", headers={"X-Request-Id": "x" * 200}) as r:
            assert r.headers["X-Request-Id"].startswith("req_")
            assert r.headers["X-Request-Id"] != generated
        async with http.get(f"{stack.url}/nowhere", headers={"X-Request-Id": "mine-7"}) as r:
            assert r.status == 404
            assert r.headers["X-Request-Id"] == "mine-7"
