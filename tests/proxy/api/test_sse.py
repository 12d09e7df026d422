"""The event stream every API streams through: queued events leave together, and once
the response has begun they can be written without waiting, as valid chunked HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import ClientError, web
from aiohttp.test_utils import TestClient, TestServer

from proxy.api.sse import EventStream


class _CountingTransport:
    """Counts writes on the response's socket (the real transport does the writing)."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport = transport
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def test_queued_events_leave_in_one_write_and_later_ones_without_waiting() -> None:
    checks: dict[str, object] = {}
    writes: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = await EventStream.open(request)
        checks["before_start"] = stream.writable_now()
        stream.emit({"n": 1}, event="a")
        stream.emit({"n": 2}, event="b")
        await stream.flush()
        assert stream._transport is not None
        stream._transport = _CountingTransport(stream._transport, writes)  # type: ignore[assignment]
        checks["started"] = stream.writable_now()
        stream.emit({"n": 3})
        checks["with_queued"] = stream.writable_now()
        stream.flush_now()
        stream.emit({"n": 4})
        stream.flush_now()
        stream.emit_raw(b"[DONE]")
        return await stream.close()

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/")
        body = await response.text()
    assert response.headers["Content-Type"] == "text/event-stream"
    assert body == (
        'event: a\ndata: {"n":1}\n\n'
        'event: b\ndata: {"n":2}\n\n'
        'data: {"n":3}\n\n'
        'data: {"n":4}\n\n'
        "data: [DONE]\n\n"
    )
    assert checks == {"before_start": False, "started": True, "with_queued": False}
    # flush_now wrote each event as its own chunk, directly on the socket.
    assert writes == [b'f\r\ndata: {"n":3}\n\n\r\n', b'f\r\ndata: {"n":4}\n\n\r\n']


async def test_an_http_1_0_client_is_never_written_to_without_waiting() -> None:
    """Without chunked framing the stream is the connection's body: only aiohttp writes
    it."""
    seen: dict[str, bool] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = await EventStream.open(request)
        stream.emit({"n": 1})
        await stream.flush()
        seen["writable"] = stream.writable_now()
        return await stream.close()

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestServer(app) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head
    assert body == b'data: {"n":1}\n\n'
    assert seen == {"writable": False}


async def test_a_socket_with_a_backlog_is_left_to_the_waiting_writer() -> None:
    """A client that reads slowly (data still buffered for its socket) is not written to
    without waiting: the stream's own flush waits for it instead."""
    seen: dict[str, bool] = {}

    class Backlogged(_CountingTransport):
        def get_write_buffer_size(self) -> int:
            return 1

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = await EventStream.open(request)
        stream.emit({"n": 1})
        await stream.flush()
        seen["free"] = stream.writable_now()
        real = stream._transport
        stream._transport = Backlogged(real, [])  # type: ignore[assignment]
        seen["backlog"] = stream.writable_now()
        stream._transport = real
        real.close()
        seen["closing"] = stream.writable_now()
        return stream.response

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestClient(TestServer(app)) as client:
        # The handler closed the connection mid-body.
        with contextlib.suppress(ClientError):
            await (await client.get("/")).read()
    assert seen == {"free": True, "backlog": False, "closing": False}
