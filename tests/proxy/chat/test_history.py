"""A session's memory of recent histories: the same keys and messages as computing them
from scratch, with only what is new converted and hashed."""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import proxy.chat.history as history_module
from proxy.chat.history import MEMORY, HistoryMemory, shared_prefix
from proxy.chat.messages import ChatMessage, Tool, ToolCall, extend_key, prefix_keys

TOOLS_A = [Tool("search", "find things", {"type": "object"})]
TOOLS_B = [Tool("shell", "run a command", {"type": "object", "required": ["cmd"]})]


def _user(text: str) -> ChatMessage:
    return ChatMessage("user", text)


def _assistant(text: str, call: bool = False) -> ChatMessage:
    calls = (ToolCall(f"id-{text}", "search", f'{{"q": "{text}"}}'),) if call else ()
    return ChatMessage("assistant", text, calls)


def _counted_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the messages the memory hashes (one ``extend_key`` per message)."""
    calls = [0]

    def counting(previous: bytes, message: ChatMessage) -> bytes:
        calls[0] += 1
        return extend_key(previous, message)

    monkeypatch.setattr(history_module, "extend_key", counting)
    return calls


# ---------------------------------------------------------------------- keys


def test_keys_of_a_growing_history_equal_prefix_keys_and_hash_only_the_new_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over 30 turns of two new messages each, the keys are prefix_keys' and each turn
    hashes exactly its two new messages."""
    hashed = _counted_hashing(monkeypatch)
    memory = HistoryMemory()
    history: list[ChatMessage] = [ChatMessage("system", "be brief"), _user("u0")]
    assert memory.keys(TOOLS_A, history) == prefix_keys(TOOLS_A, history)
    assert hashed[0] == 2
    for turn in range(1, 31):
        history = [*history, _assistant(f"a{turn}", call=turn % 3 == 0), _user(f"u{turn}")]
        before = hashed[0]
        assert memory.keys(TOOLS_A, history) == prefix_keys(TOOLS_A, history)
        assert hashed[0] - before == 2


def test_keys_returned_are_the_callers_to_change() -> None:
    """Mutating a returned key list changes neither the memory nor the next result."""
    memory = HistoryMemory()
    history = [_user("u0"), _assistant("a0"), _user("u1")]
    keys = memory.keys([], history)
    keys.clear()
    keys.append(b"garbage")
    longer = [*history, _assistant("a1"), _user("u2")]
    assert memory.keys([], longer) == prefix_keys([], longer)
    assert memory.keys([], history) == prefix_keys([], history)


def test_keys_of_another_tool_set_share_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same messages under other tools get the other tools' keys: every message is
    hashed again from the other root."""
    hashed = _counted_hashing(monkeypatch)
    memory = HistoryMemory()
    history = [_user("u0"), _assistant("a0"), _user("u1")]
    assert memory.keys(TOOLS_A, history) == prefix_keys(TOOLS_A, history)
    before = hashed[0]
    assert memory.keys(TOOLS_B, history) == prefix_keys(TOOLS_B, history)
    assert hashed[0] - before == len(history)


def test_a_history_that_grew_takes_the_place_of_the_one_it_grew_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MEMORY histories are remembered; one that grows replaces its own entry rather than
    pushing out the oldest, and a further history pushes out the oldest."""
    hashed = _counted_hashing(monkeypatch)
    memory = HistoryMemory()
    agents = [[_user(f"agent {a}"), _assistant(f"a{a}"), _user("more")] for a in range(MEMORY)]
    for history in agents:
        memory.keys([], history)
    last = agents[-1]
    for turn in range(3):  # the newest grows: it must not evict agents[0]
        last = [*last, _assistant(f"grow{turn}"), _user(f"next{turn}")]
        memory.keys([], last)
    before = hashed[0]
    assert memory.keys([], agents[0]) == prefix_keys([], agents[0])
    assert hashed[0] == before  # still remembered: nothing hashed
    memory.keys([], [_user("a newcomer")])  # pushes out the oldest (agents[1] by now)
    before = hashed[0]
    assert memory.keys([], agents[1]) == prefix_keys([], agents[1])
    assert hashed[0] - before == len(agents[1])


