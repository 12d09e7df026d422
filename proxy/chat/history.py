"""A session's memory of the histories it was sent lately, so a turn costs what it adds.

An agent sends its whole history with every request, two messages longer each turn. What
the proxy derives from a history is a function of each message and the messages before
it: a message's internal form depends on its own JSON only, and the context key of the
first k messages on the tools and those k messages. So a session remembers the last few
histories it saw (``MEMORY``), and a request reuses what it shares with one of them from
the start, byte for byte for the JSON (one memory comparison per message, in C), and
object for object for the keys. Only the messages past the shared prefix are validated,
converted and hashed.

Everything here is a cache of pure functions: a request that shares nothing computes
the same result from scratch, a refused request leaves nothing behind but a cache entry,
and a restarted proxy starts with an empty memory. A history that forks (a branch, a
rewritten message) shares the prefix before the fork and recomputes the rest; the keys,
not this memory, decide which turn a request continues.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from proxy.chat.messages import ChatMessage, Tool, extend_key, root_key

# How many recent histories a session remembers: one agent's chain, plus a few for
# sessions that several agents share or that branch back and forth.
MEMORY = 4


@dataclass(slots=True, frozen=True)
class _Parsed:
    tag: str  # the API whose conversion made the messages (each reads a message its own way)
    items: list[object]  # each message's JSON text as received (bytes-like, comparable)
    ends: list[int]  # ends[k]: how many internal messages items[:k] made
    messages: list[ChatMessage]


@dataclass(slots=True, frozen=True)
class _Keyed:
    tag: bytes  # the tools' key
    items: list[ChatMessage]
    keys: list[bytes]  # keys[k]: the context of the tools and items[:k]


_Item = TypeVar("_Item")


def shared_prefix(old: list[_Item], new: list[_Item]) -> int:
    """How many leading items ``new`` shares with ``old``. The common case, ``new``
    extending ``old``, is one list comparison in C (identical objects compare by
    address); otherwise a binary search over prefix comparisons, also in C."""
    n = min(len(old), len(new))
    if old[:n] == new[:n]:
        return n
    lo, hi = 0, n - 1  # the first n - 1 items may still match
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if old[:mid] == new[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_Chain = TypeVar("_Chain", _Parsed, _Keyed)


def _closest(
    chains: tuple[_Chain, ...], tag: object, items: list[Any]
) -> tuple[_Chain | None, int, bool]:
    """The remembered chain of ``tag`` that shares the longest prefix with ``items``, how
    many items it shares, and whether ``items`` extends all of it."""
    best: _Chain | None = None
    shared = 0
    for chain in chains:
        if chain.tag != tag:
            continue
        n = shared_prefix(chain.items, items)
        if n > shared or best is None:
            best, shared = chain, n
    return best, shared, best is not None and shared == len(best.items)


def _remember(
    chains: tuple[_Chain, ...], chain: _Chain, replaces: _Chain | None
) -> tuple[_Chain, ...]:
    """The memory with ``chain`` as the most recent entry: it takes the place of the
    entry it grew from, else pushes out the oldest."""
    kept: list[_Chain] = [c for c in chains if c is not replaces]
    kept = kept[-(MEMORY - 1) :]
    kept.append(chain)
    return tuple(kept)


# What remembering a message costs beyond its JSON text and its content (counted apart):
# the internal message, its raw view, its key and the lists' slots (with both, about
# what tracemalloc measures: 3x the body for chat messages of 250 characters).
_PER_MESSAGE = 300
_CONTENT = operator.attrgetter("content")


class MemoryBudget:
    """Bounds what the history memories of all sessions hold together: past ``limit``
    bytes (an estimate: the messages' JSON text and content plus ``_PER_MESSAGE`` each), the
    memories used least recently are emptied (their sessions' next requests are parsed
    and hashed whole, once, as without a memory)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.dropped = 0  # memories emptied to stay within the limit
        self._sizes: OrderedDict[int, tuple[weakref.ref[HistoryMemory], int]] = OrderedDict()

    def charge(self, memory: HistoryMemory, size: int) -> None:
        """``memory`` now holds ``size`` bytes and was just used."""
        key = id(memory)
        old = self._sizes.pop(key, None)
        if old is not None:
            self.used -= old[1]
        # A memory whose session is gone stays counted until it is the oldest.
        self._sizes[key] = (weakref.ref(memory), size)
        self.used += size
        while self.used > self.limit and len(self._sizes) > 1:
            _, (ref, held) = self._sizes.popitem(last=False)
            self.used -= held
            self.dropped += 1
            dropped = ref()
            if dropped is not None:
                dropped.forget()

    def release(self, memory: HistoryMemory) -> None:
        old = self._sizes.pop(id(memory), None)
        if old is not None:
            self.used -= old[1]


# Shared by every session of the process (``rollout-relay proxy --history-memory-mb``).
BUDGET = MemoryBudget(512 * 2**20)


class HistoryMemory:
    """The recent histories of one session. The memory is replaced whole, never changed
    in place, so a render running in a thread and the event loop may share it. What all
    memories hold together is bounded by ``BUDGET``."""

    __slots__ = ("__weakref__", "_keyed", "_parsed", "_sizes")

    def __init__(self) -> None:
        self._parsed: tuple[_Parsed, ...] = ()
        self._keyed: tuple[_Keyed, ...] = ()
        self._sizes: dict[int, int] = {}  # bytes each remembered history holds, by id

    def forget(self) -> None:
        """Empty the memory (the session stopped, or the budget needs the room)."""
        self._parsed, self._keyed, self._sizes = (), (), {}
        BUDGET.release(self)

    def _charge(self, chain: _Parsed | _Keyed, size: int) -> None:
        kept = {id(c) for c in (*self._parsed, *self._keyed)}
        self._sizes = {k: v for k, v in self._sizes.items() if k in kept}
        self._sizes[id(chain)] = size
        BUDGET.charge(self, sum(self._sizes.values()))

    def messages(
        self,
        raws: list[object],
        convert: Callable[[object, int], ChatMessage],
        *,
        api: str = "openai.chat",
    ) -> list[ChatMessage]:
        """The internal messages of a request whose messages' JSON texts are ``raws``,
        one for each: those it shares with a remembered history are reused,
        ``convert(raw, index)`` makes the rest (and raises for one that is invalid;
        nothing is remembered then)."""
        return self.expand(raws, lambda raw, index: (convert(raw, index),), api=api)

    def expand(
        self,
        raws: list[object],
        convert: Callable[[object, int], Sequence[ChatMessage]],
        *,
        api: str,
    ) -> list[ChatMessage]:
        """``messages`` for an API whose message may make several internal ones (an
        Anthropic user message with tool results)."""
        best, shared, grown = _closest(self._parsed, api, raws)
        if best is not None:
            ends = best.ends[: shared + 1]
            messages = best.messages[: ends[-1]]
        else:
            ends, messages = [0], []
        for index in range(shared, len(raws)):
            messages.extend(convert(raws[index], index))
            ends.append(len(messages))
        chain = _Parsed(api, raws, ends, messages)
        self._parsed = _remember(self._parsed, chain, best if grown else None)
        self._charge(chain, sum(map(len, cast(list[Sized], raws))) + _PER_MESSAGE * len(raws))
        return list(messages)

    def keys(self, tools: Sequence[Tool], messages: Sequence[ChatMessage]) -> list[bytes]:
        """``keys[k]`` identifies the context made of ``tools`` and ``messages[:k]``
        (``proxy.chat.messages.prefix_keys``), hashing only the messages past the
        longest prefix shared with a remembered history of the same tools."""
        root = root_key(tools)
        history = list(messages)
        best, shared, grown = _closest(self._keyed, root, history)
        keys = best.keys[: shared + 1] if best is not None else [root]
        for message in history[shared:]:
            keys.append(extend_key(keys[-1], message))
        chain = _Keyed(root, history, keys)
        self._keyed = _remember(self._keyed, chain, best if grown else None)
        self._charge(chain, sum(map(len, map(_CONTENT, history))))
        return list(keys)
