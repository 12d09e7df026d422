"""Running the proxy (and optionally an in-process ``hf`` worker) inside one event loop:
the ``up`` and ``demo`` commands and the end-to-end tests use this."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from proxy.app import build_app
from proxy.appkeys import POOL
from proxy.config import ProxyConfig
from proxy.lifecycle import LIFECYCLE
from proxy.tls import server_ssl_context


@dataclass(slots=True)
class RunningProxy:
    runner: web.AppRunner
    url: str
    app: web.Application
    worker_tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def worker_url(self) -> str:
        return (
            self.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/ws/worker"
        )

    async def wait_for_workers(self, count: int = 1, within_seconds: float = 60.0) -> None:
        pool = self.app[POOL]
        deadline = asyncio.get_running_loop().time() + within_seconds
        while len(pool.workers) < count:
            for task in self.worker_tasks:
                if task.done():
                    task.result()  # surface a worker that died
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{count} worker(s) did not connect within {within_seconds}s")
            await asyncio.sleep(0.05)

    async def shutdown(self, drain_seconds: float) -> bool:
        """Graceful stop: drain (refuse new turns, let running ones finish for up to
        ``drain_seconds``), then stop. True when nothing had to be cancelled."""
        lifecycle = self.app[LIFECYCLE]
        drained = await lifecycle.drain(self.app[POOL], drain_seconds)
        await self.stop()
        lifecycle.stopped()
        return drained

    async def stop(self) -> None:
        for task in self.worker_tasks:
            task.cancel()
        for task in self.worker_tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.runner.cleanup()


async def start_proxy(config: ProxyConfig) -> RunningProxy:
    tls = server_ssl_context(config.tls_cert, config.tls_key)
    app = build_app(config)
    # Graceful shutdown drains first (RunningProxy.shutdown); whatever still runs when the
    # runner stops is cancelled soon after, not after aiohttp's default 60 s.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, ssl_context=tls)
    await site.start()
    port = config.port
    if port == 0:
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None)
        assert sockets
        port = sockets[0].getsockname()[1]
    scheme = "https" if tls is not None else "http"
    return RunningProxy(runner, f"{scheme}://{config.host}:{port}", app)


def start_hf_worker(
    proxy: RunningProxy,
    model_dir: Path,
    *,
    name: str | None = None,
    token: str = "",
    worker_id: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    device: str = "cpu",
    teacher: bool = False,
) -> asyncio.Task[None]:
    """Load the model with the ``hf`` backend (on ``device``) and connect it to ``proxy``
    in this loop (``teacher``: announced as a teacher, as ``worker --teacher``)."""
    from worker_client.backends.hf import HFEngine
    from worker_client.client import ServedModel, WorkerClient

    engine = HFEngine.load(model_dir, name=name, device=device)
    client = WorkerClient(
        proxy.worker_url,
        {engine.card.name: ServedModel(engine, model_dir, teacher=teacher)},
        token=token,
        worker_id=worker_id,
        ssl_context=ssl_context,
    )
    task = asyncio.get_running_loop().create_task(client.run())
    proxy.worker_tasks.append(task)
    return task