def _mutate(rng: random.Random, history: list[ChatMessage], step: int) -> list[ChatMessage]:
    """One agent's next history: mostly growth, sometimes a fork, an edit or a drop."""
    op = rng.choice(["grow", "grow", "grow", "fork", "edit", "drop"])
    if op == "grow" or len(history) < 2:
        return [*history, _assistant(f"a{step}", call=rng.random() < 0.3), _user(f"u{step}")]
    at = rng.randrange(len(history))
    if op == "fork":
        return [*history[:at], _user(f"fork{step}")]
    if op == "edit":
        edited = ChatMessage(history[at].role, f"edited{step}", history[at].tool_calls)
        return [*history[:at], edited, *history[at + 1 :]]
    return history[:-1]


def test_keys_equal_prefix_keys_over_a_random_mix_of_agents_forks_edits_and_tools() -> None:
    """Growth, forks, edits, dropped messages, other tool sets, more agents than MEMORY
    and agents taking turns: every answer is prefix_keys'."""
    rng = random.Random(20261126)
    memory = HistoryMemory()
    agents: list[tuple[list[Tool], list[ChatMessage]]] = [
        ([], [_user("start 0")]),
        (TOOLS_A, [ChatMessage("system", "sys"), _user("start 1")]),
    ]
    for step in range(600):
        if rng.random() < 0.05 and len(agents) < 2 * MEMORY + 2:
            tools = rng.choice([[], TOOLS_A, TOOLS_B])
            agents.append((tools, [_user(f"start {len(agents)}")]))
        # Two agents alternating most of the time, any agent otherwise.
        who = step % 2 if rng.random() < 0.6 else rng.randrange(len(agents))
        tools, history = agents[who]
        if rng.random() < 0.05:
            tools = rng.choice([[], TOOLS_A, TOOLS_B])
        history = _mutate(rng, history, step)
        agents[who] = (tools, history)
        assert memory.keys(tools, history) == prefix_keys(tools, history), step


# ---------------------------------------------------------------------- messages


def _raw(index: int, text: str = "") -> msgspec.Raw:
    """A message's JSON text as the request body holds it (a new object every call, as
    every request is parsed anew)."""
    return msgspec.Raw(msgspec.json.encode({"role": "user", "content": text or f"m{index}"}))


