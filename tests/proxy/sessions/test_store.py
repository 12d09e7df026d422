"""The SQLite session store: exact round trips, WAL mode, commit-before-ack, damage."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from array import array
from pathlib import Path

import msgspec
import pytest

from proxy.exceptions import StorageError
from proxy.images import ImageData, MediaType
from proxy.sessions.model import (
    CompletedBy,
    PlacedImage,
    Session,
    SessionState,
    TrialId,
    TurnMeta,
    TurnNode,
)
from proxy.sessions.options import HistoryPolicy, SessionOptions
from proxy.sessions.store import (
    DB_NAME,
    SCHEMA_VERSION,
    SessionStore,
    decode_array,
    encode_array,
)
from proxy.sessions.teacher import TurnTeacher
from tests.proxy.sessions.layouts import (
    drop_agents,
    drop_routing,
    drop_server_errors,
    drop_teacher,
)


def _meta(reason: str, **extra: str | int | float) -> TurnMeta:
    return TurnMeta(
        api="openai.chat",
        model="tiny",
        requested_model="gpt-x",
        worker_id="w1",
        finish_reason="stop",
        sampling={"temperature": 0.7, "top_p": 0.95, "seed": 3, "max_tokens": 16},
        created_at=1_700_000_000.123456789,
        queue_seconds=0.0001234567891,
        engine_seconds=1.23456789012345,
        branch_reason=reason,
        tool_calls=1,
        malformed_tool_call="<tool_call>{",
        truncated=reason == "new_branch",
        stop_sequence="###",
        tool_choice_unmet=False,
        extra=dict(extra),
    )


def _add(
    session: Session, parent: int | None, context: list[int], completion: list[int], key: bytes
) -> TurnNode:
    prompt_len = len(context) + (session.nodes[parent].end if parent is not None else 0)
    node = TurnNode(
        index=len(session.nodes),
        parent=parent,
        context_ids=array("i", context),
        completion_ids=array("i", completion),
        # float32 values that are not round in decimal: a text round trip would change them.
        logprobs=array("f", [-0.1 * (i + 1) / 3 for i in range(len(completion))]),
        prompt_len=prompt_len,
        key=key,
        meta=_meta("continued" if parent is not None else "new_session", num=len(completion)),
    )
    session.add_turn(node)
    return node


def _tree() -> Session:
    """Two roots; the first has a continuation and a branch resumed from its root."""
    s = Session(
        TrialId("trial-1"),
        "rr-trial-1.secret",
        metadata={"task": "fix bug", "nested": {"a": [1, 2.5, None]}},
        sampling={"temperature": 1.0, "max_tokens": 64},
        model="tiny",
    )
    _add(s, None, [1, 2, 3, 2_000_000_000], [10, 11, -1], b"k0" * 8)
    _add(s, 0, [4, 5], [12], b"k1" * 8)
    _add(s, 0, [6], [13, 14, 15], b"k2" * 8)
    _add(s, None, [7, 8], [], b"k3" * 8)  # an empty completion (aborted at once)
    _add(s, 1, [9], [16], b"k4" * 8)
    return s


async def _stored(path: Path, session: Session) -> SessionStore:
    """A store at ``path`` holding ``session`` and every turn of it (left open)."""
    store = await SessionStore.open(path)
    await store.save_session(session)
    for node in session.nodes:
        await store.save_turn(session, node)
    return store


async def _reopen(path: Path) -> tuple[SessionStore, list[Session]]:
    store = await SessionStore.open(path)
    loaded = await store.load()
    return store, loaded.sessions


def test_arrays_round_trip_bit_exactly() -> None:
    """Token ids and float32 logprobs come back identical, 4 bytes an item."""
    ids = array("i", [0, 1, -1, 2**31 - 1, -(2**31)])
    lps = array("f", [-0.0, -1e-30, -123.456, float("-inf")])
    assert decode_array("i", encode_array(ids)) == ids
    assert decode_array("f", encode_array(lps)).tobytes() == lps.tobytes()
    assert len(encode_array(ids)) == 4 * len(ids)
    with pytest.raises(ValueError, match="whole number"):
        decode_array("i", b"\x00" * 5)


async def test_sessions_turns_and_branches_round_trip(tmp_path: Path) -> None:
    """A tree with branches, a completed state and a dict reward reloads identically:
    same export, summary, continuation keys and child counts."""
    s = _tree()
    store = await _stored(tmp_path, s)
    s.transition(SessionState.COMPLETED, by=CompletedBy.IDLE_TIMEOUT)
    s.reward = {"tests": 1.0, "style": 0.25}
    s.fetched_at = 1_700_000_100.5
    await store.save_session(s)
    other = Session(TrialId("trial-2"), "rr-trial-2.x", model=None)
    await store.save_session(other)
    await store.close()

    store, (a, b) = await _reopen(tmp_path)
    await store.close()
    assert a.trial_id == "trial-1"
    assert b.trial_id == "trial-2"
    assert b.nodes == []
    assert b.state is SessionState.ACTIVE
    assert json.dumps(a.export()) == json.dumps(s.export())
    assert json.dumps(a.summary("u")) == json.dumps(s.summary("u"))
    assert a.api_key == s.api_key
    assert a.completed_by is CompletedBy.IDLE_TIMEOUT
    assert a.by_key == s.by_key
    assert [n.children for n in a.nodes] == [n.children for n in s.nodes] == [2, 1, 0, 0, 0]
    for x, y in zip(a.nodes, s.nodes, strict=True):
        assert x.logprobs.tobytes() == y.logprobs.tobytes()
        assert x.meta == y.meta
    assert a.find_continuation([b"", b"k1" * 8, b"new"]) == (1, 1)


async def test_wal_mode_is_on_and_persists_in_the_file(tmp_path: Path) -> None:
    """The store runs in WAL mode, and the database file stays in WAL mode for any reader."""
    store = await SessionStore.open(tmp_path)
    assert await store.journal_mode() == "wal"
    await store.save_session(Session(TrialId("t"), "k"))
    assert (tmp_path / f"{DB_NAME}-wal").exists()
    await store.close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_write_is_committed_when_its_future_resolves(tmp_path: Path) -> None:
    """Once ``save_turn`` resolves, another connection (another process after a crash)
    already sees the turn: nothing waits in a buffer."""
    s = _tree()
    store = await SessionStore.open(tmp_path)
    await store.save_turn(s, s.nodes[0])
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        rows = db.execute("SELECT trial_id, idx FROM turns").fetchall()
        state = db.execute("SELECT state FROM sessions").fetchall()
    await store.close()
    assert rows == [("trial-1", 0)]
    assert state == [("active",)]


async def test_concurrent_writes_keep_their_order(tmp_path: Path) -> None:
    """Many turns submitted at once (group commit) are all stored, in submission order."""
    s = Session(TrialId("busy"), "k")
    store = await SessionStore.open(tmp_path)
    writes = []
    for i in range(300):
        node = _add(s, i - 1 if i else None, [i], [i + 1], i.to_bytes(16, "big"))
        writes.append(store.save_turn(s, node))
    await asyncio.gather(*writes)
    await store.close()
    store, (restored,) = await _reopen(tmp_path)
    await store.close()
    assert [n.index for n in restored.nodes] == list(range(300))
    assert json.dumps(restored.export()) == json.dumps(s.export())


async def test_delete_removes_turns_and_remembers_the_id(tmp_path: Path) -> None:
    """A deleted session leaves no rows behind, only a tombstone; old tombstones are pruned."""
    store = await SessionStore.open(tmp_path, tombstones=2)
    s = _tree()
    await store.save_session(s)
    for node in s.nodes:
        await store.save_turn(s, node)
    for name in ("trial-1", "x", "y"):
        await store.delete_session(name, deleted_at={"trial-1": 1.0, "x": 2.0, "y": 3.0}[name])
    loaded = await store.load()
    await store.close()
    assert loaded.sessions == []
    assert loaded.tombstones == ["x", "y"]
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        assert db.execute("SELECT count(*) FROM turns").fetchone()[0] == 0


async def test_absent_directory_and_database_are_created(tmp_path: Path) -> None:
    """A data dir that does not exist yet is created, with an empty store."""
    where = tmp_path / "a" / "b"
    store = await SessionStore.open(where)
    loaded = await store.load()
    await store.close()
    assert loaded.sessions == []
    assert (where / DB_NAME).is_file()


async def test_a_corrupt_database_refuses_to_open(tmp_path: Path) -> None:
    """A file that is not a SQLite database is an error naming the file, not a silent
    fresh start that would hide the loss."""
    (tmp_path / DB_NAME).write_bytes(b"this is not a database at all" * 200)
    with pytest.raises(StorageError, match=DB_NAME):
        await SessionStore.open(tmp_path)
    assert (tmp_path / DB_NAME).read_bytes().startswith(b"this is not")


async def test_an_unusable_data_dir_is_an_error(tmp_path: Path) -> None:
    """A data dir that is a file cannot hold the store."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="data directory"):
        await SessionStore.open(tmp_path / "file")


