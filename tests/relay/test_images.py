"""The image ledger: what a worker holds, what to send it and what to drop, decided without
I/O; and the pool sending each image once per worker, before the request that needs it."""

from __future__ import annotations

import asyncio

import pytest

from relay import protocol
from relay.images import ImageLedger, PromptImage
from relay.pool import WorkerHandle, WorkerId, WorkerPool
from tests.relay.test_pool import RecordingLink

SIZES = {"a": 40, "b": 30, "c": 50, "d": 10}


def test_an_image_is_sent_once_and_kept() -> None:
    """A second request with the same image sends nothing; a new image is sent alone."""
    ledger = ImageLedger(budget_bytes=1000)
    first = ledger.plan(["a", "b", "a"], SIZES)
    assert (first.drop, first.send) == ([], ["a", "b"])
    again = ledger.plan(["b", "a"], SIZES)
    assert (again.drop, again.send) == ([], [])
    more = ledger.plan(["a", "c"], SIZES)
    assert (more.drop, more.send) == ([], ["c"])
    assert ledger.held_bytes == 120
    assert "c" in ledger
    assert "d" not in ledger


def test_past_the_budget_the_least_recently_used_go_first() -> None:
    """Over the budget, images are dropped least recently used first (using one counts),
    until the new ones fit."""
    ledger = ImageLedger(budget_bytes=100)
    ledger.plan(["a"], SIZES)
    ledger.plan(["b"], SIZES)
    ledger.plan(["a"], SIZES)  # a is now more recent than b
    plan = ledger.plan(["c"], SIZES)  # 40 + 30 + 50 > 100: b goes, a stays
    assert (plan.drop, plan.send) == (["b"], ["c"])
    assert ledger.held_bytes == 90


def test_a_requests_own_images_are_never_dropped() -> None:
    """The images the request at hand uses stay, even when they alone pass the budget."""
    ledger = ImageLedger(budget_bytes=60)
    ledger.plan(["a"], SIZES)
    plan = ledger.plan(["a", "c", "d"], SIZES)
    assert (plan.drop, plan.send) == ([], ["c", "d"])
    assert ledger.held_bytes == 100
    plan = ledger.plan(["b"], SIZES)  # now the others go, oldest first, until b fits
    assert (plan.drop, plan.send) == (["a", "c"], ["b"])
    assert ledger.held_bytes == 40


def _image(sha: str, start: int, end: int) -> PromptImage:
    return PromptImage(sha * 64, sha.encode() * SIZES[sha], start, end)


async def _worker(pool: WorkerPool, wid: str, version: int) -> tuple[WorkerHandle, RecordingLink]:
    link = RecordingLink()
    endpoint = protocol.ProxyEndpoint()
    endpoint.state = protocol.ConnectionState.OPEN
    endpoint.version = version
    info = protocol.ModelInfo("vlm", 1024, "raw", "hf", {}, image_token_id=9)
    handle = WorkerHandle(WorkerId(wid), link, endpoint, {"vlm": info}, 4)
    await pool.add_worker(handle)
    return handle, link


async def test_the_pool_sends_each_image_once_per_worker_before_its_request() -> None:
    """The first request sends its images, then itself; a later one with the same image
    sends only what is new; the Generate names each image's span."""
    pool = WorkerPool(wait_seconds=1)
    _, link = await _worker(pool, "w1", protocol.PROTOCOL_VERSION)
    sampling = protocol.Sampling(max_tokens=2)
    await pool.start("vlm", list(range(12)), sampling, images=[_image("a", 2, 6)])
    await pool.start(
        "vlm", list(range(20)), sampling, images=[_image("a", 2, 6), _image("b", 10, 14)]
    )
    kinds = [type(m).__name__ for m in link.sent]
    assert kinds == ["Image", "Generate", "Image", "Generate"]
    first, second = link.sent[0], link.sent[2]
    assert isinstance(first, protocol.Image)
    assert isinstance(second, protocol.Image)
    assert (first.sha256, second.sha256) == ("a" * 64, "b" * 64)
    assert first.data == b"a" * 40
    request = link.sent[3]
    assert isinstance(request, protocol.Generate)
    assert request.images == [
        protocol.ImageRef("a" * 64, 2, 6),
        protocol.ImageRef("b" * 64, 10, 14),
    ]


