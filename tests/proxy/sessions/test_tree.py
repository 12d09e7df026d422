"""A session's tree as nodes: each token once, and every trajectory of the export exactly
the concatenation of its path's nodes, for every shape a session takes."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import pytest

from proxy.images import ImageData, MediaType
from proxy.sessions.agents import SpawnedBy, TurnAgent
from proxy.sessions.model import PlacedImage, Session, TrialId, TurnMeta, TurnNode
from proxy.sessions.teacher import TurnTeacher
from proxy.sessions.tree import session_tree


def _meta(reason: str = "continued", **fields: Any) -> TurnMeta:
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
        **fields,
    )


def _add(
    s: Session,
    parent: int | None,
    context: list[int],
    completion: list[int],
    *,
    agent: TurnAgent | None = None,
    images: tuple[PlacedImage, ...] = (),
    **meta: Any,
) -> TurnNode:
    index = len(s.nodes)
    node = TurnNode(
        index=index,
        parent=parent,
        context_ids=array("i", context),
        completion_ids=array("i", completion),
        logprobs=array("f", [-0.25 * (index + 1)] * len(completion)),
        prompt_len=len(context) + (s.nodes[parent].end if parent is not None else 0),
        key=b"k%d" % index,
        meta=_meta(
            meta.pop("branch_reason", "continued" if parent is not None else "new_session"), **meta
        ),
        images=images,
    )
    if agent is not None:
        node.agent = agent
    s.add_turn(node)
    return node


def _chain() -> Session:
    s = Session(TrialId("t"), "k")
    _add(s, None, [1, 2, 3], [10, 11])
    _add(s, 0, [4, 5], [12])
    return s


def _fork() -> Session:
    """Resumed from an older point: two leaves under the root."""
    s = _chain()
    _add(s, 0, [6], [13, 14])
    _add(s, 1, [7], [15])
    return s


def _rewrite() -> Session:
    """The history rewritten: a second root repeating the first's system prompt."""
    s = _chain()
    _add(s, None, [1, 2, 9], [16], branch_reason="history_rewritten")
    _add(s, 2, [8], [])  # an empty completion (aborted at once)
    return s


def _retry() -> Session:
    """A reply cut mid-stream and never delivered, then the client's retry of it."""
    s = _chain()
    _add(s, 1, [20, 21], [30, 31], truncated=True, delivered=False)
    _add(s, 1, [20, 21], [32], retry_of=2)
    _add(s, 3, [22], [33])
    return s


def _sub_agents() -> Session:
    """A main agent that spawns a sub-agent, whose chain is a root of its own."""
    s = Session(TrialId("t"), "k")
    _add(s, None, [1, 2], [10])
    sub = TurnAgent(id="a1", parent="main", kind="subagent", spawned_by=SpawnedBy(0, "call-1"))
    _add(s, None, [1, 3], [11], agent=sub)
    _add(s, 1, [4], [12], agent=sub)
    _add(s, 0, [5], [13])
    return s


def _images() -> Session:
    """Images in two turns' contexts, the first again in a branch."""
    s = Session(TrialId("t"), "k")
    a = ImageData("a" * 64, MediaType.PNG, 64, 48, b"\x89PNG a")
    b = ImageData("b" * 64, MediaType.JPEG, 32, 32, b"\xff\xd8 b")
    s.images = {a.sha256: a, b.sha256: b}
    _add(s, None, [1, 7, 7, 2], [10], images=(PlacedImage(a.sha256, 1, 3),))
    _add(s, 0, [3, 7, 4], [11], images=(PlacedImage(b.sha256, 6, 7),))
    _add(s, 0, [5, 7, 7], [12], images=(PlacedImage(a.sha256, 6, 8),))
    return s


def _versions() -> Session:
    """A reply whose weights changed mid-way (two version spans)."""
    s = Session(TrialId("t"), "k")
    _add(s, None, [1], [10, 11, 12], versions=[[3, 0, 1], [4, 1, 3]])
    _add(s, 0, [2], [13], extra={"policy_version": 5})
    return s


def _teacher() -> Session:
    """A teacher scored every turn that sampled (one sampled nothing: it has no score)."""
    s = _fork()
    _add(s, 3, [8], [])
    for node in s.nodes:
        if node.completion_ids:
            scores = [-0.5 - 0.1 * i for i in range(len(node.completion_ids))]
            node.teacher = TurnTeacher("teacher", array("f", scores))
    return s


