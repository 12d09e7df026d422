"""Server-sent events, written as tokens arrive (every API streams through this)."""

from __future__ import annotations

import msgspec
from aiohttp import web

_encode = msgspec.json.encode


class EventStream:
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> EventStream:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies in front must not buffer the stream
            },
        )
        await response.prepare(request)
        return cls(response)

    async def send(self, payload: object, event: str | None = None) -> None:
        head = b"event: " + event.encode() + b"\n" if event else b""
        await self.response.write(head + b"data: " + _encode(payload) + b"\n\n")

    async def send_raw(self, data: bytes) -> None:
        await self.response.write(b"data: " + data + b"\n\n")

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response
