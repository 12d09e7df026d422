"""Policy versions and weight sync on the worker side.

``VersionedEngine`` wraps any ``Engine``. The trainer pauses it before it updates the
weights and resumes it with the new version afterwards:

* ``pause()``: requests that arrive from now on wait (they are not refused, so agents see
  only a slower reply); requests already running finish, or with ``abort_in_flight=True``
  are aborted (they end with ``FinishReason.ABORT``). ``pause`` returns once nothing runs:
  the engine is idle and its weights can be replaced.
* ``resume(version)``: the waiting requests start, on the new version.

Every reply's last chunk carries the version it was sampled with, as
``extra["policy_version"]``; the proxy records it on the turn and samples expose it
(``sdk.samples.Sample.policy_versions``). A backend that knows the version itself (the
``verl`` backend reports verl's ``global_steps``) sets it first and is not overridden.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncGenerator, Sequence

from worker_client.engine import Engine, ModelCard, SamplingParams, TokenChunk

POLICY_VERSION = "policy_version"


class PolicyState(enum.Enum):
    SERVING = "serving"
    PAUSING = "pausing"  # new requests wait; running ones are finishing or aborting
    PAUSED = "paused"  # nothing runs: weights may be swapped


class VersionedEngine:
    def __init__(self, engine: Engine, *, version: int = 0) -> None:
        self.engine = engine
        self.version = version
        self.state = PolicyState.SERVING
        self._changed = asyncio.Condition()
        self._running: set[str] = set()

    def __repr__(self) -> str:
        return (
            f"<VersionedEngine {self.card.name} v{self.version} {self.state.value} "
            f"running={len(self._running)}>"
        )

    @property
    def card(self) -> ModelCard:
        return self.engine.card

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenChunk, None]:
        async with self._changed:
            await self._changed.wait_for(lambda: self.state is PolicyState.SERVING)
            self._running.add(request_id)
            version = self.version
        try:
            async for chunk in self.engine.generate(request_id, prompt_ids, sampling):
                if chunk.finish_reason is not None:
                    chunk.extra.setdefault(POLICY_VERSION, version)
                yield chunk
        finally:
            async with self._changed:
                self._running.discard(request_id)
                self._changed.notify_all()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def close(self) -> None:
        await self.engine.close()

    async def pause(self, *, abort_in_flight: bool = False) -> None:
        """Stop starting requests and return once none runs (see the module docstring)."""
        async with self._changed:
            if self.state is PolicyState.SERVING:
                self.state = PolicyState.PAUSING
            running = list(self._running)
        if abort_in_flight:
            for request_id in running:
                await self.engine.abort(request_id)
        async with self._changed:
            await self._changed.wait_for(lambda: not self._running)
            self.state = PolicyState.PAUSED

    async def resume(self, version: int | None = None) -> int:
        """Serve again, on ``version`` (default: the current one plus one). Returns it."""
        async with self._changed:
            self.version = self.version + 1 if version is None else version
            self.state = PolicyState.SERVING
            self._changed.notify_all()
            return self.version
