"""The store and the reaper wired into a running proxy (in process, port 0, no worker)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from proxy.appkeys import SESSIONS
from proxy.config import ProxyConfig
from proxy.sessions.store import DB_NAME
from rollout_relay.embedded import start_proxy
from tests.e2e.conftest import TIMEOUT_FACTOR


async def _until(check: Callable[[], Awaitable[bool]], seconds: float = 15.0) -> None:
    """Poll ``check`` until it holds, for a bounded time (no timing is asserted)."""
    deadline = asyncio.get_running_loop().time() + seconds * TIMEOUT_FACTOR
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_idle_sessions_are_completed_then_reaped_after_fetch(tmp_path: Path) -> None:
    """With tiny limits an idle session is completed (not dropped), keeps serving its
    trajectories, and once they were fetched it is removed from memory and from the store."""
    data = tmp_path / "data"
    config = ProxyConfig(
        port=0,
        data_dir=data,
        cache_dir=tmp_path / "cache",
        session_idle_seconds=0.2,
        retention_seconds=3600,
        fetched_retention_seconds=0.2,
    )
    running = await start_proxy(config)
    try:
        async with aiohttp.ClientSession(running.url) as http:

            async def get(path: str) -> tuple[int, Any]:
                async with http.get(path) as r:
                    return r.status, await r.json()

            async with http.post("/sessions", json={"trial_id": "sleepy"}) as r:
                assert r.status == 201
                base_url = (await r.json())["base_url"]

            async def completed() -> bool:
                status, body = await get("/sessions/sleepy")
                assert status == 200
                return bool(body["status"] == "completed")

            await _until(completed)
            _, summary = await get("/sessions/sleepy")
            assert summary["completed_by"] == "idle_timeout"
            async with http.post(
                f"{base_url}/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            ) as r:
                assert r.status == 409
                assert (await r.json())["error"]["code"] == "session_completed"

            status, export = await get("/sessions/sleepy/trajectories")
            assert status == 200
            assert export["status"] == "completed"

            async def reaped() -> bool:
                status, _ = await get("/sessions/sleepy")
                return status == 409

            await _until(reaped)
            _, body = await get("/sessions/sleepy")
            assert body["error"]["code"] == "session_deleted"
            assert len(running.app[SESSIONS]) == 0
        with sqlite3.connect(data / DB_NAME) as db:
            assert db.execute("SELECT count(*) FROM sessions").fetchone()[0] == 0
            assert db.execute("SELECT trial_id FROM tombstones").fetchall() == [("sleepy",)]
    finally:
        await running.stop()


async def test_a_clean_restart_restores_sessions(tmp_path: Path) -> None:
    """Sessions registered (and completed with a reward) before a stop are served again by
    a proxy started on the same data dir."""
    config = ProxyConfig(port=0, data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    running = await start_proxy(config)
    try:
        async with aiohttp.ClientSession(running.url) as http:
            async with http.post("/sessions", json={"trial_id": "kept", "metadata": {"a": 1}}):
                pass
            async with http.post("/sessions/kept/complete", json={"reward": 0.5}) as r:
                before = await r.json()
    finally:
        await running.stop()
    running = await start_proxy(config)
    try:
        async with aiohttp.ClientSession(running.url) as http, http.get("/sessions/kept") as r:
            after = await r.json()
    finally:
        await running.stop()
    for key in ("status", "metadata", "reward", "created_at", "completed_at", "completed_by"):
        assert after[key] == before[key], key
    assert after["reward"] == 0.5
