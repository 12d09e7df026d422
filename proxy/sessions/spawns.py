"""A session's spawning calls: those its turns made (durable with them) and those a reply
still streaming has sent, which agent took each, and the calls sub-agents' first
requests in flight hold. What ``proxy.turns.attribution`` decides from; everything here
but the in-flight parts is rebuilt from the recorded turns when a session is loaded.

A call is known by the turn that made it and its id (``CallKey``); a call sent while its
reply streams has no turn yet (None), and is moved under its turn once the reply is
recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from proxy.sessions.agents import (
    NO_SPAWNS,
    CallKey,
    Spawn,
    SpawnCall,
    SpawnedBy,
    Spawns,
    TurnAgent,
)

__all__ = ["SpawnLedger"]


@dataclass(slots=True)
class SpawnLedger:
    # The calls recorded turns made, in order, and the latest turn that made a call of
    # each id; the calls of replies still streaming (sent to the agent, not recorded yet).
    calls: list[SpawnCall] = field(default_factory=list)
    call_turns: dict[str, int] = field(default_factory=dict)
    streaming: list[SpawnCall] = field(default_factory=list)
    # Which agent took each call (its first turn says so, or a result named it), and which
    # calls sub-agents' first requests in flight hold.
    taken: dict[CallKey, str] = field(default_factory=dict)
    reserved: dict[CallKey, str] = field(default_factory=dict)
    # The call each agent was started by, where a spawning call's result named it.
    links: dict[str, CallKey] = field(default_factory=dict)

    def view(self, answered: Callable[[int], bool]) -> Spawns:
        """The calls as attribution sees them: the recorded ones (in order), then those of
        replies still streaming, and which agent took each. ``answered(turn)``: whether
        that turn was continued."""
        if not self.calls and not self.streaming:
            return NO_SPAWNS
        calls = [
            SpawnCall(c.turn, c.tool_call_id, c.message, c.agent, answered(c.turn))
            for c in self.calls
            if c.turn is not None
        ]
        calls.extend(self.streaming)
        return Spawns(calls, {**self.taken, **self.reserved})

    def sent(self, agent: str, spawns: Sequence[Spawn]) -> list[SpawnCall]:
        """Spawning calls of a reply still streaming, sent to the agent: from now on a
        sub-agent can take them. Returns the entries, for ``drop``."""
        entries = [SpawnCall(None, s.tool_call_id, s.message, agent) for s in spawns]
        self.streaming.extend(entries)
        return entries

    def drop(self, entries: Sequence[SpawnCall]) -> None:
        """Forget a reply's streaming calls that its turn did not record (it had none)."""
        if entries:
            self.streaming = [c for c in self.streaming if all(c is not e for e in entries)]

    def hold(self, agent: TurnAgent) -> CallKey | None:
        """A sub-agent's first request was planned: its call is held while it runs."""
        if agent.spawned_by is None:
            return None
        key = self._call_key(agent.spawned_by)
        self.reserved[key] = agent.id
        return key

    def release(self, key: CallKey | None, agent: str) -> None:
        """The request that held ``key`` ended: the hold goes (under whichever turn the
        call has by now: its reply may have been recorded meanwhile)."""
        if key is None:
            return
        for held in [k for k, a in self.reserved.items() if k[1] == key[1] and a == agent]:
            del self.reserved[held]

    def _call_key(self, spawned: SpawnedBy) -> CallKey:
        """A call's key, its turn found by its id where the reply was still streaming."""
        if spawned.turn is not None:
            return (spawned.turn, spawned.tool_call_id)
        return (self.call_turns.get(spawned.tool_call_id), spawned.tool_call_id)

    def record(self, index: int, agent: TurnAgent) -> None:
        """A turn was recorded: the calls its reply made, the call its agent took, the
        results its request brought back."""
        for spawn in agent.spawns:
            self.calls.append(SpawnCall(index, spawn.tool_call_id, spawn.message, agent.id))
            self.call_turns[spawn.tool_call_id] = index
            self.streaming = [
                c
                for c in self.streaming
                if (c.tool_call_id, c.agent) != (spawn.tool_call_id, agent.id)
            ]
            # A sub-agent took it while the reply streamed: the call now has its turn.
            streamed: CallKey = (None, spawn.tool_call_id)
            for held in (self.taken, self.reserved):
                taker = held.pop(streamed, None)
                if taker is not None:
                    held[(index, spawn.tool_call_id)] = taker
            for agent_id, linked in self.links.items():
                if linked == streamed:
                    self.links[agent_id] = (index, spawn.tool_call_id)
        if agent.spawned_by is not None:
            key = self._call_key(agent.spawned_by)
            self.taken.setdefault(key, agent.id)
            self.release(key, agent.id)
        for result in agent.results:  # the result names the agent: it wins
            key = self._call_key(SpawnedBy(None, result.tool_call_id))
            self.taken[key] = result.agent
            self.links[result.agent] = key

    def started_by(self, agent: TurnAgent) -> CallKey | None:
        """The call that started ``agent`` (as its first turn recorded it): the call whose
        result named it, else the one its first turn took by content (unless a result
        named another agent for that call)."""
        key = self.links.get(agent.id)
        if key is None and agent.spawned_by is not None:
            key = self._call_key(agent.spawned_by)
            if self.taken.get(key, agent.id) != agent.id:
                key = None
        return key
