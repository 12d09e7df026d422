"""An HTTP front that stands between the SDK and a real proxy and forwards every request,
except that chosen ones meet a network fault instead: the connection dropped without an
answer, a load balancer's HTML error page, or no answer at all (the client times out)."""

from __future__ import annotations

import asyncio
import enum
import re
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}

HTML_502 = (
    "<html><head><title>502 Bad Gateway</title></head>"
    "<body><center><h1>502 Bad Gateway</h1></center><hr><center>nginx</center></body></html>"
)


class Fault(enum.Enum):
    RESET = "reset"  # the connection is closed with no answer
    HTML = "html"  # 502 with an HTML page, as nginx or a cloud load balancer sends
    HANG = "hang"  # no answer until the front stops


def route_of(method: str, path: str) -> str:
    """``POST /sessions/<id>/complete``: the path with the trial id taken out."""
    return f"{method} " + re.sub(r"^/sessions/[^/]+", "/sessions/<id>", path)


@dataclass(slots=True)
class FaultyFront:
    upstream: str
    fault: Fault
    route: str  # which requests meet the fault, e.g. "POST /sessions/<id>/complete"
    times: int  # how many of them (then they are forwarded)
    seen: Counter[str] = field(default_factory=Counter)  # requests that arrived, per route
    faulted: int = 0
    _runner: web.AppRunner | None = None
    _client: aiohttp.ClientSession | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self._client = aiohttp.ClientSession()
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        self._stopping.set()
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        route = route_of(request.method, request.path)
        self.seen[route] += 1
        body = await request.read()
        if route == self.route and self.faulted < self.times:
            self.faulted += 1
            if self.fault is Fault.RESET:
                assert request.transport is not None
                request.transport.abort()
                return web.Response(status=500)  # never sent: the connection is gone
            if self.fault is Fault.HTML:
                return web.Response(status=502, text=HTML_502, content_type="text/html")
            await self._stopping.wait()
            return web.Response(status=504)
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._client.request(
            request.method, f"{self.upstream}{request.path_qs}", data=body, headers=headers
        ) as answer:
            payload = await answer.read()
            return web.Response(
                status=answer.status,
                body=payload,
                content_type=answer.content_type,
            )
