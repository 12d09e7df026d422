"""Routing rows (R3) end to end: a real proxy and worker client whose scripted engine
reports routing as a mixture-of-experts engine would (``tests.scripted_worker``
``RoutingEngine``: every row a function of its position and token). Off unless a
session asks; asked, each turn asks only for the rows past its chain's and the export's
rows are exactly those of every position but the last; rows that never came are named; a
model without routing is refused at creation, or at the first request in the caller's
format."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from tests.e2e.conftest import IN_PROCESS_STREAMS, TIMEOUT_FACTOR
from tests.scripted_worker import (
    LONG_STORY,
    PacedScriptedEngine,
    RoutingEngine,
    routing_rows,
    serve_routing,
    serve_scripted,
    tiny_reply,
)


def _config(tmp: Path, wait: float = 5) -> ProxyConfig:
    return ProxyConfig(
        port=0,
        worker_wait_seconds=wait * TIMEOUT_FACTOR,
        max_tokens=64,
        cache_dir=tmp,
        stream_coalesce=IN_PROCESS_STREAMS,
    )


@pytest.fixture(scope="module")
async def moe_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[RunningProxy, PacedScriptedEngine, RoutingEngine]]:
    running = await start_proxy(_config(tmp_path_factory.mktemp("moe-cache")))
    engine, client = serve_routing(running, tiny_model_dir, "test-moe")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running, engine, client
    await running.stop()


@pytest.fixture
def moe(
    moe_stack: tuple[RunningProxy, PacedScriptedEngine, RoutingEngine],
) -> tuple[RunningProxy, PacedScriptedEngine, RoutingEngine]:
    _, engine, client = moe_stack
    engine.reset()
    client.asked.clear()
    client.early = client.short = 0
    return moe_stack


async def _session(http: aiohttp.ClientSession, **body: Any) -> tuple[int, dict[str, Any]]:
    async with http.post("/sessions", json=body) as r:
        return r.status, await r.json()


async def _chat(
    http: aiohttp.ClientSession, trial: str, messages: list[dict[str, Any]]
) -> tuple[int, dict[str, Any]]:
    body = {"model": "m", "max_tokens": 32, "messages": messages}
    async with http.post(f"/{trial}/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def _export(http: aiohttp.ClientSession, trial: str) -> dict[str, Any]:
    async with http.get(f"/sessions/{trial}/trajectories") as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


def _check_rows(traj: dict[str, Any]) -> None:
    """The trajectory's rows are the engine's for every position but the last."""
    ids = traj["prompt_ids"] + traj["response_ids"]
    routed = traj["routed_experts"]
    assert routed["dtype"] == "uint8"
    assert routed["shape"] == [len(ids) - 1, 2, 2]
    assert base64.b64decode(routed["data"]) == routing_rows(ids, 0, len(ids) - 1)
    assert routed["missing"] == []
    assert not any(turn["routing_missing"] for turn in traj["turns"])


async def test_rows_over_a_chain_and_a_branch_are_asked_once_and_exact(
    moe: tuple[RunningProxy, PacedScriptedEngine, RoutingEngine],
) -> None:
    """A root asks from 0, its continuation from the root's end - 1 and gets only the rows
    past it (even from an engine that gives some earlier ones too), a branch from the root
    likewise; each trajectory's rows are exactly the engine's, position by position."""
    running, engine, client = moe
    engine.script(tiny_reply("I will list them."), tiny_reply("Done."), tiny_reply("Other."))
    async with aiohttp.ClientSession(running.url) as http:
        status, created = await _session(http, routed_experts=True)
        assert status == 201
        trial = created["trial_id"]
        first = [{"role": "user", "content": "List the files."}]
        status, reply = await _chat(http, trial, first)
        assert status == 200
        said = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
        client.early = 3  # this engine gives three rows more than asked
        status, _ = await _chat(http, trial, [*first, said, {"role": "user", "content": "Go."}])
        assert status == 200
        client.early = 0
        branch = [*first, said, {"role": "user", "content": "Something else."}]
        status, _ = await _chat(http, trial, branch)
        assert status == 200
        export = await _export(http, trial)
    (root, chain), (_, fork) = (t["turns"] for t in export["trajectories"])
    root_end = root["prompt_tokens"] + root["completion_tokens"]
    chain_end = chain["prompt_tokens"] + chain["completion_tokens"]
    fork_end = fork["prompt_tokens"] + fork["completion_tokens"]
    assert client.asked == [
        (0, 0, root_end - 1),
        (root_end - 1, root_end - 4, chain_end - root_end + 3),
        (root_end - 1, root_end - 1, fork_end - root_end),
    ]
    for traj in export["trajectories"]:
        _check_rows(traj)
        assert traj["routed_experts"]["versions"] == [
            [0, 0, len(traj["response_ids"]) + len(traj["prompt_ids"]) - 1]
        ]


async def test_nothing_is_asked_or_exported_unless_the_session_asks(
    moe: tuple[RunningProxy, PacedScriptedEngine, RoutingEngine],
) -> None:
    running, engine, client = moe
    engine.script(tiny_reply("Fine."))
    async with aiohttp.ClientSession(running.url) as http:
        _, created = await _session(http)
        status, _ = await _chat(http, created["trial_id"], [{"role": "user", "content": "Hi."}])
        assert status == 200
        export = await _export(http, created["trial_id"])
    assert client.asked == [(None, 0, 0)]
    assert "routed_experts" not in export["trajectories"][0]


async def test_rows_an_engine_did_not_give_are_missing_and_the_turn_marked(
    moe: tuple[RunningProxy, PacedScriptedEngine, RoutingEngine],
) -> None:
    running, engine, client = moe
    engine.script(tiny_reply("Short rows."))
    client.short = 2
    async with aiohttp.ClientSession(running.url) as http:
        _, created = await _session(http, routed_experts=True)
        status, _ = await _chat(http, created["trial_id"], [{"role": "user", "content": "Hi."}])
        assert status == 200
        (traj,) = (await _export(http, created["trial_id"]))["trajectories"]
    rows = len(traj["prompt_ids"]) + len(traj["response_ids"]) - 1
    assert traj["routed_experts"]["missing"] == [[rows - 2, rows]]
    assert traj["turns"][0]["routing_missing"] is True


async def test_a_dense_model_is_refused_at_creation(
    scripted_stack: tuple[RunningProxy, PacedScriptedEngine],
) -> None:
    """The only served model reports no routing: the session is refused, naming why."""
    async with aiohttp.ClientSession(scripted_stack[0].url) as http:
        status, body = await _session(http, routed_experts=True)
    assert status == 400
    assert body["error"]["code"] == "routing_unsupported"


async def test_a_dense_model_is_refused_at_the_first_request_in_the_callers_format(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Created before any worker joined (the pool could not tell), the session's first
    request is refused with a 400 in the caller's API format, and nothing is recorded."""
    running = await start_proxy(_config(tmp_path))
    try:
        async with aiohttp.ClientSession(running.url) as http:
            status, created = await _session(http, routed_experts=True)
            assert status == 201
            trial = created["trial_id"]
            serve_scripted(running, tiny_model_dir, "dense")
            await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
            status, body = await _chat(http, trial, [{"role": "user", "content": "Hi."}])
            assert status == 400
            assert body["error"]["code"] == "routing_unsupported"
            message = {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi."}],
            }
            async with http.post(f"/{trial}/v1/messages", json=message) as r:
                assert r.status == 400
                anthropic = await r.json()
            assert anthropic["type"] == "error"
            assert "expert routing" in anthropic["error"]["message"]
            assert (await _export(http, trial))["trajectories"] == []
    finally:
        await running.stop()