async def test_a_worker_that_cannot_take_images_is_not_given_them() -> None:
    """An image request goes to a protocol 4 worker, never to an older one, which still
    takes text requests."""
    pool = WorkerPool(wait_seconds=1)
    _, old = await _worker(pool, "a-old", 3)
    _, new = await _worker(pool, "b-new", protocol.PROTOCOL_VERSION)
    sampling = protocol.Sampling(max_tokens=2)
    for _ in range(3):
        await pool.start("vlm", list(range(12)), sampling, images=[_image("a", 2, 6)])
    assert not any(isinstance(m, protocol.Image | protocol.Generate) for m in old.sent)
    assert sum(isinstance(m, protocol.Generate) for m in new.sent) == 3
    await pool.start("vlm", [1, 2, 3], sampling)
    assert any(isinstance(m, protocol.Generate) for m in old.sent)


async def test_no_image_worker_means_no_worker_available() -> None:
    """With only older workers an image request waits and then finds no worker."""
    from relay.exceptions import NoWorkerAvailableError

    pool = WorkerPool(wait_seconds=0.1)
    await _worker(pool, "old", 3)
    with pytest.raises(NoWorkerAvailableError):
        await pool.start(
            "vlm", list(range(12)), protocol.Sampling(max_tokens=2), images=[_image("a", 2, 6)]
        )


class YieldingLink(RecordingLink):
    """A link whose send lets other tasks run, as a socket's write may."""

    async def send(self, data: bytes) -> None:
        await asyncio.sleep(0)
        await super().send(data)


async def test_requests_sent_together_never_use_an_image_the_worker_lacks() -> None:
    """Two image requests dispatched at once to one worker, with a budget that makes the
    second drop the first's images: the frames the worker gets, replayed through its own
    endpoint, never name an image it does not hold (each request's images, drops and
    request go out together)."""
    pool = WorkerPool(wait_seconds=1)
    link = YieldingLink()
    endpoint = protocol.ProxyEndpoint()
    endpoint.state = protocol.ConnectionState.OPEN
    info = protocol.ModelInfo("vlm", 1024, "raw", "hf", {}, image_token_id=9)
    handle = WorkerHandle(WorkerId("w"), link, endpoint, {"vlm": info}, 4)
    handle.images = ImageLedger(budget_bytes=80)
    await pool.add_worker(handle)
    sampling = protocol.Sampling(max_tokens=2)
    await asyncio.gather(
        pool.start(
            "vlm", list(range(20)), sampling, images=[_image("a", 2, 6), _image("b", 8, 12)]
        ),
        pool.start("vlm", list(range(20)), sampling, images=[_image("c", 2, 6)]),
    )
    worker = protocol.WorkerEndpoint()
    worker.state = protocol.ConnectionState.OPEN
    for message in link.sent:
        worker.receive(protocol.encode(message))  # raises on an image it does not hold
    assert sum(isinstance(m, protocol.Generate) for m in link.sent) == 2