SHAPES: dict[str, Callable[[], Session]] = {
    "chain": _chain,
    "fork": _fork,
    "rewrite": _rewrite,
    "retry": _retry,
    "sub_agents": _sub_agents,
    "images": _images,
    "versions": _versions,
    "teacher": _teacher,
}


def _joined(nodes: dict[int, dict[str, Any]], path: list[int], key: str) -> list[Any]:
    return [value for n in path for value in nodes[n][key]]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_trajectory_is_its_path_of_nodes(shape: str) -> None:
    """Each trajectory's prompt + response ids, mask, logprobs, versions and images are
    exactly its ``nodes``' concatenated (the prompt with mask 0, logprob 0.0, version -1)."""
    s = SHAPES[shape]()
    nodes = {n["id"]: n for n in session_tree(s)["nodes"]}
    for traj in s.export()["trajectories"]:
        path, prompt = traj["nodes"], traj["prompt_ids"]
        assert path == [t["turn"] for t in traj["turns"]]
        assert [nodes[n]["parent"] for n in path] == [None, *path[:-1]]
        assert _joined(nodes, path, "ids") == prompt + traj["response_ids"]
        assert _joined(nodes, path, "mask") == [0] * len(prompt) + traj["response_mask"]
        logprobs = [0.0] * len(prompt) + traj["response_logprobs"]
        assert _joined(nodes, path, "logprobs") == logprobs
        versions = [-1] * len(prompt) + traj["response_versions"]
        assert _joined(nodes, path, "versions") == versions
        images = traj.get("multi_modal_data", {}).get("images", [])
        assert _joined(nodes, path, "images") == images
        if "teacher_logprobs" in traj:  # a node that sampled nothing counts as zeros
            scored = [
                v
                for n in path
                for v in nodes[n].get("teacher_logprobs", [0.0] * len(nodes[n]["ids"]))
            ]
            assert scored == [0.0] * len(prompt) + traj["teacher_logprobs"]
            assert {nodes[n].get("teacher_model") for n in path} <= {traj["teacher_model"], None}
        ends = [nodes[n]["start"] + len(nodes[n]["ids"]) for n in path]
        assert ends == [len(prompt) + t["response_end"] for t in traj["turns"]]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_stored_token_is_in_exactly_one_node(shape: str) -> None:
    """One node per turn, in turn order, holding that turn's tokens: together the tokens
    the session stores, each once."""
    s = SHAPES[shape]()
    tree = session_tree(s)
    assert tree["trial_id"] == s.trial_id
    assert [n["id"] for n in tree["nodes"]] == list(range(len(s.nodes)))
    assert [n["turns"] for n in tree["nodes"]] == [[i] for i in range(len(s.nodes))]
    assert sum(len(n["ids"]) for n in tree["nodes"]) == s.stored_tokens
    assert sum(sum(n["mask"]) for n in tree["nodes"]) == s.sampled_tokens
    for node in tree["nodes"]:
        turn = s.nodes[node["id"]]
        assert node["ids"] == turn.context_ids.tolist() + turn.completion_ids.tolist()
        assert len(node["mask"]) == len(node["logprobs"]) == len(node["versions"])
        assert ("teacher_logprobs" in node) == (shape == "teacher" and bool(turn.completion_ids))


def test_a_node_says_whose_it_is_and_whether_the_agent_had_it() -> None:
    """Agent, delivery and the attempt a retry replaces come with the node, so a trainer
    can leave out what ``build_samples`` leaves out from the tree alone."""
    s = _retry()
    nodes = session_tree(s)["nodes"]
    assert [(n["delivered"], n["retry_of"]) for n in nodes] == [
        (True, None),
        (True, None),
        (False, None),
        (True, 2),
        (True, None),
    ]
    sub = session_tree(_sub_agents())["nodes"]
    assert [n["agent"]["id"] for n in sub] == ["main", "a1", "a1", "main"]
    assert sub[1]["agent"] == {"id": "a1", "parent": "main", "kind": "subagent"}


def test_versions_cover_each_sampled_token_and_minus_one_elsewhere() -> None:
    """A reply sampled across a weight update carries both versions, per token; a turn
    from before per-token versions falls back to its recorded policy version."""
    nodes = session_tree(_versions())["nodes"]
    assert nodes[0]["versions"] == [-1, 3, 4, 4]
    assert nodes[1]["versions"] == [-1, 5]
    assert nodes[1]["start"] == 4
