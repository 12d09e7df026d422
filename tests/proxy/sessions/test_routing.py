"""Routing rows as a session keeps them: a turn's rows cut from what its call gathered,
the export assembled over a chain (row i = position i of prompt_ids + response_ids), the
missing ranges and versions, and the store's BLOB with its migration from version 3."""

from __future__ import annotations

import base64
import json
import sqlite3
from array import array
from pathlib import Path

from proxy.sessions.model import Session, TrialId, TurnMeta, TurnNode
from proxy.sessions.options import SessionOptions
from proxy.sessions.routing import TurnRouting, turn_routing
from proxy.sessions.store import DB_NAME, SCHEMA_VERSION, SessionStore
from relay import protocol
from tests.proxy.sessions.layouts import drop_agents, drop_routing

SHAPE = protocol.RoutingShape(layers=2, top_k=2, experts=8)  # 4 bytes a row, uint8


def row(position: int) -> bytes:
    """The row a test engine gives position ``position``: experts told apart by place."""
    return bytes((position * 3 + slot) % 8 for slot in range(SHAPE.layers * SHAPE.top_k))


def rows(start: int, end: int) -> bytes:
    return b"".join(row(p) for p in range(start, end))


def test_a_turn_keeps_only_its_positions_and_names_what_is_missing() -> None:
    """Rows past the turn's last position are dropped, rows not given are missing, and the
    versions keep to the rows that came."""
    whole = turn_routing(SHAPE, 5, 9, 5, rows(5, 11), (), ((3, 5, 11),))
    assert (whole.start, whole.rows, whole.data) == (5, 4, rows(5, 9))
    assert (whole.missing, whole.versions) == ((), ((3, 5, 9),))
    short = turn_routing(SHAPE, 5, 9, 5, rows(5, 7), (), ((3, 5, 7),))
    assert short.data == rows(5, 7) + bytes(8)
    assert short.missing == ((7, 9),)
    none = turn_routing(SHAPE, 5, 9, 5, b"")
    assert none.missing == ((5, 9),)
    assert none.data == bytes(16)
    assert none.versions == ()
    gap = turn_routing(SHAPE, 5, 9, 5, bytes(8) + rows(7, 9), ((5, 7),), ((1, 7, 9),))
    assert gap.missing == ((5, 7),)


def _node(session: Session, parent: int | None, context: int, sampled: int) -> TurnNode:
    """A turn whose rows are the test engine's, asked from where its chain's rows end."""
    prompt_len = context + (session.nodes[parent].end if parent is not None else 0)
    end = prompt_len + sampled
    start = 0 if parent is None else session.nodes[parent].end - 1
    version = len(session.nodes)
    node = TurnNode(
        index=len(session.nodes),
        parent=parent,
        context_ids=array("i", range(100, 100 + context)),
        completion_ids=array("i", range(200, 200 + sampled)),
        logprobs=array("f", [-0.5] * sampled),
        prompt_len=prompt_len,
        key=bytes([len(session.nodes)]) * 16,
        meta=TurnMeta("openai.chat", "moe", "m", "w", "stop", {}, 0.0, 0.0, 0.0, "continued"),
        routing=turn_routing(
            SHAPE, start, end - 1, start, rows(start, end), (), ((version, start, end),)
        ),
    )
    session.add_turn(node)
    return node


def _session() -> Session:
    """A chain of two turns and a branch from the first."""
    s = Session(TrialId("moe"), "k", options=SessionOptions(routed_experts=True))
    _node(s, None, 6, 3)  # positions 0..8, rows 0..7
    _node(s, 0, 4, 2)  # positions 9..14, rows 8..13
    _node(s, 0, 2, 5)  # a branch: positions 9..15, rows 8..14
    return s


