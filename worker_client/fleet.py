"""One worker process serving every proxy replica.

``rollout-relay worker --proxy URL`` is repeatable, and a URL's host may be a name that
resolves to several replicas (Kubernetes' headless Service: one address per ready pod).
``WorkerFleet`` keeps one connection (a ``WorkerClient``) per replica: per URL, and per
address its name resolves to. Names are resolved again every
``resolve_seconds``, so a replica that appears is joined and one that goes away is left.

The engines are shared: each has one admission limit (``max_concurrency`` requests
running at once) across all connections, not one per socket, so N replicas cannot push
N times the engine's capacity onto it; a request over the limit waits in the worker. The
weights are shared too (one ``WorkerPolicy``): a weight update through one replica pauses
the engine for every replica, and every replica is told the new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from urllib.parse import urlsplit

from worker_client.client import ServedModel, WorkerClient, default_worker_id
from worker_client.exceptions import ConnectionRefusedByProxy
from worker_client.policy import WorkerPolicy

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
Target = tuple[str, str | None]  # (proxy URL, address to connect to; None: the URL's host)


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for a TCP connection, in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class WorkerFleet:
    def __init__(
        self,
        proxy_urls: Sequence[str],
        models: Mapping[str, ServedModel],
        *,
        token: str = "",
        worker_id: str | None = None,
        max_concurrency: int = 8,
        ssl_context: Callable[[str], ssl.SSLContext | None] = lambda url: None,
        resolve_seconds: float = 30.0,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        if not proxy_urls:
            raise ValueError("a worker needs at least one --proxy")
        self.proxy_urls = list(dict.fromkeys(proxy_urls))
        self.models = dict(models)
        self.token = token
        self.max_concurrency = max_concurrency
        self.ssl_context = ssl_context
        self.resolve_seconds = resolve_seconds
        self.resolver = resolver
        # Shared by every connection: one limit per engine, one set of weights (an update
        # through any replica reaches the engines every replica is served by).
        self.admission = {name: asyncio.Semaphore(max_concurrency) for name in self.models}
        self.policy = WorkerPolicy([m.engine for m in self.models.values()])
        self.worker_id = worker_id or default_worker_id()
        self.clients: dict[Target, WorkerClient] = {}
        self._tasks: dict[Target, asyncio.Task[None]] = {}
        self._known: dict[str, list[Target]] = {}  # per URL, its last resolution

    def __repr__(self) -> str:
        return f"<WorkerFleet {self.worker_id} {len(self.clients)} connections>"

    async def targets(self) -> list[Target]:
        """One target per replica: per URL, and per address of a URL whose host is a name
        (a replica that comes back at another address is a new target). A name that cannot
        be resolved now keeps its last targets."""
        out: list[Target] = []
        for url in self.proxy_urls:
            parts = urlsplit(url)
            host = parts.hostname or ""
            if not host or _is_address(host):
                found: list[Target] = [(url, None)]
            else:
                port = parts.port or (443 if parts.scheme == "wss" else 80)
                try:
                    addresses = await self.resolver(host, port)
                except OSError as exc:
                    log.warning("worker %s: cannot resolve %s: %s", self.worker_id, host, exc)
                    found = self._known.get(url, [(url, None)])
                else:
                    found = [(url, a) for a in addresses] or self._known.get(url, [(url, None)])
            self._known[url] = found
            out.extend(found)
        return out

    async def refresh(self) -> None:
        """Join the replicas that are new, leave the ones that went away."""
        wanted = await self.targets()
        for target in [t for t in self._tasks if t not in wanted]:
            log.info("worker %s: leaving %s", self.worker_id, _label(target))
            self._tasks.pop(target).cancel()
            self.clients.pop(target, None)
        for target in wanted:
            if target in self._tasks:
                continue
            url, address = target
            client = WorkerClient(
                url,
                self.models,
                token=self.token,
                worker_id=self.worker_id,
                max_concurrency=self.max_concurrency,
                ssl_context=self.ssl_context(url),
                connect_host=address,
                admission=self.admission,
                policy=self.policy,
            )
            self.clients[target] = client
            self._tasks[target] = asyncio.create_task(client.run(), name=_label(target))
            log.info("worker %s: joining %s", self.worker_id, _label(target))

    async def run(self) -> None:
        """Serve every replica until cancelled; a replica that refuses this worker (bad
        token, protocol version) ends it, as with one proxy."""
        try:
            while True:
                await self.refresh()
                done, _ = await asyncio.wait(
                    set(self._tasks.values()),
                    timeout=self.resolve_seconds,
                    return_when=asyncio.FIRST_EXCEPTION,
                )
                for task in done:
                    error = task.exception() if not task.cancelled() else None
                    if isinstance(error, ConnectionRefusedByProxy):
                        raise error
                    if error is not None:
                        log.error("worker %s: %s stopped: %s", self.worker_id, task, error)
                # Connections that ended are made again at the next refresh.
                for target, task in list(self._tasks.items()):
                    if task.done():
                        del self._tasks[target]
                        self.clients.pop(target, None)
        finally:
            for task in self._tasks.values():
                task.cancel()
            for task in self._tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def _label(target: Target) -> str:
    url, address = target
    return f"{url} via {address}" if address else url