class GatedLink(RecordingLink):
    """A link whose image frames wait at a gate, as a socket's write waits on a slow
    worker: a frame is sent only once the gate opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def send(self, data: bytes) -> None:
        if isinstance(protocol.decode_proxy_message(data), protocol.Image):
            self.waiting.set()
            await self.gate.wait()
        await super().send(data)


def _replay(sent: list[protocol.ProxyMessage]) -> protocol.WorkerEndpoint:
    """The frames a worker got, through its own endpoint: raises on an image it lacks."""
    worker = protocol.WorkerEndpoint()
    worker.state = protocol.ConnectionState.OPEN
    worker.version = protocol.PROTOCOL_VERSION
    for message in sent:
        received = worker.receive(protocol.encode(message))
        if isinstance(received, protocol.Generate):
            assert all(ref.sha256 in worker.images for ref in received.images), received
    return worker


async def _gated_worker(pool: WorkerPool) -> tuple[WorkerHandle, GatedLink]:
    link = GatedLink()
    endpoint = protocol.ProxyEndpoint()
    endpoint.state = protocol.ConnectionState.OPEN
    info = protocol.ModelInfo("vlm", 1024, "raw", "hf", {}, image_token_id=9)
    handle = WorkerHandle(WorkerId("w"), link, endpoint, {"vlm": info}, 4)
    await pool.add_worker(handle)
    return handle, link


async def _settled(pool: WorkerPool) -> None:
    for _ in range(100):
        if not pool._background:
            return
        await asyncio.gather(*pool._background, return_exceptions=True)
    raise AssertionError("the pool's background work did not end")


async def test_a_hang_up_while_an_image_is_sent_keeps_the_worker_and_its_ledger_true() -> None:
    """A caller that leaves while its image is on the way to the worker: the frames go out
    whole and the request is cancelled on the worker; its slot comes free, and the next
    request with the same image finds the worker holding it."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _gated_worker(pool)
    sampling = protocol.Sampling(max_tokens=2)
    leaving = asyncio.create_task(
        pool.start("vlm", list(range(12)), sampling, images=[_image("a", 2, 6)])
    )
    await asyncio.wait_for(link.waiting.wait(), 5)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    link.gate.set()
    await _settled(pool)
    assert handle.in_flight == set()
    assert pool.in_flight == 0
    kinds = [type(m).__name__ for m in link.sent]
    assert kinds == ["Image", "Generate", "Cancel"]
    call = await pool.start("vlm", list(range(12)), sampling, images=[_image("a", 2, 6)])
    assert handle.in_flight == {call.request_id}
    worker = _replay(link.sent)
    assert worker.images == {"a" * 64} == handle.endpoint.images


async def test_a_hang_up_while_waiting_for_the_image_lock_gives_the_slot_back() -> None:
    """A caller that leaves while another request's images hold the worker's image lock
    sends nothing and gives its slot back; the worker's ledger is unchanged by it."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _gated_worker(pool)
    sampling = protocol.Sampling(max_tokens=2)
    first = asyncio.create_task(
        pool.start("vlm", list(range(12)), sampling, images=[_image("a", 2, 6)])
    )
    await asyncio.wait_for(link.waiting.wait(), 5)
    leaving = asyncio.create_task(
        pool.start("vlm", list(range(12)), sampling, images=[_image("b", 2, 6)])
    )
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(handle.in_flight) == 2  # both hold a slot; the second waits for the lock
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert len(handle.in_flight) == 1
    link.gate.set()
    call = await asyncio.wait_for(first, 5)
    await _settled(pool)
    assert handle.in_flight == {call.request_id}
    assert [type(m).__name__ for m in link.sent] == ["Image", "Generate"]
    assert "b" * 64 not in handle.images
    _replay(link.sent)


async def test_a_worker_that_lacks_an_image_gets_it_again() -> None:
    """A worker that answers a request with ``image_missing``: the pool tells it to drop
    the request's images, sends them again and re-sends the request, on the same worker."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _worker(pool, "w", protocol.PROTOCOL_VERSION)
    call = await pool.start(
        "vlm", list(range(12)), protocol.Sampling(max_tokens=2), images=[_image("a", 2, 6)]
    )
    refusal = protocol.Error(protocol.IMAGE_MISSING, "not held", call.request_id)
    await pool.handle_message(handle, handle.endpoint.receive(protocol.encode(refusal)))
    await _settled(pool)
    kinds = [type(m).__name__ for m in link.sent]
    assert kinds == ["Image", "Generate", "ImageDrop", "Image", "Generate"]
    assert handle.in_flight == {call.request_id}
    assert handle.images.held_bytes == SIZES["a"]
    drop = link.sent[2]
    assert isinstance(drop, protocol.ImageDrop)
    assert drop.sha256s == ["a" * 64]
