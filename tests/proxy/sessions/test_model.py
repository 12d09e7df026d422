"""Session trees: continuation lookup, state rules and the trajectory export."""

from __future__ import annotations

from array import array

import pytest

from proxy.chat.messages import ChatMessage, ToolCall, extend_key, prefix_keys
from proxy.exceptions import ConflictError
from proxy.sessions.model import (
    Session,
    SessionState,
    TrialId,
    TurnMeta,
    TurnNode,
    node_versions,
)


def _meta(reason: str = "continued") -> TurnMeta:
    return TurnMeta(
        api="test",
        model="m",
        requested_model="m",
        worker_id="w",
        finish_reason="stop",
        sampling={},
        created_at=0.0,
        queue_seconds=0.0,
        engine_seconds=0.0,
        branch_reason=reason,
    )


def _add(
    session: Session,
    parent: int | None,
    context: list[int],
    completion: list[int],
    key: bytes,
) -> TurnNode:
    prompt_len = len(context) + (session.nodes[parent].end if parent is not None else 0)
    node = TurnNode(
        index=len(session.nodes),
        parent=parent,
        context_ids=array("i", context),
        completion_ids=array("i", completion),
        logprobs=array("f", [-0.5] * len(completion)),
        prompt_len=prompt_len,
        key=key,
        meta=_meta(),
    )
    session.add_turn(node)
    return node


def test_export_masks_context_and_sampled_tokens() -> None:
    """A two-turn path exports prompt, response, mask and logprobs aligned."""
    s = Session(TrialId("t"), "k")
    _add(s, None, [1, 2, 3], [10, 11], b"a")
    _add(s, 0, [4, 5], [12], b"b")
    (traj,) = s.export()["trajectories"]
    assert traj["prompt_ids"] == [1, 2, 3]
    assert traj["response_ids"] == [10, 11, 4, 5, 12]
    assert traj["response_mask"] == [1, 1, 0, 0, 1]
    assert traj["response_logprobs"] == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert [t["turn"] for t in traj["turns"]] == [0, 1]


def test_branches_share_prefix_and_export_one_trajectory_per_leaf() -> None:
    """Continuing an older node makes a second leaf; the shared prefix is stored once."""
    s = Session(TrialId("t"), "k")
    _add(s, None, [1, 2], [10], b"a")
    _add(s, 0, [3], [11], b"b")
    _add(s, 0, [4], [12], b"c")  # resumed from the older point
    export = s.export()
    assert len(export["trajectories"]) == 2
    assert [t["response_ids"] for t in export["trajectories"]] == [[10, 3, 11], [10, 4, 12]]
    assert s.context_ids(2).tolist() == [1, 2, 10, 4, 12]


def test_find_continuation_prefers_longest_prefix() -> None:
    """The node covering the most request messages wins, and the last message must be new."""
    msgs = [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "a1"),
        ChatMessage("user", "more"),
        ChatMessage("assistant", "a2", (ToolCall("x", "f", '{"b": 1, "a": 2}'),)),
        ChatMessage("tool", "out", tool_call_id="x"),
    ]
    keys = prefix_keys([], msgs)
    s = Session(TrialId("t"), "k")
    _add(s, None, [1], [2], keys[2])
    _add(s, 0, [3], [4], keys[4])
    assert s.find_continuation(keys) == (1, 4)
    assert s.find_continuation(keys[:5]) == (0, 2)  # request ending at the 2nd assistant msg
    assert s.find_continuation(prefix_keys([], [ChatMessage("user", "other")])) is None


def test_canonical_keys_ignore_client_rewrites() -> None:
    """Argument whitespace/key order and tool-call ids do not change an assistant key."""
    a = ChatMessage("assistant", "", (ToolCall("id1", "f", '{"a": 1, "b": [1, 2]}'),))
    b = ChatMessage("assistant", "", (ToolCall("other", "f", '{"b":[1,2],"a":1}'),))
    assert extend_key(b"r", a) == extend_key(b"r", b)
    c = ChatMessage("assistant", "x", (ToolCall("id1", "f", '{"a": 1, "b": [1, 2]}'),))
    assert extend_key(b"r", a) != extend_key(b"r", c)


def test_tools_are_part_of_the_key() -> None:
    """Changing the tool set changes every prefix key."""
    from proxy.chat.messages import Tool

    msgs = [ChatMessage("user", "hi")]
    assert prefix_keys([], msgs)[1] != prefix_keys([Tool("f")], msgs)[1]


def test_state_transitions() -> None:
    """Active → completed → deleted; nothing goes back, and inactive sessions refuse turns."""
    s = Session(TrialId("t"), "k")
    s.require_active()
    s.transition(SessionState.COMPLETED)
    assert s.completed_at is not None
    with pytest.raises(ConflictError):
        s.require_active()
    with pytest.raises(ConflictError):
        s.transition(SessionState.ACTIVE)
    s.transition(SessionState.DELETED)
    with pytest.raises(ConflictError):
        s.transition(SessionState.COMPLETED)


def test_summary_counts_tokens() -> None:
    """The summary reports turns, branches and token counts."""
    s = Session(TrialId("t"), "k")
    _add(s, None, [1, 2], [10], b"a")
    _add(s, 0, [3], [11, 12], b"b")
    summary = s.summary("http://x/t/v1")
    assert summary["turns"] == 2
    assert summary["branches"] == 1
    assert summary["tokens"] == {"sampled": 3, "context": 3, "stored": 6}