async def test_a_damaged_session_is_skipped_and_the_rest_restored(tmp_path: Path) -> None:
    """One undecodable turn row costs only its session; the rows stay for inspection."""
    store = await SessionStore.open(tmp_path)
    good, bad = _tree(), Session(TrialId("bad"), "k")
    _add(bad, None, [1], [2], b"b" * 16)
    for s in (good, bad):
        for node in s.nodes:
            await store.save_turn(s, node)
    await store.close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.execute("UPDATE turns SET completion_ids = x'0102030405' WHERE trial_id = 'bad'")
    store = await SessionStore.open(tmp_path)
    loaded = await store.load()
    await store.close()
    assert [s.trial_id for s in loaded.sessions] == ["trial-1"]
    assert loaded.skipped == ["bad"]
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        assert db.execute("SELECT count(*) FROM turns WHERE trial_id='bad'").fetchone()[0] == 1


async def test_writes_after_close_are_refused(tmp_path: Path) -> None:
    """A closed store raises a storage error instead of dropping a write silently."""
    store = await SessionStore.open(tmp_path)
    await store.close()
    with pytest.raises(StorageError, match="closed"):
        store.save_session(Session(TrialId("t"), "k"))


async def test_options_round_trip(tmp_path: Path) -> None:
    """A session's options (history policy, template variables) reload as they were."""
    s = Session(
        TrialId("trial-o"),
        "rr-trial-o.x",
        options=SessionOptions(HistoryPolicy.TEMPLATE, {"enable_thinking": False}),
    )
    store = await SessionStore.open(tmp_path)
    await store.save_session(s)
    await store.close()
    store, (loaded,) = await _reopen(tmp_path)
    await store.close()
    assert loaded.options == s.options


