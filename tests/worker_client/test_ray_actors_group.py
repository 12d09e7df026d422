"""``WorkerActorGroup``'s weight update against stand-in actors (no Ray cluster): which
phases every actor gets when the caller is cancelled in the middle."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e.conftest import TIMEOUT_FACTOR
from worker_client import ray_actors
from worker_client.exceptions import WeightsBusyError, WeightsError
from worker_client.ray_actors import WorkerActorGroup


class _Ref:
    """An object ref: the call runs when ``ray.get`` asks for it."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call


class _Method:
    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method

    def remote(self, *args: Any, **kwargs: Any) -> _Ref:
        return _Ref(lambda: self.method(*args, **kwargs))


class _Ray:
    """The part of the ``ray`` module the group's update uses."""

    @staticmethod
    def get(ref: Any, timeout: float | None = None) -> Any:
        if isinstance(ref, list):
            return [r.call() for r in ref]
        return ref.call()


class _Actor:
    """A worker actor's update phases as ``WorkerActor`` keeps them (``state``: serving,
    paused or loaded); ``gate`` holds every load until it is set."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.state = "serving"
        self.version = 0
        self.staged: int | None = None
        self.calls: list[str] = []
        self.loading = threading.Event()

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self, f"_{name}"))

    def _pause(self, abort_in_flight: bool = False) -> None:
        self.calls.append("pause")
        if self.state != "serving":
            raise WeightsBusyError("paused already")
        self.state = "paused"

    def _load(self, version: int, path: str | None = None) -> None:
        self.calls.append("load")
        self.loading.set()
        assert self.gate.wait(30 * TIMEOUT_FACTOR)
        if self.state != "paused":
            raise WeightsError("load needs pause first")
        self.staged, self.state = version, "loaded"

    def _commit(self) -> int:
        self.calls.append("commit")
        if self.state != "loaded" or self.staged is None:
            raise WeightsError("commit needs pause and load first")
        self.version, self.staged, self.state = self.staged, None, "serving"
        return self.version

    def _rollback(self) -> None:
        self.calls.append("rollback")
        self.staged, self.state = None, "serving"


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # never leave an executor thread waiting


@pytest.fixture
def actors(monkeypatch: pytest.MonkeyPatch, gate: threading.Event) -> list[_Actor]:
    monkeypatch.setattr(ray_actors, "_import_ray", _Ray)
    return [_Actor(gate), _Actor(gate)]


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(500 * TIMEOUT_FACTOR)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


async def test_a_cancelled_caller_does_not_leave_the_actors_paused(
    actors: list[_Actor], gate: threading.Event
) -> None:
    """Cancelling the caller while the actors load does not stop the update between pause
    and commit: it runs to its commit, every actor serves the new version, none stays
    paused, and the same update asked again meanwhile gets its outcome."""
    group = WorkerActorGroup(list(actors), ["a", "b"], None)
    caller = asyncio.create_task(group.update_weights(1, "/ckpt/1"))
    await _until(actors[0].loading.is_set, "the first actor loads")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    again = asyncio.create_task(group.update_weights(1, "/ckpt/1"))
    gate.set()
    assert await asyncio.wait_for(again, 10 * TIMEOUT_FACTOR) == 1
    assert [(a.state, a.version) for a in actors] == [("serving", 1)] * 2
    assert [a.calls for a in actors] == [["pause", "load", "commit"]] * 2


async def test_a_load_that_fails_rolls_every_actor_back(
    actors: list[_Actor], gate: threading.Event
) -> None:
    """A load failing on one actor rolls every actor back and raises WeightsError naming it."""
    gate.set()

    def refuse(version: int, path: str | None = None) -> None:
        actors[1].calls.append("load")
        raise WeightsError("no such directory")

    actors[1]._load = refuse  # type: ignore[method-assign]
    group = WorkerActorGroup(list(actors), ["a", "b"], None)
    with pytest.raises(WeightsError, match=r"did not load: no such directory \(actor b\)"):
        await group.update_weights(1, "/missing")
    assert [(a.state, a.version) for a in actors] == [("serving", 0)] * 2
    assert [a.calls for a in actors] == [["pause", "load", "rollback"]] * 2


async def test_an_update_stopped_while_it_loads_rolls_every_actor_back(
    actors: list[_Actor], gate: threading.Event
) -> None:
    """The update's own task stopped between pause and commit (the trainer's event loop
    shuts down) rolls every actor back in its cleanup: none is left paused."""
    group = WorkerActorGroup(list(actors), ["a", "b"], None)
    caller = asyncio.create_task(group.update_weights(1, "/ckpt/1"))
    await _until(actors[0].loading.is_set, "the first actor loads")
    running = group._running
    assert running is not None
    running[1].cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 10 * TIMEOUT_FACTOR)
    await _until(lambda: all(a.calls.count("load") for a in actors), "every load ended")
    assert [(a.state, a.version) for a in actors] == [("serving", 0)] * 2
    assert ["rollback" in a.calls and "commit" not in a.calls for a in actors] == [True] * 2