def test_the_export_assembles_each_chain_and_its_versions() -> None:
    """Each trajectory's rows are every position of prompt + response but the last, each
    turn's after its parent's; the versions say which turn's forward made which rows."""
    s = _session()
    first, second = (t["routed_experts"] for t in s.export()["trajectories"])
    assert first["dtype"] == "uint8"
    assert first["shape"] == [14, 2, 2]
    assert base64.b64decode(first["data"]) == rows(0, 14)
    assert first["missing"] == []
    assert first["versions"] == [[0, 0, 8], [1, 8, 14]]
    assert second["shape"] == [15, 2, 2]
    assert base64.b64decode(second["data"]) == rows(0, 15)
    assert second["versions"] == [[0, 0, 8], [2, 8, 15]]
    traj = s.export()["trajectories"][0]
    assert len(traj["prompt_ids"]) + len(traj["response_ids"]) - 1 == 14
    assert [t["routing_missing"] for t in traj["turns"]] == [False, False]


def test_a_turn_without_its_rows_is_marked_and_its_positions_missing() -> None:
    s = _session()
    s.nodes[1].routing = turn_routing(SHAPE, 8, 14, 8, rows(8, 10))
    traj = s.export()["trajectories"][0]
    assert traj["routed_experts"]["missing"] == [[10, 14]]
    assert base64.b64decode(traj["routed_experts"]["data"]) == rows(0, 10) + bytes(16)
    assert [t["routing_missing"] for t in traj["turns"]] == [False, True]
    assert s.summary("u")["routing_missing_turns"] == 1


def test_nothing_of_routing_is_exported_unless_asked() -> None:
    s = _session()
    s.options = SessionOptions()
    for traj in s.export()["trajectories"]:
        assert "routed_experts" not in traj
        assert all("routing_missing" not in turn for turn in traj["turns"])
    assert "routing_missing_turns" not in s.summary("u")


async def test_rows_are_stored_as_a_blob_with_their_turn(tmp_path: Path) -> None:
    """The rows are one BLOB in the turn's row, committed when the turn is (another
    connection sees them before the store closes, as a process would after a kill), and
    reload byte for byte."""
    s = _session()
    store = await SessionStore.open(tmp_path)
    await store.save_session(s)
    for node in s.nodes:
        await store.save_turn(s, node)
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        stored = db.execute("SELECT routing, routing_head FROM turns WHERE idx=1").fetchone()
    assert stored[0] == rows(8, 14)
    assert json.loads(stored[1])["start"] == 8
    await store.close()
    store = await SessionStore.open(tmp_path)
    (loaded,) = (await store.load()).sessions
    await store.close()
    assert loaded.options.routed_experts
    assert [n.routing for n in loaded.nodes] == [n.routing for n in s.nodes]
    assert json.dumps(loaded.export()) == json.dumps(s.export())


async def test_a_version_3_store_gains_the_routing_columns(tmp_path: Path) -> None:
    """A store written before routing opens: its turns have no rows, new ones can."""
    s = Session(TrialId("old"), "k")
    _node(s, None, 3, 2).routing = None
    store = await SessionStore.open(tmp_path)
    await store.save_session(s)
    await store.save_turn(s, s.nodes[0])
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    drop_routing(db)
    drop_agents(db)
    db.execute("UPDATE relay_meta SET value='3' WHERE key='schema_version'")
    db.commit()
    db.close()
    store = await SessionStore.open(tmp_path)
    (loaded,) = (await store.load()).sessions
    assert loaded.nodes[0].routing is None
    moe = _session()
    await store.save_session(moe)
    await store.save_turn(moe, moe.nodes[0])
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    (version,) = db.execute("SELECT value FROM relay_meta WHERE key='schema_version'").fetchone()
    db.close()
    assert int(version) == SCHEMA_VERSION == 7
    store = await SessionStore.open(tmp_path)
    sessions = {x.trial_id: x for x in (await store.load()).sessions}
    await store.close()
    assert isinstance(sessions["moe"].nodes[0].routing, TurnRouting)