async def test_a_version_1_store_is_migrated_in_place(tmp_path: Path) -> None:
    """A store written before session options existed opens: its sessions get the default
    options, its turns are intact, and the file is at the current version after."""
    store = await SessionStore.open(tmp_path)
    s = _tree()
    await store.save_session(s)
    for node in s.nodes:
        await store.save_turn(s, node)
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)  # back to the version 1 layout
    db.execute("ALTER TABLE sessions DROP COLUMN options")
    drop_routing(db)
    db.execute("ALTER TABLE turns DROP COLUMN images")
    db.execute("DROP TABLE images")
    drop_agents(db)
    db.execute("UPDATE relay_meta SET value='1' WHERE key='schema_version'")
    db.commit()
    db.close()

    store, (loaded,) = await _reopen(tmp_path)
    await store.close()
    assert loaded.options == SessionOptions()
    assert json.dumps(loaded.export()) == json.dumps(s.export())
    db = sqlite3.connect(tmp_path / DB_NAME)
    (version,) = db.execute("SELECT value FROM relay_meta WHERE key='schema_version'").fetchone()
    db.close()
    assert int(version) == SCHEMA_VERSION == 7


async def test_version_spans_round_trip(tmp_path: Path) -> None:
    """A turn's version spans are stored with it and reload identically, so an export
    after a restart still says which version sampled each token."""
    s = _tree()
    s.nodes[0].meta.versions = [[1, 0, 1], [2, 1, 3]]
    s.nodes[2].meta.versions = [[2, 0, 3]]
    store = await _stored(tmp_path, s)
    await store.close()
    store, (loaded,) = await _reopen(tmp_path)
    await store.close()
    assert [n.meta.versions for n in loaded.nodes] == [
        [[1, 0, 1], [2, 1, 3]],
        [],
        [[2, 0, 3]],
        [],
        [],
    ]
    assert loaded.export() == s.export()
    versions = [t["response_versions"] for t in loaded.export()["trajectories"]]
    assert versions[0][:3] == [1, 2, 2]


