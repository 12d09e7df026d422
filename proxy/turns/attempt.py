"""A turn's attempt in flight: the plan it carries out, the worker's call, and what it
holds in the session while it runs (retries of its body wait for it; the spawning calls
its streamed reply sent; the call its sub-agent's first request took)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from proxy.models import ServedModel
from proxy.sessions.agents import CallKey, SpawnCall, TurnAgent
from proxy.sessions.model import PromptPlan, Session, TurnNode
from proxy.turns.plan import TurnPlan
from proxy.turns.request import EventSink, TurnRequest
from relay import protocol
from relay.pool import RelayCall

__all__ = ["Live", "PreparedTurn"]


class Live:
    """An attempt in flight, which retries of the same body wait for (``done``: its turn
    is recorded, or it ended without one)."""

    __slots__ = ("client_request_id", "done")

    def __init__(self, client_request_id: str) -> None:
        self.client_request_id = client_request_id
        self.done = asyncio.Event()


@dataclass(slots=True)
class PreparedTurn:
    """A turn that was planned and dispatched to a worker, or a retry that is
    answered with a recorded reply (``replay``; no call then)."""

    session: Session
    request: TurnRequest
    served: ServedModel
    planned: TurnPlan
    call: RelayCall | None
    started: float
    received_at: float = 0.0  # when the turn's request reached the service
    # The response writer, when a single stream writes this turn's events (see stream()).
    sink: EventSink | None = None
    replay: TurnNode | None = None  # the recorded turn a retry is answered with
    live: Live | None = None  # registered while in flight, for retries to join
    detached: bool = False  # finished in the background after its client left
    # The spawning calls its reply sent while streaming, until its turn records them, and
    # the call its agent's first request holds while it runs.
    sent_spawns: list[SpawnCall] = field(default_factory=list)
    reserved: CallKey | None = None

    @property
    def plan(self) -> PromptPlan:
        return self.planned.prompt

    @property
    def sampling(self) -> protocol.Sampling:
        return self.planned.sampling

    @property
    def agent(self) -> TurnAgent:
        return self.planned.agent

    @property
    def retry_of(self) -> int | None:
        """The earlier attempt this sampled turn replaces (a cut one, or one recorded by a
        model no longer served)."""
        return self.planned.retry.retry_of if self.replay is None else None
