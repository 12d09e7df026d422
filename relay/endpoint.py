"""The proxy's WebSocket endpoint that workers dial into (``GET /ws/worker``).

A thin driver around ``protocol.ProxyEndpoint``: it moves frames between the aiohttp
socket and the pool. Transport liveness uses aiohttp's built-in heartbeat (WebSocket
ping/pong frames): a worker that stops answering is closed and its requests re-dispatched.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import WSMsgType, web

from relay import protocol
from relay.exceptions import ProtocolError
from relay.pool import WorkerHandle, WorkerId, WorkerPool

log = logging.getLogger(__name__)

# Called with the worker's hello before it joins the pool; raises AdmissionRefused to refuse.
AdmitHook = Callable[[protocol.Hello], Awaitable[None]]


class AdmissionRefused(Exception):
    """Raised by an admission hook to refuse a worker (the message is sent to it)."""


@dataclass(slots=True)
class WorkerSocketConfig:
    token: str | None  # None: no authentication (local development only)
    heartbeat_seconds: float = 10.0
    hello_timeout_seconds: float = 30.0
    max_frame_bytes: int = 256 * 1024 * 1024  # hello frames carry tokenizer files


class _AiohttpLink:
    def __init__(self, ws: web.WebSocketResponse) -> None:
        self._ws = ws
        self._lock = asyncio.Lock()

    async def send(self, data: bytes) -> None:
        async with self._lock:
            await self._ws.send_bytes(data)

    async def close(self, reason: str) -> None:
        await self._ws.close(message=reason.encode()[:120])


def token_matches(expected: str | None, given: str) -> bool:
    """Constant-time token check; no token configured means open access."""
    if expected is None:
        return True
    return hmac.compare_digest(expected.encode(), given.encode())


def make_worker_socket_handler(
    pool: WorkerPool, config: WorkerSocketConfig, admit: AdmitHook
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(
            heartbeat=config.heartbeat_seconds, max_msg_size=config.max_frame_bytes
        )
        await ws.prepare(request)
        endpoint = protocol.ProxyEndpoint()
        link = _AiohttpLink(ws)

        async def refuse(code: str, message: str) -> web.WebSocketResponse:
            await link.send(protocol.encode(protocol.Error(code, message)))
            await ws.close()
            return ws

        try:
            first = await ws.receive(timeout=config.hello_timeout_seconds)
        except TimeoutError:
            return await refuse("hello_timeout", "no hello received")
        if first.type is not WSMsgType.BINARY:
            return await refuse("bad_frame", "expected a binary hello frame")
        try:
            hello = endpoint.receive(first.data)
        except ProtocolError as exc:
            return await refuse("protocol_error", str(exc))
        assert isinstance(hello, protocol.Hello)
        if not token_matches(config.token, hello.token):
            log.warning("refused worker %s: bad token", hello.worker_id)
            return await refuse("unauthorized", "invalid worker token")
        if not hello.models:
            return await refuse("no_models", "a worker must announce at least one model")
        try:
            await admit(hello)
        except AdmissionRefused as exc:
            return await refuse("refused", str(exc))

        handle = WorkerHandle(
            worker_id=WorkerId(hello.worker_id),
            link=link,
            endpoint=endpoint,
            models={m.name: m for m in hello.models},
            max_concurrency=max(1, hello.max_concurrency),
            version=hello.policy_version,
            weights_path=hello.weights_path,
        )
        await link.send(endpoint.accept(config.heartbeat_seconds))
        await pool.add_worker(handle)
        reason = "connection closed"
        try:
            async for frame in ws:
                if frame.type is not WSMsgType.BINARY:
                    reason = f"unexpected {frame.type.name} frame"
                    break
                try:
                    message = endpoint.receive(frame.data)
                except ProtocolError as exc:
                    reason = f"protocol error: {exc}"
                    await link.send(protocol.encode(protocol.Error("protocol_error", str(exc))))
                    break
                await pool.handle_message(handle, message)
        finally:
            evicted = isinstance(ws.exception(), TimeoutError)
            if evicted:
                # aiohttp closed the socket: no pong came back within half a heartbeat.
                reason = f"evicted: missed heartbeat ({ws.exception()})"
            await pool.remove_worker(handle, reason, evicted=evicted)
            if not ws.closed:
                await ws.close()
        return ws

    return handle