async def test_delivery_is_saved_after_the_turn_and_old_rows_count_as_delivered(
    tmp_path: Path,
) -> None:
    """A turn's metadata is rewritten in place (its delivery, recorded after the commit),
    and a row written before delivery was recorded reads as delivered unless it was cut."""
    store = await SessionStore.open(tmp_path)
    session = _tree()
    session.nodes[2].meta.truncated = True
    for node in session.nodes:
        node.meta.delivered = False  # as the proxy records a turn, before its reply's end
    await store.save_session(session)
    for node in session.nodes:
        await store.save_turn(session, node)
    session.nodes[0].meta.delivered = True
    session.nodes[0].meta.replays = 2
    await store.save_turn_meta(session, session.nodes[0])
    # Rows from before: their metadata has no "delivered" at all.
    for index in (1, 2):  # turn 2 was cut (truncated), turn 1 not
        meta = msgspec.json.decode(msgspec.json.encode(session.nodes[index].meta))
        del meta["delivered"]
        await store._submit(
            lambda db, m=meta, i=index: db.execute(
                "UPDATE turns SET meta=? WHERE trial_id=? AND idx=?",
                (json.dumps(m), "trial-1", i),
            )
        )
    await store.close()
    store, (loaded,) = await _reopen(tmp_path)
    await store.close()
    assert loaded.nodes[0].meta.delivered is True
    assert loaded.nodes[0].meta.replays == 2
    assert loaded.nodes[1].meta.delivered is True
    assert loaded.nodes[2].meta.truncated is True
    assert loaded.nodes[2].meta.delivered is False
    assert loaded.nodes[3].meta.delivered is False  # recorded, never delivered


def _with_images(s: Session) -> tuple[ImageData, ImageData]:
    """Images in two turns' contexts: the first in turn 0, both again in turn 1."""
    a = ImageData("a" * 64, MediaType.PNG, 64, 48, b"\x89PNG first")
    b = ImageData("b" * 64, MediaType.JPEG, 1280, 800, b"\xff\xd8 second")
    s.images = {a.sha256: a, b.sha256: b}
    s.nodes[0].images = (PlacedImage(a.sha256, 1, 3),)
    s.nodes[1].images = (PlacedImage(a.sha256, 7, 8), PlacedImage(b.sha256, 8, 9))
    return a, b


async def test_images_are_stored_once_with_the_turn_that_first_uses_them(tmp_path: Path) -> None:
    """A turn's images commit in the turn's own transaction (a crash after the ack loses
    none), each image once per trial however many turns hold it; they reload with their
    places, and the export names them in order."""
    s = _tree()
    a, b = _with_images(s)
    store = await SessionStore.open(tmp_path)
    await store.save_session(s)
    await store.save_turn(s, s.nodes[0])
    db = sqlite3.connect(tmp_path / DB_NAME)  # another reader: what is committed now
    assert db.execute("SELECT sha256 FROM images").fetchall() == [(a.sha256,)]
    for node in s.nodes[1:]:
        await store.save_turn(s, node)
    rows = db.execute("SELECT sha256, media_type, data FROM images ORDER BY sha256").fetchall()
    db.close()
    assert rows == [(a.sha256, "image/png", a.data), (b.sha256, "image/jpeg", b.data)]
    await store.close()
    store, (loaded,) = await _reopen(tmp_path)
    await store.close()
    assert loaded.images == s.images
    assert [n.images for n in loaded.nodes] == [n.images for n in s.nodes]
    assert json.dumps(loaded.export()) == json.dumps(s.export())
    (trajectory,) = [
        t for t in loaded.export()["trajectories"] if [u["turn"] for u in t["turns"]] == [0, 1, 4]
    ]
    assert [i["span"] for i in trajectory["multi_modal_data"]["images"]] == [[1, 3], [7, 8], [8, 9]]


async def test_a_turn_whose_images_are_missing_is_not_restored(tmp_path: Path) -> None:
    """A damaged store (a turn naming an image it lacks) skips that session, loudly,
    rather than exporting spans without pixels."""
    s = _tree()
    _with_images(s)
    store = await _stored(tmp_path, s)
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("DELETE FROM images WHERE sha256 = ?", ("b" * 64,))
    db.commit()
    db.close()
    store = await SessionStore.open(tmp_path)
    state = await store.load()
    await store.close()
    assert state.sessions == []
    assert state.skipped == ["trial-1"]


