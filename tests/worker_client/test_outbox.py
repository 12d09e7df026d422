"""The worker's outbox: chunks waiting together leave as one frame, per-request order is
kept, and the sender writes what is ready without waiting for more."""

from __future__ import annotations

import asyncio

import pytest

from relay import protocol
from worker_client.outbox import Outbox


def _open_pair() -> tuple[protocol.WorkerEndpoint, protocol.ProxyEndpoint]:
    """A worker endpoint and the proxy endpoint it talks to, both past the handshake."""
    worker, proxy = protocol.WorkerEndpoint(), protocol.ProxyEndpoint()
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "w", "t", [])
    proxy.receive(worker.hello(hello))
    worker.receive(proxy.accept(5.0))
    return worker, proxy


def _start(worker: protocol.WorkerEndpoint, proxy: protocol.ProxyEndpoint, rid: str) -> None:
    sampling = protocol.Sampling(max_tokens=8)
    worker.receive(proxy.generate(protocol.Generate(rid, "m", b"", sampling)))


def _decode(proxy: protocol.ProxyEndpoint, frames: list[bytes]) -> list[protocol.WorkerMessage]:
    return [proxy.receive(f) for f in frames]


def test_chunks_waiting_together_become_one_delta() -> None:
    worker, proxy = _open_pair()
    _start(worker, proxy, "r1")
    box = Outbox(worker)
    box.tokens("r1", [1, 2], [-0.5, -0.25])
    box.tokens("r1", [3], [-1.0])
    [delta] = _decode(proxy, box.take())
    assert isinstance(delta, protocol.Delta)
    assert protocol.unpack_ids(delta.token_ids) == [1, 2, 3]
    assert protocol.unpack_logprobs(delta.logprobs) == [-0.5, -0.25, -1.0]
    assert box.take() == []


def test_done_takes_the_waiting_tokens_as_its_tail() -> None:
    worker, proxy = _open_pair()
    _start(worker, proxy, "r1")
    box = Outbox(worker)
    box.tokens("r1", [4, 5], [-1.0, -2.0])
    box.finish(
        protocol.Done(
            "r1", "stop", protocol.pack_ids([6]), protocol.pack_logprobs([-3.0]), {"v": 2}
        )
    )
    [done] = _decode(proxy, box.take())
    assert isinstance(done, protocol.Done)
    assert protocol.unpack_ids(done.token_ids) == [4, 5, 6]
    assert protocol.unpack_logprobs(done.logprobs) == [-1.0, -2.0, -3.0]
    assert done.extra == {"v": 2}
    assert worker.in_flight == set()
    assert proxy.in_flight == set()


def test_an_error_follows_the_tokens_sampled_before_it() -> None:
    worker, proxy = _open_pair()
    _start(worker, proxy, "r1")
    _start(worker, proxy, "r2")
    box = Outbox(worker)
    box.tokens("r1", [7], [-0.1])
    box.tokens("r2", [8], [-0.2])
    box.finish(protocol.Error("engine_error", "boom", "r1"))
    messages = _decode(proxy, box.take())
    kinds = [(type(m).__name__, getattr(m, "request_id", None)) for m in messages]
    assert kinds == [("Delta", "r1"), ("Error", "r1"), ("Delta", "r2")]
    assert proxy.in_flight == {"r2"}


def test_discard_drops_a_cancelled_requests_tokens_and_control_frames_go_first() -> None:
    worker, proxy = _open_pair()
    _start(worker, proxy, "r1")
    box = Outbox(worker)
    box.tokens("r1", [1], [-1.0])
    box.tokens("r1", [], [])  # nothing sampled: nothing to send
    box.discard("r1")
    box.control(protocol.encode(protocol.Pong(3)))
    assert _decode(proxy, box.take()) == [protocol.Pong(3)]


async def test_the_sender_writes_each_chunk_once_it_is_ready() -> None:
    worker, proxy = _open_pair()
    _start(worker, proxy, "r1")
    box = Outbox(worker)
    sent: list[bytes] = []
    wrote = asyncio.Event()

    async def send(frame: bytes) -> None:
        sent.append(frame)
        wrote.set()

    sender = asyncio.create_task(box.run(send))
    try:
        box.tokens("r1", [1], [-1.0])
        await asyncio.wait_for(wrote.wait(), 5)
        wrote.clear()
        box.tokens("r1", [2], [-1.0])
        await asyncio.wait_for(wrote.wait(), 5)
    finally:
        sender.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sender
    deltas = _decode(proxy, sent)
    assert all(isinstance(m, protocol.Delta) for m in deltas)
    ids = [protocol.unpack_ids(getattr(m, "token_ids", b"")) for m in deltas]
    assert ids == [[1], [2]]
