"""Load and overload on loopback against one real ``hf`` worker: hundreds of short sessions
lose no turn, and over the queue bounds the proxy refuses with 429/503 and Retry-After in
the caller's format (never another 5xx) while other trials keep being served."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import pytest

from proxy.appkeys import POOL
from relay.pool import PoolLimits
from rollout_relay.embedded import RunningProxy
from tests.e2e.conftest import TIMEOUT_FACTOR

pytestmark = pytest.mark.e2e

# The worker (the real tiny model on CPU) is the bottleneck: each session gets one short
# turn by default. RELAY_LOAD_SESSIONS / RELAY_LOAD_TURNS scale the run up.
SESSIONS = int(os.environ.get("RELAY_LOAD_SESSIONS", "500"))
TURNS = int(os.environ.get("RELAY_LOAD_TURNS", "1"))
CONCURRENCY = 16
LONG = 16  # max_tokens of the overload test's turns


@pytest.fixture
def tight_limits(stack: RunningProxy) -> Iterator[PoolLimits]:
    """The shared stack's pool with small bounds, restored afterwards."""
    pool = stack.app[POOL]
    saved = pool.limits
    pool.limits = PoolLimits(max_in_flight=2, max_queued=12, max_queued_per_trial=3)
    yield pool.limits
    pool.limits = saved


async def _session(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.post(f"{url}/sessions", json={}) as response:
        assert response.status == 201
        created: dict[str, Any] = await response.json()
        return created


async def _chat(
    http: aiohttp.ClientSession,
    base_url: str,
    messages: list[dict[str, str]],
    max_tokens: int = 1,
) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "seed": 1}
    async with http.post(f"{base_url}/chat/completions", json=body) as response:
        return response.status, await response.json(), response.headers


async def test_many_short_sessions_lose_no_turn(stack: RunningProxy) -> None:
    """500 sessions through one worker, 16 at a time: every reply is a success and every
    session holds exactly the turns it was answered, with matching token counts."""
    pool = stack.app[POOL]
    gate = asyncio.Semaphore(CONCURRENCY)
    statuses: Counter[int] = Counter()
    answered: dict[str, list[int]] = {}
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def episode(i: int) -> None:
            async with gate:
                created = await _session(http, stack.url)
                messages = [{"role": "user", "content": f"task {i}"}]
                tokens = answered.setdefault(created["trial_id"], [])
                for turn in range(TURNS):
                    status, body, _ = await _chat(http, created["base_url"], messages)
                    statuses[status] += 1
                    if status != 200:
                        return
                    tokens.append(body["usage"]["completion_tokens"])
                    reply = body["choices"][0]["message"]["content"] or ""
                    messages += [
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": f"next {turn}"},
                    ]

        await asyncio.gather(*(episode(i) for i in range(SESSIONS)))
        assert statuses == {200: SESSIONS * TURNS}
        for trial_id, tokens in answered.items():
            async with http.get(f"{stack.url}/sessions/{trial_id}/trajectories") as response:
                export = await response.json()
            turns = [t for traj in export["trajectories"] for t in traj["turns"]]
            assert len({t["turn"] for t in turns}) == len(tokens) == TURNS
            sampled = {t["turn"]: t["completion_tokens"] for t in turns}
            assert sorted(sampled.values()) == sorted(tokens)
    assert pool.in_flight == 0
    assert pool.queued == 0


async def test_overload_refuses_with_retry_after_and_stays_fair(
    stack: RunningProxy, tight_limits: PoolLimits
) -> None:
    """One trial flooding the proxy gets 429s (its queue share is full); a crowd of trials
    over the overall queue bound gets 503s; both carry Retry-After and a clear error code,
    no other 5xx occurs, a quiet trial is still served, and every 200 is a recorded turn."""
    async with aiohttp.ClientSession() as http:
        flood = await _session(http, stack.url)
        quiet = await _session(http, stack.url)
        crowd = [await _session(http, stack.url) for _ in range(24)]
        messages = [{"role": "user", "content": "go"}]
        pool = stack.app[POOL]
        # Turns long enough (up to 16 tokens) that the queue is still full when looked at:
        # one-token turns drain the whole flood before the first poll.
        flood_task = asyncio.gather(
            *(_chat(http, flood["base_url"], messages, LONG) for _ in range(20))
        )
        await _until(lambda: pool.queued >= tight_limits.max_queued_per_trial)
        # The flooding trial has its full share waiting; a quiet trial still gets in line.
        quiet_task = asyncio.ensure_future(_chat(http, quiet["base_url"], messages))
        # It waits beside the flood, unless the flood's one-token turns already drained.
        await _until(lambda: pool.queued > tight_limits.max_queued_per_trial or quiet_task.done())
        crowd_task = asyncio.gather(*(_chat(http, c["base_url"], messages, LONG) for c in crowd))
        quiet_status, quiet_body, _ = await quiet_task
        results = await flood_task + await crowd_task

        codes: Counter[tuple[int, str | None]] = Counter()
        for status, body, headers in results:
            if status == 200:
                codes[(200, None)] += 1
                continue
            assert status in {429, 503}, body
            assert int(headers["Retry-After"]) > 0
            codes[(status, body["error"]["code"])] += 1
        assert set(codes) <= {(200, None), (429, "too_many_requests"), (503, "overloaded")}
        assert codes[(429, "too_many_requests")] >= 1
        assert codes[(503, "overloaded")] >= 1
        assert quiet_status == 200, quiet_body

        served = {quiet["trial_id"]: 1}
        for created, (status, _, _) in zip(crowd, results[20:], strict=True):
            served[created["trial_id"]] = int(status == 200)
        served[flood["trial_id"]] = sum(1 for status, _, _ in results[:20] if status == 200)
        for trial_id, count in served.items():
            async with http.get(f"{stack.url}/sessions/{trial_id}") as response:
                summary = await response.json()
            assert summary["turns"] == count, trial_id
    assert pool.queued == 0
    assert pool.in_flight == 0


async def _until(condition: Any) -> None:
    for _ in range(int(200 * TIMEOUT_FACTOR)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the pool never reached the expected state")
