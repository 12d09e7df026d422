"""What a worker's connection has yet to send, and the one task that sends it.

Requests hand their token chunks and final messages to the ``Outbox`` without waiting; a
single sender task writes them to the WebSocket. Chunks of one request that are waiting
together leave as one ``Delta`` (and a ``Done`` takes the tokens still waiting as its
tail), so when the engine produces faster than the connection sends, frames get fewer and
larger instead of queueing one per token; and what every request has waiting leaves as one
``Batch`` message (an engine step's tokens for all its requests are one WebSocket frame).
Nothing is held back to wait for more: a chunk that arrives while the sender is idle goes
out on the next turn of the event loop.

Within a request, order is kept: its tokens are sent before its ``Done`` or ``Error``.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from relay import protocol


@dataclass(slots=True)
class _Waiting:
    ids: array[int] = field(default_factory=lambda: array("i"))
    logprobs: array[float] = field(default_factory=lambda: array("f"))
    final: protocol.Done | protocol.Error | None = None


class Outbox:
    """Frames to send on one worker connection (create one per connection)."""

    def __init__(self, endpoint: protocol.WorkerEndpoint) -> None:
        self._endpoint = endpoint
        self._waiting: dict[str, _Waiting] = {}
        self._control: list[bytes] = []
        self._ready = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Outbox requests={len(self._waiting)} control={len(self._control)}>"

    def tokens(self, request_id: str, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Tokens a request sampled since its previous chunk."""
        if not ids:
            return
        waiting = self._waiting.get(request_id)
        if waiting is None:
            waiting = self._waiting[request_id] = _Waiting()
        waiting.ids.extend(ids)
        waiting.logprobs.extend(logprobs)
        self._ready.set()

    def finish(self, message: protocol.Done | protocol.Error) -> None:
        """A request's last message; it goes out after the request's waiting tokens."""
        assert message.request_id is not None
        waiting = self._waiting.get(message.request_id)
        if waiting is None:
            waiting = self._waiting[message.request_id] = _Waiting()
        waiting.final = message
        self._ready.set()

    def discard(self, request_id: str) -> None:
        """Drop what a cancelled request had waiting: the proxy no longer wants it."""
        self._waiting.pop(request_id, None)

    def control(self, frame: bytes) -> None:
        """A frame about the connection (a Pong), sent before request frames."""
        self._control.append(frame)
        self._ready.set()

    def take(self) -> list[bytes]:
        """Every frame waiting now, encoded, in the order to send them: control frames,
        then every request's frames (one ``Batch`` when the proxy takes batches)."""
        control, self._control = self._control, []
        waiting, self._waiting = self._waiting, {}
        frames: list[protocol.RequestFrame] = []
        for request_id, item in waiting.items():
            final = item.final
            if isinstance(final, protocol.Done):
                if item.ids:
                    final = msgspec.structs.replace(
                        final,
                        token_ids=protocol.pack_ids(item.ids) + final.token_ids,
                        logprobs=protocol.pack_logprobs(item.logprobs) + final.logprobs,
                    )
                frames.append(final)
                continue
            if item.ids:
                frames.append(
                    protocol.Delta(
                        request_id,
                        protocol.pack_ids(item.ids),
                        protocol.pack_logprobs(item.logprobs),
                    )
                )
            if final is not None:
                frames.append(final)
        return control + self._endpoint.send_frames(frames) if frames else control

    async def run(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send frames as they become ready, until cancelled or ``send`` fails."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            for frame in self.take():
                await send(frame)