class _Converter:
    """``convert`` that records which indices it was asked for (and may fail at one)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[int] = []
        self.fail_at = fail_at

    def __call__(self, raw: object, index: int) -> ChatMessage:
        self.calls.append(index)
        if index == self.fail_at:
            raise ValueError(f"bad message {index}")
        assert isinstance(raw, msgspec.Raw)
        decoded = msgspec.json.decode(bytes(raw))
        return ChatMessage("user", decoded["content"])


def _raws(n: int) -> list[object]:
    return [_raw(i) for i in range(n)]


def test_messages_converts_only_the_new_raws_and_reuses_the_rest() -> None:
    """A history that extends a remembered one converts only its new messages, and the
    shared ones are the very objects made before."""
    memory = HistoryMemory()
    first = _Converter()
    old = memory.messages(_raws(5), first)
    assert first.calls == [0, 1, 2, 3, 4]
    second = _Converter()
    new = memory.messages(_raws(7), second)
    assert second.calls == [5, 6]
    assert all(a is b for a, b in zip(old, new[:5], strict=True))
    assert [m.content for m in new] == [f"m{i}" for i in range(7)]


def test_messages_after_a_changed_message_are_converted_again() -> None:
    """A history whose message 2 differs (one byte) reuses messages 0-1 only."""
    memory = HistoryMemory()
    memory.messages(_raws(5), _Converter())
    changed = _raws(5)
    changed[2] = _raw(2, "m2!")
    convert = _Converter()
    out = memory.messages(changed, convert)
    assert convert.calls == [2, 3, 4]
    assert out[2].content == "m2!"


def test_messages_returns_a_new_list_each_time() -> None:
    """The caller may change the returned list: the memory keeps its own."""
    memory = HistoryMemory()
    out = memory.messages(_raws(3), _Converter())
    kept = list(out)
    out.clear()
    again = memory.messages(_raws(3), _Converter())
    assert again is not out
    assert len(again) == 3
    assert all(a is b for a, b in zip(kept, again, strict=True))
    again[0] = ChatMessage("user", "replaced")
    convert = _Converter()
    assert memory.messages(_raws(4), convert)[0] is kept[0]
    assert convert.calls == [3]


def test_a_failed_conversion_leaves_the_memory_as_it_was() -> None:
    """convert raising leaves nothing behind: the same bad history is converted (and
    refused) again, and a good one still reuses the old prefix."""
    memory = HistoryMemory()
    old = memory.messages(_raws(4), _Converter())
    failing = _Converter(fail_at=5)
    with pytest.raises(ValueError, match="bad message 5"):
        memory.messages(_raws(7), failing)
    assert failing.calls == [4, 5]
    again = _Converter(fail_at=5)
    with pytest.raises(ValueError, match="bad message 5"):
        memory.messages(_raws(7), again)
    assert again.calls == [4, 5]  # message 4 was not remembered from the failed call
    good = _Converter()
    new = memory.messages(_raws(7), good)
    assert good.calls == [4, 5, 6]
    assert all(a is b for a, b in zip(old, new[:4], strict=True))


def test_messages_reuse_the_longest_of_several_remembered_histories() -> None:
    """Of several remembered histories the one sharing the longest prefix is used."""
    memory = HistoryMemory()
    memory.messages(_raws(2), _Converter())
    other = [_raw(0, "x"), *_raws(6)[1:]]
    memory.messages(other, _Converter())
    longest = _raws(6)
    memory.messages(longest, _Converter())
    convert = _Converter()
    memory.messages(_raws(8), convert)
    assert convert.calls == [6, 7]


# ---------------------------------------------------------------------- shared_prefix


def _naive_shared(old: list[int], new: list[int]) -> int:
    n = 0
    while n < len(old) and n < len(new) and old[n] == new[n]:
        n += 1
    return n


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ([], []),
        ([], [1]),
        ([1], []),
        ([1, 2, 3], [1, 2, 3]),
        ([1, 2], [1, 2, 3]),
        ([1, 2, 3], [1, 2]),
        ([1, 2, 3], [0, 2, 3]),
        ([1, 2, 3], [1, 2, 4]),
        ([1, 2, 3, 4, 5], [1, 2, 3, 9, 5]),
    ],
)
def test_shared_prefix_edge_cases(old: list[int], new: list[int]) -> None:
    """Empty, equal, prefix either way and a difference first, last or inside."""
    assert shared_prefix(old, new) == _naive_shared(old, new)


@given(
    st.lists(st.integers(0, 2), max_size=40),
    st.lists(st.integers(0, 2), max_size=40),
    st.integers(0, 40),
)
def test_shared_prefix_equals_a_naive_loop(common: list[int], tail: list[int], cut: int) -> None:
    """Random lists (built to share long prefixes): the binary search agrees with a loop
    both ways round."""
    old = common + tail
    new = common[:cut] + tail[::-1]
    assert shared_prefix(old, new) == _naive_shared(old, new)
    assert shared_prefix(new, old) == _naive_shared(new, old)


def _expanding(calls: list[int]) -> Callable[[object, int], list[ChatMessage]]:
    """A conversion that makes 0, 1 or 2 internal messages from a raw (as an Anthropic
    user message with tool results makes several), counting its calls."""

    def convert(raw: object, index: int) -> list[ChatMessage]:
        calls.append(index)
        assert isinstance(raw, msgspec.Raw)
        text = bytes(raw).decode()
        return [ChatMessage("user", f"{text}/{k}") for k in range(len(text) % 3)]

    return convert


def test_expand_equals_converting_from_scratch_and_converts_only_new_raws() -> None:
    """Raws that make several internal messages (or none): the result is the whole
    conversion concatenated, and a grown or forked history converts only past the fork."""
    memory = HistoryMemory()
    calls: list[int] = []
    convert = _expanding(calls)
    raws = [msgspec.Raw(f"m{'x' * i}".encode()) for i in range(12)]

    def scratch(items: list[object]) -> list[ChatMessage]:
        return [m for i, r in enumerate(items) for m in convert(r, i)]

    for end, fork in ((6, None), (12, None), (9, 4)):
        items: list[object] = list(raws[:end])
        if fork is not None:
            items[fork] = msgspec.Raw(b"changed")
        calls.clear()
        got = memory.expand(items, convert, api="a")
        converted = list(calls)
        calls.clear()
        assert got == scratch(items)
        first_new = {6: 0, 12: 6, 9: 4}[end]
        assert converted == list(range(first_new, end))


def test_expand_keeps_each_apis_conversions_apart() -> None:
    """The same raws under another API are converted by that API's conversion, never
    taken from what the first API made of them."""
    memory = HistoryMemory()
    raws: list[object] = [msgspec.Raw(b'{"role":"user","content":"hi"}')]
    memory.expand(raws, lambda raw, i: [ChatMessage("user", "one way")], api="a")
    other = memory.expand(raws, lambda raw, i: [ChatMessage("system", "another")], api="b")
    assert other == [ChatMessage("system", "another")]
    again = memory.expand(raws, lambda raw, i: pytest.fail("converted again"), api="a")
    assert again == [ChatMessage("user", "one way")]


def test_the_budget_empties_the_least_recently_used_memories_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the budget, the memory used longest ago is emptied (its next request converts
    everything again, with the same result); the one just used keeps its history."""
    budget = history_module.MemoryBudget(limit=6_000)  # room for one memory of the two
    monkeypatch.setattr(history_module, "BUDGET", budget)
    raws: list[object] = [msgspec.Raw(b'"' + b"x" * 1000 + b'"') for _ in range(3)]
    first, second = HistoryMemory(), HistoryMemory()
    calls: list[int] = []

    def convert(raw: object, index: int) -> ChatMessage:
        calls.append(index)
        return ChatMessage("user", str(index))

    first.messages(raws, convert)
    second.messages(raws, convert)
    assert budget.used <= budget.limit
    first.messages(raws, convert)  # first is now the most recent...
    calls.clear()
    assert first.messages(raws, convert) == [ChatMessage("user", str(i)) for i in range(3)]
    assert calls == []  # ...and kept its history
    assert budget.dropped >= 1
    calls.clear()
    assert second.messages(raws, convert) == [ChatMessage("user", str(i)) for i in range(3)]
    assert calls == [0, 1, 2]  # emptied: converted again


def test_the_budget_counts_a_memory_once_and_forgets_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A memory's charge replaces its previous one, and ``forget`` gives its bytes back."""
    budget = history_module.MemoryBudget(limit=1 << 30)
    monkeypatch.setattr(history_module, "BUDGET", budget)
    memory = HistoryMemory()
    raws: list[object] = [msgspec.Raw(b'"hello"')]
    memory.messages(raws, lambda raw, i: ChatMessage("user", "hello"))
    once = budget.used
    memory.messages(raws, lambda raw, i: ChatMessage("user", "hello"))
    assert budget.used == once > 0
    memory.keys([], [ChatMessage("user", "hello")])
    assert budget.used > once
    memory.forget()
    assert budget.used == 0