def test_turns_are_not_tracked_by_the_cyclic_garbage_collector() -> None:
    """A proxy holds millions of turns: a full collection must not have to scan them
    (each turn's own metadata dict is not shared with any other turn either)."""
    import gc

    session = Session(TrialId("t"), "k")
    node = _add(session, None, [1, 2], [3], b"k1")
    other = _add(session, 0, [4], [5], b"k2")
    assert not gc.is_tracked(node)
    assert not gc.is_tracked(node.meta)
    assert node.meta.extra is not other.meta.extra


def test_the_export_says_which_version_sampled_each_token() -> None:
    """``response_versions`` follows ``response_ids`` (-1 on context), and each turn lists
    its spans at absolute response positions: a turn that spans an update has two; a
    turn recorded without spans falls back to its ``extra["policy_version"]``, else 0."""
    s = Session(TrialId("t"), "k")
    first = _add(s, None, [1, 2], [10, 11, 12], b"a")
    first.meta.versions = [[1, 0, 2], [2, 2, 3]]
    second = _add(s, 0, [3, 4], [13, 14], b"b")
    second.meta.extra = {"policy_version": 2}
    _add(s, 1, [5], [15], b"c")
    (traj,) = s.export()["trajectories"]
    assert traj["response_ids"] == [10, 11, 12, 3, 4, 13, 14, 5, 15]
    assert traj["response_versions"] == [1, 1, 2, -1, -1, 2, 2, -1, 0]
    assert len(traj["response_versions"]) == len(traj["response_mask"])
    assert [t["versions"] for t in traj["turns"]] == [
        [[1, 0, 2], [2, 2, 3]],
        [[2, 5, 7]],
        [[0, 8, 9]],
    ]


def test_node_versions_cover_the_whole_completion_or_fall_back() -> None:
    """Spans that do not cover the completion are not trusted (the turn's version is used
    instead), and an empty completion has no spans."""
    s = Session(TrialId("t"), "k")
    node = _add(s, None, [1], [10, 11, 12], b"a")
    node.meta.versions = [[3, 0, 2]]
    node.meta.extra = {"policy_version": 5}
    assert node_versions(node) == [(5, 0, 3)]
    node.meta.versions = [[3, 0, 2], [4, 2, 3]]
    assert node_versions(node) == [(3, 0, 2), (4, 2, 3)]
    empty = _add(s, None, [2], [], b"b")
    empty.meta.versions = []
    assert node_versions(empty) == []


def _tree() -> Session:
    """Turns 0-1-2-3 in a line, 4 and 5 branching off 1, 6 off 4, and a second root 7."""
    s = Session(TrialId("t"), "k")
    shape: list[int | None] = [None, 0, 1, 2, 1, 1, 4, None]
    for i, parent in enumerate(shape):
        _add(
            s,
            parent,
            [100 * i + j for j in range(i % 3 + 1)],
            [100 * i + 50, 100 * i + 51],
            b"%d" % i,
        )
    return s


def _gathered(s: Session, index: int) -> list[int]:
    return [t for node in s.path(index) for t in (*node.context_ids, *node.completion_ids)]


@pytest.mark.parametrize(
    "order",
    [
        [0, 1, 2, 3],  # each child after its parent
        [1, 4, 6, 5, 2],  # a child, a grandchild, then siblings
        [4, 5, 4, 5, 2],  # sibling after sibling
        [6, 0, 6, 7, 1],  # a leaf, then the root, another root
        [3, 3, 3, 2, 3, 7, 0, 1],  # repeated, and back to the child of the kept one
    ],
)
def test_context_ids_is_the_path_concatenated_in_any_order(order: list[int]) -> None:
    """Whichever turn was built last, a turn's context is its path's tokens; and the
    array returned is the caller's to extend."""
    s = _tree()
    for index in [*order, *range(len(s.nodes))]:
        ids = s.context_ids(index)
        assert ids.tolist() == _gathered(s, index), index
        ids.extend([-1, -2])  # what plan_turn does with a continuation's context
        ids[0] = -3
    for index in range(len(s.nodes)):
        assert s.context_ids(index).tolist() == _gathered(s, index)


def test_stored_tokens_is_kept_as_turns_are_added() -> None:
    """After every turn, the session's stored-token count is the sum over its turns."""
    s = Session(TrialId("t"), "k")
    assert s.stored_tokens == 0
    for i, parent in enumerate([None, 0, 1, 0, None, 4]):
        _add(s, parent, list(range(i + 2)), list(range(i * 2)), b"%d" % i)
        assert s.stored_tokens == sum(len(n.context_ids) + len(n.completion_ids) for n in s.nodes)
    assert s.summary("http://x/t/v1")["tokens"]["stored"] == s.stored_tokens


def test_completing_a_session_drops_its_memory() -> None:
    """A completed session keeps neither its recent histories nor its last context."""
    s = Session(TrialId("t"), "k")
    _add(s, None, [1, 2], [3], b"a")
    s.context_ids(0)
    raws: list[object] = [b"one", b"two"]
    converted: list[int] = []

    def convert(raw: object, index: int) -> ChatMessage:
        converted.append(index)
        return ChatMessage("user", str(raw))

    s.history.messages(raws, convert)
    s.history.messages(raws, convert)
    assert converted == [0, 1]  # remembered while active
    assert s.last_context is not None
    s.transition(SessionState.COMPLETED)
    assert s.last_context is None
    s.history.messages(raws, convert)
    assert converted == [0, 1, 0, 1]  # forgotten
