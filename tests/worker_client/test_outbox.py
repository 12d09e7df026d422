"""The worker's outbox: chunks waiting together leave as one frame, per-request order is
kept, and the sender writes what is ready without waiting for more."""

from __future__ import annotations

import asyncio

import pytest

from relay import protocol
from worker_client.outbox import Outbox


def _open_pair(
    version: int = protocol.PROTOCOL_VERSION,
) -> tuple[protocol.WorkerEndpoint, protocol.ProxyEndpoint]:
    """A worker endpoint and the proxy endpoint it talks to, both past the handshake."""
    worker, proxy = protocol.WorkerEndpoint(), protocol.ProxyEndpoint()
    hello = protocol.Hello(version, "w", "t", [])
    proxy.receive(worker.hello(hello))
    worker.receive(proxy.accept(5.0))
    return worker, proxy


def _start(worker: protocol.WorkerEndpoint, proxy: protocol.ProxyEndpoint, rid: str) -> None:
    sampling = protocol.Sampling(max_tokens=8)
    worker.receive(proxy.generate(protocol.Generate(rid, "m", b"", sampling)))


def _decode(proxy: protocol.ProxyEndpoint, frames: list[bytes]) -> list[protocol.WorkerMessage]:
    """The messages of ``frames``, a batch's frames in its place."""
    out: list[protocol.WorkerMessage] = []
    for frame in frames:
        message = proxy.receive(frame)
        out.extend(message.frames if isinstance(message, protocol.Batch) else [message])
    return out


def test_what_several_requests_have_waiting_leaves_as_one_batch() -> None:
    """One engine step's tokens for every running request: one WebSocket message."""
    worker, proxy = _open_pair()
    for rid in ("r1", "r2", "r3"):
        _start(worker, proxy, rid)
    box = Outbox(worker)
    box.tokens("r1", [1], [-0.1])
    box.tokens("r2", [2], [-0.2])
    box.finish(protocol.Done("r3", "stop", protocol.pack_ids([3]), protocol.pack_logprobs([-0.3])))
    box.control(protocol.encode(protocol.Pong(1)))
    pong, batch = (proxy.receive(f) for f in box.take())
    assert pong == protocol.Pong(1)
    assert isinstance(batch, protocol.Batch)
    assert [(type(f).__name__, f.request_id) for f in batch.frames] == [
        ("Delta", "r1"),
        ("Delta", "r2"),
        ("Done", "r3"),
    ]
    assert worker.in_flight == proxy.in_flight == {"r1", "r2"}


def test_a_proxy_of_version_1_gets_one_message_per_request() -> None:
    """A worker welcomed in version 1 never sends a batch (that proxy cannot read one)."""
    worker, proxy = _open_pair(version=1)
    assert worker.version == proxy.version == 1
    for rid in ("r1", "r2"):
        _start(worker, proxy, rid)
    box = Outbox(worker)
    box.tokens("r1", [1], [-0.1])
    box.tokens("r2", [2], [-0.2])
    frames = box.take()
    assert len(frames) == 2
    assert [type(proxy.receive(f)).__name__ for f in frames] == ["Delta", "Delta"]


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
