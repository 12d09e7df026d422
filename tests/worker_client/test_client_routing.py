"""Routing through the worker's connection: the hello announces a mixture-of-experts
model's routing shape (protocol 5), a Generate's ``routed_experts_from`` reaches the engine,
and the rows it gives ride in the request's Done; a dense model's hello names none."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from relay import protocol
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel, WorkerClient
from worker_client.routing import unpack_rows
from worker_client.tiny_moe import SHIPPED_TINY_MOE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


async def test_hello_announces_routing_and_done_carries_the_rows(tiny_model_dir: Path) -> None:
    moe = HFEngine.load(SHIPPED_TINY_MOE, name="moe")
    dense = HFEngine.load(tiny_model_dir, name="dense")
    hello: list[protocol.Hello] = []
    done: asyncio.Future[protocol.Done] = asyncio.get_running_loop().create_future()
    sampled: list[int] = []

    async def proxy(ws: ServerConnection) -> None:
        endpoint = protocol.ProxyEndpoint()
        message = endpoint.receive(bytes(await ws.recv()))
        assert isinstance(message, protocol.Hello)
        hello.append(message)
        await ws.send(endpoint.accept(20.0))
        await ws.send(
            endpoint.generate(
                protocol.Generate(
                    "r1",
                    "moe",
                    protocol.pack_ids([1, 2, 3, 4, 5]),
                    protocol.Sampling(max_tokens=4, seed=1),
                    routed_experts_from=2,
                )
            )
        )
        async for data in ws:
            frame = endpoint.receive(bytes(data))
            frames = frame.frames if isinstance(frame, protocol.Batch) else [frame]
            for item in frames:
                if isinstance(item, protocol.Delta | protocol.Done):
                    sampled.extend(protocol.unpack_ids(item.token_ids))
                if isinstance(item, protocol.Done | protocol.Error):
                    assert isinstance(item, protocol.Done), item
                    done.set_result(item)
                    return

    async with serve(proxy, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        client = WorkerClient(
            f"ws://127.0.0.1:{port}",
            {
                "moe": ServedModel(moe, SHIPPED_TINY_MOE),
                "dense": ServedModel(dense, tiny_model_dir),
            },
        )
        task = asyncio.create_task(client.run())
        try:
            finished = await asyncio.wait_for(done, 60)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await moe.close()
            await dense.close()
    (sent,) = hello
    assert sent.protocol_version == protocol.PROTOCOL_VERSION >= protocol.ROUTING_VERSION
    routing = {m.name: m.routing for m in sent.models}
    assert routing == {"moe": moe.card.routing, "dense": None}
    assert finished.routed_experts is not None
    tokens = len(sampled)
    assert finished.routed_experts.start == 2
    assert finished.routed_experts.rows == 5 + tokens - 1 - 2
    assert moe.card.routing is not None
    rows: Any = unpack_rows(finished.routed_experts, moe.card.routing)
    assert rows.shape == (finished.routed_experts.rows, 2, 2)