async def test_deleting_a_session_deletes_its_images(tmp_path: Path) -> None:
    s = _tree()
    _with_images(s)
    store = await _stored(tmp_path, s)
    await store.delete_session(s.trial_id)
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    assert db.execute("SELECT COUNT(*) FROM images").fetchone() == (0,)
    db.close()


async def test_a_version_2_store_gains_image_columns(tmp_path: Path) -> None:
    """A store written before images opens: its turns have none, and new turns can."""
    store = await SessionStore.open(tmp_path)
    s = _tree()
    await store.save_session(s)
    for node in s.nodes:
        await store.save_turn(s, node)
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    drop_routing(db)
    db.execute("ALTER TABLE turns DROP COLUMN images")
    db.execute("DROP TABLE images")
    drop_agents(db)
    db.execute("UPDATE relay_meta SET value='2' WHERE key='schema_version'")
    db.commit()
    db.close()
    store, (loaded,) = await _reopen(tmp_path)
    assert all(n.images == () for n in loaded.nodes)
    assert json.dumps(loaded.export()) == json.dumps(s.export())
    await store.close()


async def test_a_version_5_store_gains_the_server_error_count(tmp_path: Path) -> None:
    """A store written before server errors were counted opens with none counted; a count
    saved after reloads as saved."""
    s = _tree()
    store = await _stored(tmp_path, s)
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    drop_server_errors(db)
    db.execute("UPDATE relay_meta SET value='5' WHERE key='schema_version'")
    db.commit()
    db.close()
    store, (loaded,) = await _reopen(tmp_path)
    assert loaded.server_errors == 0
    loaded.server_errors = 3
    await store.save_session(loaded)
    await store.close()
    store, (again,) = await _reopen(tmp_path)
    await store.close()
    assert again.server_errors == 3


def _teacher_scores(s: Session, model: str) -> dict[int, TurnTeacher]:
    """A score of ``model``'s for every turn of ``s`` that sampled (not round in decimal)."""
    return {
        n.index: TurnTeacher(
            model, array("f", [-0.7 * (i + 1) / 3 for i in range(len(n.completion_ids))])
        )
        for n in s.nodes
        if n.completion_ids
    }


async def test_a_teacher_s_logprobs_round_trip(tmp_path: Path) -> None:
    """A teacher's logprobs written into scored turns reload bit-exactly with its name; a
    turn scored anew by another teacher reloads with that one's; the export carries them."""
    s = _tree()
    store = await _stored(tmp_path, s)
    scores = _teacher_scores(s, "big")
    await store.save_teacher(s, scores)
    await store.save_teacher(s, {1: TurnTeacher("other", array("f", [-3.0]))})
    await store.close()
    store, (loaded,) = await _reopen(tmp_path)
    await store.close()
    first = loaded.nodes[0].teacher
    assert first == scores[0]
    assert first is not None
    assert first.logprobs.tobytes() == scores[0].logprobs.tobytes()
    assert loaded.nodes[1].teacher == TurnTeacher("other", array("f", [-3.0]))
    assert loaded.nodes[3].teacher is None  # it sampled nothing
    by_leaf = {t["turns"][-1]["turn"]: t for t in loaded.export()["trajectories"]}
    assert by_leaf[2]["teacher_model"] == "big"
    assert "teacher_model" not in by_leaf[4]  # two teachers on its path


async def test_a_version_6_store_gains_teacher_columns(tmp_path: Path) -> None:
    """A store written before teachers opens with no turn scored, and a teacher's
    logprobs saved after reload as saved."""
    s = _tree()
    store = await _stored(tmp_path, s)
    await store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    drop_teacher(db)
    db.execute("UPDATE relay_meta SET value='6' WHERE key='schema_version'")
    db.commit()
    db.close()
    store, (loaded,) = await _reopen(tmp_path)
    assert all(n.teacher is None for n in loaded.nodes)
    assert json.dumps(loaded.export()) == json.dumps(s.export())
    scores = _teacher_scores(loaded, "big")
    await store.save_teacher(loaded, scores)
    await store.close()
    store, (again,) = await _reopen(tmp_path)
    await store.close()
    assert {n.index: n.teacher for n in again.nodes if n.teacher} == scores