async def test_a_worker_lost_mid_turn_leaves_the_turn_without_its_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The worker dies mid-reply and none takes the request over: the cut turn is kept
    with every row of its positions missing, and marked."""
    running = await start_proxy(_config(tmp_path, wait=1))
    try:
        engine, _ = serve_routing(running, tiny_model_dir, "doomed")
        await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        engine.policy = lambda prompt: LONG_STORY
        engine.delay = 0.02
        async with aiohttp.ClientSession(running.url) as http:
            _, created = await _session(http, routed_experts=True)
            trial = created["trial_id"]
            body = {
                "model": "m",
                "max_tokens": 64,
                "stream": True,
                "messages": [{"role": "user", "content": "Tell me a story."}],
            }
            async with http.post(f"/{trial}/v1/chat/completions", json=body) as r:
                assert r.status == 200
                lines = 0
                while lines < 5:  # some tokens of the reply went out
                    line = await r.content.readline()
                    assert line, "the stream ended before the worker was lost"
                    lines += line.startswith(b"data: {")
                running.worker_tasks[-1].cancel()  # the worker dies
                await r.read()
            for _ in range(200):
                export = await _export(http, trial)
                if export["trajectories"]:
                    break
                await asyncio.sleep(0.05)
            async with http.get(f"/sessions/{trial}") as r:
                assert (await r.json())["server_errors"] == 1
        (traj,) = export["trajectories"]
        (turn,) = traj["turns"]
        assert turn["truncated"] is True
        assert turn["routing_missing"] is True
        rows = len(traj["prompt_ids"]) + len(traj["response_ids"]) - 1
        assert traj["routed_experts"]["missing"] == [[0, rows]]
    finally:
        await running.stop()


async def test_a_replayed_retry_asks_and_records_no_rows(
    moe: tuple[RunningProxy, PacedScriptedEngine, RoutingEngine],
) -> None:
    """A retry answered with the recorded reply runs nothing: no rows are asked, and the
    session's rows are the first attempt's."""
    running, engine, client = moe
    engine.script(tiny_reply("Once."))
    async with aiohttp.ClientSession(running.url) as http:
        _, created = await _session(http, routed_experts=True)
        trial = created["trial_id"]
        body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi."}]}
        for retry in ("0", "1"):
            headers = {"x-stainless-retry-count": retry}
            async with http.post(f"/{trial}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
        export = await _export(http, trial)
    assert len(client.asked) == 1
    (traj,) = export["trajectories"]
    assert traj["turns"][0]["replays"] == 1
    _check_rows(traj)
