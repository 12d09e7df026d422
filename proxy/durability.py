"""Wiring the session store and the session reaper into the application's lifetime.

On startup (before the server listens) the store under ``data_dir`` is opened and every
session it holds is loaded into the registry; from then on the registry and the turn
service commit every change before answering. On cleanup the reaper stops and the store
commits what is queued (turns of cancelled requests, recorded as truncated) and closes.
Without ``data_dir`` sessions live in memory only, which the proxy logs loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.appkeys import CONFIG, POOL, SERVICE, SESSIONS
from proxy.config import ProxyConfig
from proxy.sessions.expiry import ExpiryPolicy, Reaper
from proxy.sessions.store import SessionStore

__all__ = ["REAPER", "expiry_policy", "setup_durability"]

log = logging.getLogger(__name__)

REAPER = web.AppKey("reaper", Reaper)


def expiry_policy(config: ProxyConfig) -> ExpiryPolicy:
    return ExpiryPolicy(
        idle_seconds=config.session_idle_seconds,
        max_age_seconds=config.session_max_age_seconds,
        retention_seconds=config.retention_seconds,
        fetched_retention_seconds=config.fetched_retention_seconds,
    )


def setup_durability(app: web.Application) -> None:
    """Call from ``build_app`` after the registry, service and pool are in place."""
    app[REAPER] = Reaper(
        app[SESSIONS], expiry_policy(app[CONFIG]), on_done=app[POOL].forget_affinity
    )
    app.cleanup_ctx.append(_durability)


async def _durability(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    registry = app[SESSIONS]
    store: SessionStore | None = None
    if config.data_dir is not None:
        store = await SessionStore.open(config.data_dir)
        loaded = await store.load()
        registry.restore(loaded)
        registry.store = store
        app[SERVICE].recorder.store = store
        log.info(
            "session store %s: restored %d sessions (%d turns)",
            store.path,
            len(loaded.sessions),
            sum(len(s.nodes) for s in loaded.sessions),
        )
    else:
        log.warning(
            "no --data-dir: sessions and recorded turns are kept in memory only and are LOST"
            " when the proxy stops; pass --data-dir DIR to make them durable"
        )
    task = asyncio.create_task(app[REAPER].run(), name="session-reaper")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if store is not None:
            await store.close()
