"""Several proxy replicas, each owning the trials ``relay.cluster.owner`` gives it.

Every replica is started with its own public URL and the list of all of them
(``--public-url``, ``--peers``). A session lives on its owner only (its own store, its
own workers' connections); the ``base_url`` handed out names the owner, so agents go
straight there. A request about a trial that reaches another replica (a session-API call,
an agent call, the viewer's data) is forwarded to the owner and its answer streamed back
unchanged, so a client that knows only one replica is still served. A forwarded request
carries ``X-Relay-Forwarded-By``; a replica that receives one for a trial it does not own
either has a different replica list or was reached by mistake, and answers 421 instead of
forwarding again. An owner that does not answer is a 503 (``owner_unavailable``) with
Retry-After: its sessions wait for it (its volume comes back with it), nothing is taken
over. A list that spans the replicas (``GET /sessions``, the viewer's sessions) is
gathered by the replica asked: each other replica, asked with the same header, answers
with its own part.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import shortuuid
from aiohttp import web

from proxy.api.errors import json_response
from proxy.appkeys import CONFIG
from proxy.exceptions import (
    ConfigurationError,
    MisdirectedRequestError,
    ServiceUnavailableError,
    UpstreamError,
)
from relay.cluster import ClusterError, normalize_url, pick_owner, validate_peers

log = logging.getLogger(__name__)

FORWARDED_BY = "X-Relay-Forwarded-By"
# Hop-by-hop headers (RFC 9110 §7.6.1) and the ones the forwarding connection sets itself.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

# What a replica passes on when it asks the others for their part of a list.
_CREDENTIALS = frozenset({"authorization", "x-api-key", "api-key", "cookie"})
# A list's part is small and asked of every replica at once: no reason to wait long.
_ASK_SECONDS = 10.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Cluster:
    """This replica's view of the replica list."""

    def __init__(self, me: str, peers: tuple[str, ...], *, retry_after_seconds: int = 5) -> None:
        self.me = normalize_url(me)
        self.peers = peers
        self.retry_after_seconds = retry_after_seconds
        self._http: aiohttp.ClientSession | None = None

    def owner_of(self, trial_id: str) -> str | None:
        """The owning replica's URL, or None when this replica owns the trial."""
        found = pick_owner(trial_id, self.peers)  # normalized by validate_peers
        return None if found == self.me else found

    def owns(self, trial_id: str) -> bool:
        return self.owner_of(trial_id) is None

    async def start(self) -> None:
        # No total timeout: an agent's streamed turn may run for minutes.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        self._http = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def forward(self, request: web.Request, target: str) -> web.StreamResponse:
        assert self._http is not None, "the cluster is not started"
        trial_id = request.match_info.get("trial_id", "")
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        headers[FORWARDED_BY] = self.me
        try:
            upstream = await self._http.request(
                request.method,
                f"{target}{request.path_qs}",
                headers=headers,
                data=body,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("replica %s (owner of %s) does not answer: %s", target, trial_id, exc)
            raise ServiceUnavailableError(
                f"the replica that owns trial {trial_id} ({target}) does not answer; retry later",
                retry_after=self.retry_after_seconds,
                code="owner_unavailable",
            ) from None
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _NOT_FORWARDED:
                    response.headers.add(name, value)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
        return response

    async def ask(
        self, peer: str, path: str, request: web.Request, query: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        """GET ``path`` of replica ``peer``, answered by that replica alone, with the
        caller's credentials: its status and JSON body."""
        assert self._http is not None, "the cluster is not started"
        headers = {k: v for k, v in request.headers.items() if k.lower() in _CREDENTIALS}
        headers[FORWARDED_BY] = self.me
        try:
            async with self._http.get(
                f"{peer}{path}",
                params=query,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=_ASK_SECONDS),
            ) as response:
                return response.status, await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("replica %s does not answer %s: %s", peer, path, exc)
            raise ServiceUnavailableError(
                f"replica {peer} does not answer; retry later",
                retry_after=self.retry_after_seconds,
                code="replica_unavailable",
            ) from None

    async def gather(self, request: web.Request, query: Mapping[str, str]) -> list[Any]:
        """Every other replica's part of a list that spans them (``request``'s path,
        with ``query``): their JSON bodies. A replica that does not answer fails the
        whole list, since a partial one would read as sessions lost."""
        others = [peer for peer in self.peers if peer != self.me]
        answers = await asyncio.gather(*(self.ask(p, request.path, request, query) for p in others))
        for peer, (status, body) in zip(others, answers, strict=True):
            if status != 200:
                raise UpstreamError(
                    f"replica {peer} answered {status} for its part of the list: {str(body)[:300]}",
                    code="replica_error",
                )
        return [body for _, body in answers]


CLUSTER = web.AppKey("cluster", Cluster)


@web.middleware
async def forward_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Requests about a trial another replica owns go to that replica."""
    cluster = request.app.get(CLUSTER)
    trial_id = request.match_info.get("trial_id")
    if cluster is None or not trial_id:
        return await handler(request)
    target = cluster.owner_of(trial_id)
    if target is None:
        return await handler(request)
    sender = request.headers.get(FORWARDED_BY)
    if sender is not None:
        raise MisdirectedRequestError(
            f"{sender} forwarded trial {trial_id} here, but this replica's list makes "
            f"{target} its owner: the replicas' --peers lists differ",
            code="replica_lists_differ",
        )
    return await cluster.forward(request, target)


async def cluster_info(request: web.Request) -> web.Response:
    """This replica and the whole list: how clients find a trial's owner themselves."""
    cluster = request.app.get(CLUSTER)
    config = request.app[CONFIG]
    me = cluster.me if cluster is not None else (config.public_url or "")
    peers = list(cluster.peers) if cluster is not None else []
    return json_response({"self": me, "peers": peers})


def new_owned_trial_id(cluster: Cluster | None) -> str:
    """A fresh trial id this replica owns (about N draws for N replicas)."""
    while True:
        trial_id = shortuuid.uuid()
        if cluster is None or cluster.owns(trial_id):
            return trial_id


def setup_cluster(app: web.Application) -> None:
    config = app[CONFIG]
    app.router.add_get("/cluster", cluster_info)
    try:
        peers = validate_peers(config.public_url, config.peers)
    except ClusterError as exc:
        raise ConfigurationError(str(exc)) from None
    if not peers:
        return
    assert config.public_url is not None  # validate_peers insists on it
    cluster = Cluster(config.public_url, peers, retry_after_seconds=config.retry_after_seconds)
    app[CLUSTER] = cluster

    async def start(_: web.Application) -> None:
        await cluster.start()

    async def close(_: web.Application) -> None:
        await cluster.close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)
