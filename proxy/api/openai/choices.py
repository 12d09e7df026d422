"""Several choices of one request (``n`` > 1), each its own turn and branch.

Every choice is dispatched before the response begins (so a refused request changes
nothing), then their events are interleaved as the workers produce them: each choice
streams for real, tagged with its index.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace

from proxy.sessions.model import Session
from proxy.turns import PreparedTurn, TurnEvent, TurnRequest, TurnService

IndexedEvent = tuple[int, TurnEvent]


def choice_requests(turn: TurnRequest, n: int) -> list[TurnRequest]:
    """``n`` copies of a turn; with a seed, choice ``i`` uses ``seed + i`` so they differ."""
    seed = turn.sampling.seed
    return [
        turn
        if i == 0 or seed is None
        else replace(turn, sampling=replace(turn.sampling, seed=seed + i))
        for i in range(n)
    ]


@contextlib.asynccontextmanager
async def streamed_choices(
    service: TurnService, session: Session, turns: Sequence[TurnRequest]
) -> AsyncIterator[tuple[list[PreparedTurn], AsyncGenerator[IndexedEvent, None]]]:
    """Start every choice, then yield their interleaved events.

    If any choice is refused, those already dispatched are cancelled before they record
    anything; however the response ends, every generation is stopped and whatever was
    sampled of an unfinished choice is recorded as a truncated turn."""
    async with contextlib.AsyncExitStack() as stack:
        prepared: list[PreparedTurn] = []
        streams: list[AsyncGenerator[TurnEvent, None]] = []
        for turn in turns:
            started = await service.start(session, turn)
            prepared.append(started)
            streams.append(await stack.enter_async_context(service.streaming(started)))
        merged = _interleave(streams)
        # Closed first (last in, first out): the pumps stop before the streams close.
        stack.push_async_callback(merged.aclose)
        yield prepared, merged


async def _interleave(
    streams: Sequence[AsyncGenerator[TurnEvent, None]],
) -> AsyncGenerator[IndexedEvent, None]:
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    # Bounded: a slow client slows the pumps down instead of buffering a whole reply.
    queue: asyncio.Queue[tuple[int, TurnEvent | BaseException | None]] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(index: int, events: AsyncGenerator[TurnEvent, None]) -> None:
        try:
            async for event in events:
                await queue.put((index, event))
        except Exception as exc:  # a ProxyError of this choice ends the response
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
