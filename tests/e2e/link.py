"""A faulty network hop for end-to-end tests: a TCP relay between an agent and the proxy
that drops a connection on cue (before or after the proxy's reply), so the official
clients and the agent CLIs retry as they do on a real network."""

from __future__ import annotations

import asyncio
import contextlib


def _response_complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole HTTP response (Content-Length or chunked)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    headers = head.lower()
    if b"transfer-encoding: chunked" in headers:
        return body.endswith(b"0\r\n\r\n")
    for line in headers.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


class Link:
    """A TCP hop between an agent and the proxy that drops a connection on cue: each new
    connection takes the next plan (``pass`` once they run out). ``before``: the request
    goes through and the connection is closed while the reply is being sampled. ``after``:
    the proxy's whole reply is read and thrown away, then the connection is closed."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.plans: list[str] = []
        self.server: asyncio.Server | None = None
        self.port = 0
        self.serving: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self.serving:
            task.cancel()
        await asyncio.gather(*self.serving, return_exceptions=True)

    def url(self, base_url: str) -> str:
        return base_url.replace(f":{self.upstream_port}/", f":{self.port}/", 1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.serving.add(task)
        # Stopping the link cancels its connections: that is their normal end, not an error
        # for the server's callback to report.
        with contextlib.suppress(asyncio.CancelledError):
            await self._relay(reader, writer)
        self.serving.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        plan = self.plans.pop(0) if self.plans else "pass"
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        forward = asyncio.create_task(_pipe(reader, up_writer))
        try:
            if plan == "pass":
                await _pipe(up_reader, writer)
            elif plan == "before":
                await asyncio.sleep(0.15)  # the request is in; the reply is being sampled
            else:
                seen = b""
                while not _response_complete(seen):
                    chunk = await up_reader.read(65536)
                    if not chunk:
                        break
                    seen += chunk
        finally:
            forward.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await forward
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
