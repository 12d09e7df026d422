"""Teacher forcing through the pool: who gets a score request, what comes back, and a
teacher's worker left out of weight updates.

The transport is an in-memory link that records frames; the pool and protocol are real.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from relay import protocol
from relay.exceptions import NoWorkerAvailableError, RelayError, WorkerFailedError
from relay.images import PromptImage
from relay.pool import WorkerHandle, WorkerId, WorkerPool, WorkerState, serves_policy
from relay.scoring import score
from relay.weights import WeightSync


class RecordingLink:
    def __init__(self) -> None:
        self.sent: list[protocol.ProxyMessage] = []

    async def send(self, data: bytes) -> None:
        self.sent.append(protocol.decode_proxy_message(data))

    async def close(self, reason: str) -> None:
        pass


async def _add(
    pool: WorkerPool,
    wid: str,
    *,
    teacher: bool = True,
    version: int = protocol.PROTOCOL_VERSION,
    policy_version: int = 0,
) -> tuple[WorkerHandle, RecordingLink]:
    link = RecordingLink()
    endpoint = protocol.ProxyEndpoint()
    endpoint.state = protocol.ConnectionState.OPEN
    endpoint.version = version
    name = "teacher" if teacher else "tiny"
    info = protocol.ModelInfo(name, 1024, "raw", "hf", {}, teacher=teacher)
    handle = WorkerHandle(WorkerId(wid), link, endpoint, {name: info}, 4, version=policy_version)
    await pool.add_worker(handle)
    return handle, link


async def _sent(link: RecordingLink, count: int = 1) -> protocol.Score:
    for _ in range(200):
        scores = [m for m in link.sent if isinstance(m, protocol.Score)]
        if len(scores) >= count:
            return scores[count - 1]
        await asyncio.sleep(0.005)
    raise AssertionError("no score request was sent")


def _scored(rid: str, ids: list[int], logprobs: list[float]) -> protocol.Done:
    return protocol.Done(
        rid, protocol.SCORED, protocol.pack_ids(ids), protocol.pack_logprobs(logprobs)
    )


async def _serve(pool: WorkerPool, handle: WorkerHandle, message: protocol.WorkerMessage) -> None:
    await pool.handle_message(handle, handle.endpoint.receive(protocol.encode(message)))


async def test_a_score_request_returns_the_logprobs_of_the_ids_asked() -> None:
    """A score request goes out as ``Score`` with its ids, start and images (sent first),
    and its scored ``Done`` gives the logprobs of ``ids[start:]``."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _add(pool, "t1")
    image = PromptImage("ab" * 32, b"png", 1, 3)
    task = asyncio.create_task(score(pool, "teacher", [1, 9, 9, 4, 5], 3, images=[image]))
    sent = await _sent(link)
    assert isinstance(link.sent[0], protocol.Image)
    assert protocol.unpack_ids(sent.ids) == [1, 9, 9, 4, 5]
    assert sent.start == 3
    assert sent.images == [protocol.ImageRef("ab" * 32, 1, 3)]
    await _serve(pool, handle, _scored(sent.request_id, [4, 5], [-0.5, -1.25]))
    assert await asyncio.wait_for(task, 1) == [-0.5, -1.25]
    assert handle.in_flight == set()


async def test_scores_of_other_ids_or_a_failure_are_errors() -> None:
    """A worker that scores other ids than asked, or fails the request, fails the call:
    never logprobs misaligned with the ids."""
    pool = WorkerPool(wait_seconds=1)
    handle, link = await _add(pool, "t1")
    task = asyncio.create_task(score(pool, "teacher", [1, 2, 3], 1))
    sent = await _sent(link)
    await _serve(pool, handle, _scored(sent.request_id, [2, 7], [-1.0, -1.0]))
    with pytest.raises(WorkerFailedError, match="not the 2 asked"):
        await asyncio.wait_for(task, 1)
    task = asyncio.create_task(score(pool, "teacher", [1, 2, 3], 1))
    sent = await _sent(link, 2)
    await _serve(pool, handle, protocol.Error("engine_error", "boom", sent.request_id))
    with pytest.raises(WorkerFailedError, match="boom"):
        await asyncio.wait_for(task, 1)


async def test_a_score_request_waits_for_a_worker_that_speaks_protocol_6() -> None:
    """A worker of an older protocol is never sent a score request: without another, the
    request fails for want of a worker."""
    pool = WorkerPool(wait_seconds=0.1)
    _, link = await _add(pool, "old", version=protocol.SCORING_VERSION - 1)
    with pytest.raises(NoWorkerAvailableError):
        await score(pool, "teacher", [1, 2, 3], 1)
    assert link.sent == []


async def test_a_lost_worker_s_score_request_runs_again_elsewhere() -> None:
    """The worker scoring a request leaves: the request goes to another worker and its
    answer is what the caller gets."""
    pool = WorkerPool(wait_seconds=1)
    first, first_link = await _add(pool, "t1")
    task = asyncio.create_task(score(pool, "teacher", [1, 2, 3], 2))
    await _sent(first_link)
    second, second_link = await _add(pool, "t2")
    await pool.remove_worker(first, "gone")
    sent = await _sent(second_link)
    await _serve(pool, second, _scored(sent.request_id, [3], [-2.0]))
    assert await asyncio.wait_for(task, 1) == [-2.0]


async def test_a_teacher_s_worker_keeps_its_weights() -> None:
    """A worker of teachers alone serves at once behind the pool's version, and a weight
    update leaves it out; a policy's worker behind it waits to load the weights."""
    pool = WorkerPool(wait_seconds=1)
    pool.version = 3
    teacher, teacher_link = await _add(pool, "t1")
    assert not serves_policy(teacher)
    assert teacher.state is WorkerState.SERVING
    policy, _ = await _add(pool, "p1", teacher=False, policy_version=3)
    assert serves_policy(policy)
    sync = WeightSync(pool, phase_seconds=0.5)
    updating = asyncio.create_task(sync.update(4))
    await asyncio.sleep(0.05)
    assert teacher.state is WorkerState.SERVING
    assert policy.state is WorkerState.UPDATING
    assert not any(isinstance(m, protocol.Pause) for m in teacher_link.sent)
    await sync.close()  # the update is rolled back
    with contextlib.suppress(asyncio.CancelledError, RelayError):
        await updating


async def test_scoring_from_the_first_id_is_refused_before_anything_is_sent() -> None:
    """A request that would score the first id (it has no logprob) or nothing is refused
    at once: no frame reaches a worker, whose connection it would end."""
    pool = WorkerPool(wait_seconds=1)
    _, link = await _add(pool, "t1")
    for start in (0, 3):
        with pytest.raises(ValueError, match="the first id has no logprob"):
            await score(pool, "teacher", [1, 2, 3], start)
    assert link.sent == []
