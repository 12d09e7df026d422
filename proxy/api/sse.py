"""Server-sent events, written as tokens arrive (every API streams through this).

Events are queued with ``emit`` and leave together with ``flush``: the events one engine
step produces (a delta, or a block's end and the next one's start) reach the socket as
one write. Once the response has begun, ``flush_now`` writes without waiting, from code
that cannot await (the relay delivering a step's tokens): it does so only while the
socket takes data at once, and otherwise leaves the events to the next ``flush``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, TypeVar

import msgspec
from aiohttp import web

_encode = msgspec.json.encode

E = TypeVar("E")


class EventStream:
    def __init__(self, response: web.StreamResponse, transport: asyncio.Transport | None) -> None:
        self.response = response
        self._pending: list[bytes] = []
        # The socket, for writes that do not wait; None where framing is not ours to
        # write (an HTTP/1.0 client reads to the connection's end, without chunks).
        self._transport = transport
        self._started = False  # the head and a first chunk went out through aiohttp

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
        chunked = request.version >= (1, 1)
        if chunked:
            response.enable_chunked_encoding()
        await response.prepare(request)
        return cls(response, request.transport if chunked else None)

    def emit(self, payload: object, event: str | None = None) -> None:
        """Queue one event; it is written by the next flush."""
        head = b"event: " + event.encode() + b"\n" if event else b""
        self._pending.append(head + b"data: " + _encode(payload) + b"\n\n")

    def emit_raw(self, data: bytes) -> None:
        self._pending.append(b"data: " + data + b"\n\n")

    async def flush(self) -> None:
        """Write what was queued, waiting for the client if its socket is full."""
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            await self.response.write(data)
            self._started = True

    def writable_now(self) -> bool:
        """Whether ``flush_now`` would write at once: the response has begun, nothing is
        queued, and the socket has no backlog (a client that reads slowly is waited for
        by ``flush`` instead)."""
        transport = self._transport
        return (
            self._started
            and not self._pending
            and transport is not None
            and not transport.is_closing()
            and not transport.get_write_buffer_size()
        )

    def flush_now(self) -> None:
        """Write what was queued as one chunk, without waiting; only after
        ``writable_now()`` said so."""
        if self._pending and self._transport is not None:
            data = b"".join(self._pending)
            self._pending.clear()
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def close(self) -> web.StreamResponse:
        """Write what is queued and end the response (one write for both)."""
        data = b"".join(self._pending)
        self._pending.clear()
        await self.response.write_eof(data)
        return self.response


class StreamSink(ABC, Generic[E]):
    """An API's writer as the relay sees it: it queues the events one step makes on its
    event stream, and writes them at once when the stream can take them."""

    stream: EventStream

    @abstractmethod
    def queue(self, event: E) -> None:
        """Queue the stream events of one of the turn's events."""

    def writable_now(self) -> bool:
        return self.stream.writable_now()

    def write_now(self, events: Sequence[E]) -> None:
        for event in events:
            self.queue(event)
        self.stream.flush_now()
