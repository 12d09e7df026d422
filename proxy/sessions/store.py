"""The durable copy of every session: an embedded SQLite database in WAL mode.

Every session (its configuration, state and reward) and every recorded turn is committed
here before the agent or the trainer is answered, so that after a crash (``kill -9``) the
proxy reloads exactly what it had acknowledged. Writes run on one dedicated thread, in the
order they were submitted; whatever is waiting when a transaction starts is committed with
it (group commit), so many concurrent turns share one fsync.

Token ids and logprobs are stored as little-endian int32 / float32 arrays (4 bytes a
token), a turn's metadata as JSON. An image's bytes are stored once per trial, by their
sha256, in the transaction of the first turn whose prompt holds it; a turn row names its
images and their places. A turn's routing rows (a session that asked for them) are one
BLOB of the C-order array as the engine sent it, beside a JSON head (their positions, the
missing ranges, the versions), in the turn's own row and transaction. A turn row holds only what the turn added (its context
and completion tokens); prefixes shared by branches are stored once, as in memory. A
teacher's logprobs of a turn's sampled tokens (float32, with the teacher's name) are written
into the turn's row once scored, every turn a teacher forcing scored in one transaction.

Durability: WAL with ``synchronous=FULL`` survives a crash of the process and of the
machine (SQLite docs, "Write-Ahead Logging" and "PRAGMA synchronous"). A turn's delivery, written
after the turn, is the exception: it commits without an fsync when nothing else is
queued (it survives the process, and the machine from the next commit on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from proxy.exceptions import StorageError
from proxy.images import ImageData, MediaType
from proxy.sessions.agents import MAIN_AGENT, TurnAgent
from proxy.sessions.model import (
    CompletedBy,
    Outcome,
    PlacedImage,
    Session,
    SessionState,
    TrialId,
    TurnMeta,
    TurnNode,
)
from proxy.sessions.options import SessionOptions
from proxy.sessions.routing import RoutingHead, TurnRouting
from proxy.sessions.teacher import TurnTeacher

__all__ = ["DB_NAME", "LoadedState", "SessionStore", "decode_array", "encode_array"]

log = logging.getLogger(__name__)

DB_NAME = "relay.db"
SCHEMA_VERSION = 7
# What each older schema version needs to become the next one.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ("ALTER TABLE sessions ADD COLUMN options TEXT NOT NULL DEFAULT '{}'",),  # options
    2: ("ALTER TABLE turns ADD COLUMN images TEXT NOT NULL DEFAULT '[]'",),  # a turn's images
    3: (  # a turn's routing rows (NULL: none recorded)
        "ALTER TABLE turns ADD COLUMN routing BLOB",
        "ALTER TABLE turns ADD COLUMN routing_head TEXT",
    ),
    4: (  # a turn's agent (NULL: the main agent), a trial's outcome and agents' rewards
        "ALTER TABLE turns ADD COLUMN agent TEXT",
        "ALTER TABLE sessions ADD COLUMN outcome TEXT",
        "ALTER TABLE sessions ADD COLUMN agent_rewards TEXT",
    ),
    5: ("ALTER TABLE sessions ADD COLUMN server_errors INTEGER NOT NULL DEFAULT 0",),
    6: (  # a teacher's logprobs of a turn's sampled tokens (NULL: not scored)
        "ALTER TABLE turns ADD COLUMN teacher_model TEXT",
        "ALTER TABLE turns ADD COLUMN teacher_logprobs BLOB",
    ),
}
# Writes waiting when a transaction starts that are committed with it.
_GROUP_COMMIT = 512

_SCHEMA = """
CREATE TABLE IF NOT EXISTS relay_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sessions (
    trial_id TEXT PRIMARY KEY,
    api_key TEXT NOT NULL,
    state TEXT NOT NULL,
    model TEXT,
    sampling TEXT NOT NULL,
    options TEXT NOT NULL DEFAULT '{}',
    metadata TEXT NOT NULL,
    reward TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    completed_at REAL,
    completed_by TEXT,
    fetched_at REAL,
    outcome TEXT,
    agent_rewards TEXT,
    server_errors INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS turns (
    trial_id TEXT NOT NULL REFERENCES sessions(trial_id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    parent INTEGER,
    context_ids BLOB NOT NULL,
    completion_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    prompt_len INTEGER NOT NULL,
    key BLOB NOT NULL,
    meta TEXT NOT NULL,
    images TEXT NOT NULL DEFAULT '[]',
    routing BLOB,
    routing_head TEXT,
    agent TEXT,
    teacher_model TEXT,
    teacher_logprobs BLOB,
    PRIMARY KEY (trial_id, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS images (
    trial_id TEXT NOT NULL REFERENCES sessions(trial_id) ON DELETE CASCADE,
    sha256 TEXT NOT NULL,
    media_type TEXT NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (trial_id, sha256)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tombstones (
    trial_id TEXT PRIMARY KEY,
    deleted_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tombstones_by_time ON tombstones(deleted_at);
"""

T = TypeVar("T")
_Op = Callable[[sqlite3.Connection], Any]


# ---------------------------------------------------------------------- encoding


def encode_array(values: array[int] | array[float]) -> bytes:
    """The array's items as little-endian bytes (4 bytes each)."""
    if values.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte i/f
        raise ValueError(f"expected 4-byte items, got {values.itemsize}")
    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array(values.typecode, values)  # pragma: no cover - big-endian hosts
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def decode_array(typecode: str, data: bytes) -> array[Any]:
    """Inverse of ``encode_array``."""
    out: array[Any] = array(typecode)
    if len(data) % out.itemsize:
        raise ValueError(f"{len(data)} bytes is not a whole number of {typecode!r} items")
    out.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        out.byteswap()
    return out


def _json(value: Any) -> str:
    """Compact JSON (msgspec: dataclasses such as ``TurnMeta`` directly, no ``asdict``)."""
    return msgspec.json.encode(value).decode()


def _session_row(s: Session) -> tuple[Any, ...]:
    return (
        s.trial_id,
        s.api_key,
        s.state.value,
        s.model,
        _json(s.sampling),
        _json(s.options.as_dict()),
        _json(s.metadata),
        None if s.reward is None else _json(s.reward),
        s.created_at,
        s.updated_at,
        s.completed_at,
        s.completed_by.value if s.completed_by is not None else None,
        s.fetched_at,
        s.outcome.value if s.outcome is not None else None,
        _json(s.agent_rewards) if s.agent_rewards else None,
        s.server_errors,
    )


def _turn_row(trial_id: str, n: TurnNode) -> tuple[Any, ...]:
    return (
        trial_id,
        n.index,
        n.parent,
        encode_array(n.context_ids),
        encode_array(n.completion_ids),
        encode_array(n.logprobs),
        n.prompt_len,
        n.key,
        _json(n.meta),
        _json(n.images),
        n.routing.data if n.routing is not None else None,
        _json(n.routing.head()) if n.routing is not None else None,
        None if n.agent == MAIN_AGENT else _json(n.agent),
        n.teacher.model if n.teacher is not None else None,
        encode_array(n.teacher.logprobs) if n.teacher is not None else None,
    )


def _image_rows(session: Session, node: TurnNode) -> list[tuple[Any, ...]]:
    rows = []
    for placed in node.images:
        image = session.images[placed.sha256]
        rows.append(
            (
                session.trial_id,
                image.sha256,
                image.media_type.value,
                image.width,
                image.height,
                image.data,
            )
        )
    return rows


def _session_from(row: sqlite3.Row) -> Session:
    reward = row["reward"]
    return Session(
        trial_id=TrialId(row["trial_id"]),
        api_key=row["api_key"],
        metadata=json.loads(row["metadata"]),
        sampling=json.loads(row["sampling"]),
        options=SessionOptions.from_dict(json.loads(row["options"])),
        model=row["model"],
        state=SessionState(row["state"]),
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        completed_at=row["completed_at"],
        completed_by=CompletedBy(row["completed_by"]) if row["completed_by"] else None,
        fetched_at=row["fetched_at"],
        reward=None if reward is None else json.loads(reward),
        outcome=Outcome(row["outcome"]) if row["outcome"] else None,
        agent_rewards=json.loads(row["agent_rewards"]) if row["agent_rewards"] else {},
        server_errors=row["server_errors"],
    )


def _image_from(row: sqlite3.Row) -> ImageData:
    return ImageData(
        row["sha256"], MediaType(row["media_type"]), row["width"], row["height"], bytes(row["data"])
    )


def _turn_from(row: sqlite3.Row) -> TurnNode:
    meta = json.loads(row["meta"])
    if "delivered" not in meta:
        # A row from before delivery was recorded: its reply went out unless it was cut.
        meta["delivered"] = not meta.get("truncated", False)
    return TurnNode(
        index=row["idx"],
        parent=row["parent"],
        context_ids=decode_array("i", row["context_ids"]),
        completion_ids=decode_array("i", row["completion_ids"]),
        logprobs=decode_array("f", row["logprobs"]),
        prompt_len=row["prompt_len"],
        key=bytes(row["key"]),
        meta=TurnMeta(**meta),
        images=msgspec.json.decode(row["images"], type=tuple[PlacedImage, ...]),
        routing=_routing_from(row),
        agent=MAIN_AGENT
        if row["agent"] is None
        else msgspec.json.decode(row["agent"], type=TurnAgent),
        teacher=_teacher_from(row),
    )


def _teacher_from(row: sqlite3.Row) -> TurnTeacher | None:
    model = row["teacher_model"]
    if model is None:
        return None
    logprobs = decode_array("f", row["teacher_logprobs"] or b"")
    if len(logprobs) != len(row["completion_ids"]) // 4:
        raise ValueError(f"turn {row['idx']}: teacher logprobs do not match its tokens")
    return TurnTeacher(model, logprobs)


def _routing_from(row: sqlite3.Row) -> TurnRouting | None:
    head = row["routing_head"]
    if head is None:
        return None
    try:
        decoded = msgspec.json.decode(head, type=RoutingHead)
    except msgspec.DecodeError as exc:
        raise ValueError(f"turn {row['idx']}: routing head: {exc}") from None
    return TurnRouting.from_head(decoded, bytes(row["routing"] or b""))


# ---------------------------------------------------------------------- operations


def _put_session(session_row: tuple[Any, ...]) -> _Op:
    def op(db: sqlite3.Connection) -> None:
        db.execute(
            "INSERT INTO sessions (trial_id, api_key, state, model, sampling, options, metadata,"
            " reward, created_at, updated_at, completed_at, completed_by, fetched_at, outcome,"
            " agent_rewards, server_errors)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(trial_id) DO UPDATE SET api_key=excluded.api_key,"
            " state=excluded.state, model=excluded.model, sampling=excluded.sampling,"
            " options=excluded.options,"
            " metadata=excluded.metadata, reward=excluded.reward,"
            " updated_at=excluded.updated_at, completed_at=excluded.completed_at,"
            " completed_by=excluded.completed_by, fetched_at=excluded.fetched_at,"
            " outcome=excluded.outcome, agent_rewards=excluded.agent_rewards,"
            " server_errors=excluded.server_errors",
            session_row,
        )

    return op


def _put_turn(
    session_row: tuple[Any, ...], turn_row: tuple[Any, ...], image_rows: list[tuple[Any, ...]]
) -> _Op:
    put = _put_session(session_row)

    def op(db: sqlite3.Connection) -> None:
        put(db)
        if image_rows:  # with the first turn that uses them; once per trial
            db.executemany("INSERT OR IGNORE INTO images VALUES (?,?,?,?,?,?)", image_rows)
        db.execute(
            "INSERT INTO turns (trial_id, idx, parent, context_ids, completion_ids, logprobs,"
            " prompt_len, key, meta, images, routing, routing_head, agent, teacher_model,"
            " teacher_logprobs) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            turn_row,
        )

    return op


class _Light:
    """A write that must survive the process (``kill -9``) but not a power loss: a batch of
    only such writes commits without an fsync (WAL with ``synchronous=NORMAL``), so it does
    not make the turns queued behind it wait for the disk. The next full commit makes it
    durable on disk too."""

    __slots__ = ("op",)

    def __init__(self, op: _Op) -> None:
        self.op = op

    def __call__(self, db: sqlite3.Connection) -> Any:
        return self.op(db)


def _put_meta(trial_id: str, index: int, meta: str) -> _Op:
    def op(db: sqlite3.Connection) -> None:
        db.execute("UPDATE turns SET meta=? WHERE trial_id=? AND idx=?", (meta, trial_id, index))

    return _Light(op)


def _put_teacher(rows: list[tuple[str, bytes, str, int]]) -> _Op:
    def op(db: sqlite3.Connection) -> None:
        db.executemany(
            "UPDATE turns SET teacher_model=?, teacher_logprobs=? WHERE trial_id=? AND idx=?",
            rows,
        )

    return op


def _forget(trial_id: str, deleted_at: float, tombstones: int) -> _Op:
    def op(db: sqlite3.Connection) -> None:
        db.execute("DELETE FROM turns WHERE trial_id = ?", (trial_id,))
        db.execute("DELETE FROM images WHERE trial_id = ?", (trial_id,))
        db.execute("DELETE FROM sessions WHERE trial_id = ?", (trial_id,))
        db.execute(
            "INSERT OR REPLACE INTO tombstones (trial_id, deleted_at) VALUES (?, ?)",
            (trial_id, deleted_at),
        )
        # Keep only the newest ``tombstones`` ids, as the registry does in memory.
        db.execute(
            "DELETE FROM tombstones WHERE trial_id IN (SELECT trial_id FROM tombstones"
            " ORDER BY deleted_at DESC LIMIT -1 OFFSET ?)",
            (tombstones,),
        )

    return op


@dataclass(slots=True)
class LoadedState:
    """What a store held when it was opened."""

    sessions: list[Session] = field(default_factory=list)
    tombstones: list[TrialId] = field(default_factory=list)  # oldest first
    skipped: list[str] = field(default_factory=list)  # trial ids whose rows did not decode


def _load(db: sqlite3.Connection) -> LoadedState:
    state = LoadedState()
    turns: dict[str, list[sqlite3.Row]] = {}
    for row in db.execute("SELECT * FROM turns ORDER BY trial_id, idx"):
        turns.setdefault(row["trial_id"], []).append(row)
    images: dict[str, list[sqlite3.Row]] = {}
    for row in db.execute("SELECT * FROM images"):
        images.setdefault(row["trial_id"], []).append(row)
    for row in db.execute("SELECT * FROM sessions ORDER BY created_at, trial_id"):
        trial_id = row["trial_id"]
        try:
            session = _session_from(row)
            for image_row in images.get(trial_id, []):
                image = _image_from(image_row)
                session.images[image.sha256] = image
            updated_at = session.updated_at
            for index, turn_row in enumerate(turns.get(trial_id, [])):
                node = _turn_from(turn_row)
                if node.index != index or not (node.parent is None or node.parent < index):
                    raise ValueError(f"turn {node.index} is out of order")
                missing = [i.sha256 for i in node.images if i.sha256 not in session.images]
                if missing:
                    raise ValueError(f"turn {node.index} names images not stored: {missing}")
                session.add_turn(node)
            session.updated_at = updated_at
        except (ValueError, TypeError, KeyError) as exc:
            # One damaged row must not keep every other session from being served; the
            # rows stay in the database for inspection.
            log.error("session %s could not be restored and is skipped: %s", trial_id, exc)
            state.skipped.append(trial_id)
            continue
        state.sessions.append(session)
    state.tombstones = [
        TrialId(r["trial_id"])
        for r in db.execute("SELECT trial_id FROM tombstones ORDER BY deleted_at, trial_id")
    ]
    return state


# ---------------------------------------------------------------------- the store


class SessionStore:
    """An open store. Create with ``await SessionStore.open(data_dir)``; every write
    returns an awaitable that resolves once the write is committed."""

    def __init__(self, path: Path, *, tombstones: int = 100_000) -> None:
        self.path = path
        self.tombstones = tombstones
        self._jobs: queue.SimpleQueue[
            tuple[_Op, asyncio.AbstractEventLoop, asyncio.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._db: sqlite3.Connection | None = None
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._thread else "new")
        return f"<SessionStore {self.path} {state}>"

    @classmethod
    async def open(cls, data_dir: Path, *, tombstones: int = 100_000) -> SessionStore:
        """Open (or create) ``data_dir/relay.db``. Raises ``StorageError`` when the
        directory cannot be created or the file is not a usable database."""
        store = cls(data_dir / DB_NAME, tombstones=tombstones)
        store._thread = threading.Thread(target=store._run, name="session-store", daemon=True)
        store._thread.start()
        try:
            await store._submit(store._setup)
        except BaseException:
            await store.close()
            raise
        return store

    # -------------------------------------------------------------- writer thread

    def _setup(self, _: sqlite3.Connection | None) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create the data directory {self.path.parent}: {exc}"
            ) from None
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StorageError(f"cannot open the session store {self.path}: {exc}") from None
        try:
            db.row_factory = sqlite3.Row
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StorageError(f"{self.path}: the database refused WAL mode ({mode})")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            db.executescript(_SCHEMA)
            row = db.execute("SELECT value FROM relay_meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO relay_meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )
            elif int(row[0]) in _MIGRATIONS:
                db.execute("BEGIN IMMEDIATE")  # all of it or nothing
                for version in range(int(row[0]), SCHEMA_VERSION):
                    for statement in _MIGRATIONS[version]:
                        db.execute(statement)
                db.execute(
                    "UPDATE relay_meta SET value=? WHERE key='schema_version'",
                    (str(SCHEMA_VERSION),),
                )
                db.execute("COMMIT")
            elif int(row[0]) != SCHEMA_VERSION:
                raise StorageError(
                    f"{self.path} has schema version {row[0]}; this proxy reads"
                    f" version {SCHEMA_VERSION}"
                )
        except sqlite3.Error as exc:
            db.close()
            raise StorageError(
                f"{self.path} is not a usable session store ({exc}); move it away to start"
                " empty, or restore it from a backup"
            ) from None
        except BaseException:
            db.close()
            raise
        self._db = db

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            batch = [job]
            stop = False
            while len(batch) < _GROUP_COMMIT:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            light = self._db is not None and all(isinstance(op, _Light) for op, _, _ in batch)
            if light:
                self._synchronous("NORMAL")
            self._execute(batch)
            if light:
                self._synchronous("FULL")
            if stop:
                break
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
            self._db = None

    def _synchronous(self, level: str) -> None:
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute(f"PRAGMA synchronous={level}")

    def _execute(
        self, batch: list[tuple[_Op, asyncio.AbstractEventLoop, asyncio.Future[Any]]]
    ) -> None:
        db = self._db
        if db is None or len(batch) == 1:
            for job in batch:
                self._one(job)
            return
        try:
            db.execute("BEGIN IMMEDIATE")
            results = [op(db) for op, _, _ in batch]
            db.execute("COMMIT")
        except Exception:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            # Find the failing write: each one again in its own transaction.
            for job in batch:
                self._one(job)
            return
        settled: dict[asyncio.AbstractEventLoop, list[_Settle]] = {}
        for (_, loop, future), result in zip(batch, results, strict=True):
            settled.setdefault(loop, []).append((future, result, None))
        for loop, items in settled.items():
            _resolve_all(loop, items)

    def _one(self, job: tuple[_Op, asyncio.AbstractEventLoop, asyncio.Future[Any]]) -> None:
        op, loop, future = job
        db = self._db
        try:
            if db is None:
                result = op(db)  # type: ignore[arg-type]  # only _setup runs without a db
            else:
                db.execute("BEGIN IMMEDIATE")
                try:
                    result = op(db)
                    db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
        except StorageError as exc:
            _resolve(loop, future, None, exc)
        except Exception as exc:
            log.error("session store write failed: %s", exc)
            _resolve(loop, future, None, StorageError(f"the session store failed: {exc}"))
        else:
            _resolve(loop, future, result, None)

    # -------------------------------------------------------------- API

    def _submit(self, op: _Op) -> asyncio.Future[Any]:
        if self._closed or self._thread is None:
            raise StorageError("the session store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._jobs.put((op, loop, future))
        return future

    async def load(self) -> LoadedState:
        """Every stored session with its turns, and the ids of deleted trials."""
        state: LoadedState = await self._submit(_load)
        return state

    def save_session(self, session: Session) -> asyncio.Future[None]:
        """Insert or update the session's row (not its turns)."""
        return self._submit(_put_session(_session_row(session)))

    def save_turn(self, session: Session, node: TurnNode) -> asyncio.Future[None]:
        """Add one recorded turn (and the session row's new ``updated_at``), with the
        images its prompt holds that the store does not have yet."""
        return self._submit(
            _put_turn(
                _session_row(session),
                _turn_row(session.trial_id, node),
                _image_rows(session, node),
            )
        )

    def save_turn_meta(self, session: Session, node: TurnNode) -> asyncio.Future[None]:
        """Rewrite a recorded turn's metadata (its delivery, after the turn was committed).
        It survives the process at once, a power loss from the next full commit on."""
        return self._submit(_put_meta(session.trial_id, node.index, _json(node.meta)))

    def save_teacher(
        self, session: Session, scores: dict[int, TurnTeacher]
    ) -> asyncio.Future[None]:
        """Write a teacher's logprobs into the rows of the turns it scored (by index), in
        one transaction."""
        rows = [
            (teacher.model, encode_array(teacher.logprobs), str(session.trial_id), index)
            for index, teacher in scores.items()
        ]
        return self._submit(_put_teacher(rows))

    def delete_session(
        self, trial_id: str, deleted_at: float | None = None
    ) -> asyncio.Future[None]:
        """Remove a session and its turns, remembering its id as deleted."""
        when = time.time() if deleted_at is None else deleted_at
        return self._submit(_forget(trial_id, when, self.tombstones))

    async def journal_mode(self) -> str:
        mode: str = await self._submit(
            lambda db: str(db.execute("PRAGMA journal_mode").fetchone()[0])
        )
        return mode

    async def close(self) -> None:
        """Commit what is queued, checkpoint the WAL and stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        self._jobs.put(None)
        await asyncio.to_thread(thread.join)


_Settle = tuple["asyncio.Future[Any]", Any, BaseException | None]


def _resolve_all(loop: asyncio.AbstractEventLoop, items: list[_Settle]) -> None:
    """Settle futures of ``loop`` from the writer thread: one wake-up for all of them."""

    def settle() -> None:
        for future, result, error in items:
            if future.done():  # the waiter was cancelled; the write happened regardless
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is already closed
        loop.call_soon_threadsafe(settle)


def _resolve(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    _resolve_all(loop, [(future, result, error)])
