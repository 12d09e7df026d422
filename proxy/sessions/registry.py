"""The in-memory registry of sessions."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any

import shortuuid

from proxy.auth import new_trial_key
from proxy.exceptions import BadRequestError, ConflictError, NotFoundError
from proxy.sessions.model import Session, SessionState, TrialId, TurnNode
from proxy.sessions.options import SessionOptions
from proxy.sessions.store import LoadedState, SessionStore
from proxy.sessions.teacher import TurnTeacher

_TRIAL_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def validate_trial_id(value: str) -> TrialId:
    if not 1 <= len(value) <= 128 or not set(value) <= _TRIAL_ID_CHARS or value[0] == ".":
        raise BadRequestError(
            "trial_id must be 1-128 characters of letters, digits, '-', '_' or '.'",
            code="invalid_trial_id",
        )
    return TrialId(value)


class SessionRegistry:
    def __init__(self, *, tombstones: int = 100_000) -> None:
        self._sessions: dict[TrialId, Session] = {}
        # Deleted trials are remembered (id only) so late agent calls get 409, not 404.
        self._deleted: OrderedDict[TrialId, None] = OrderedDict()
        self._tombstones = tombstones
        # The durable copy (None: sessions live in memory only).
        self.store: SessionStore | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    def create(
        self,
        trial_id: str | None,
        *,
        metadata: dict[str, Any],
        sampling: dict[str, Any],
        model: str | None,
        options: SessionOptions | None = None,
    ) -> Session:
        tid = validate_trial_id(trial_id) if trial_id is not None else TrialId(shortuuid.uuid())
        if tid in self._sessions or tid in self._deleted:
            raise ConflictError(f"trial {tid} already exists", code="trial_exists")
        session = Session(
            trial_id=tid,
            api_key=new_trial_key(tid),
            metadata=metadata,
            sampling=sampling,
            model=model,
            options=options or SessionOptions(),
        )
        self._sessions[tid] = session
        return session

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def newest(self, limit: int) -> list[Session]:
        """The ``limit`` most recently registered sessions, newest first, without sorting
        the others (the viewer asks every few seconds)."""
        return list(itertools.islice(reversed(self._sessions.values()), limit))

    def restore(self, loaded: LoadedState) -> None:
        """Take over what a store held (at startup, before serving)."""
        for trial_id in loaded.tombstones:
            self._deleted[trial_id] = None
        for session in loaded.sessions:
            self._sessions[session.trial_id] = session

    def discard(self, trial_id: TrialId) -> None:
        """Forget a session that was never acknowledged (its creation could not be saved)."""
        self._sessions.pop(trial_id, None)

    async def save(self, session: Session) -> None:
        """Commit the session's row (state, reward, timestamps) to the store."""
        if self.store is not None:
            await self.store.save_session(session)

    async def save_turn(self, session: Session, node: TurnNode) -> None:
        """Commit a turn just added to ``session``."""
        if self.store is not None:
            await self.store.save_turn(session, node)

    async def save_teacher(self, session: Session, scores: dict[int, TurnTeacher]) -> None:
        """Commit a teacher's logprobs of turns of ``session``, then keep them on the turns
        (a commit that fails changes nothing)."""
        if self.store is not None:
            await self.store.save_teacher(session, scores)
        for index, teacher in scores.items():
            session.nodes[index].teacher = teacher

    async def remove(self, trial_id: str) -> Session:
        """``delete``, then remove the session from the store."""
        session = self.delete(trial_id)
        if self.store is not None:
            await self.store.delete_session(session.trial_id)
        return session

    def get(self, trial_id: str) -> Session:
        session = self._sessions.get(TrialId(trial_id))
        if session is None:
            if TrialId(trial_id) in self._deleted:
                raise ConflictError(f"session {trial_id} was deleted", code="session_deleted")
            raise NotFoundError(f"unknown trial {trial_id!r}", code="trial_not_found")
        return session

    def delete(self, trial_id: str) -> Session:
        session = self.get(trial_id)
        session.transition(SessionState.DELETED)
        del self._sessions[session.trial_id]
        self._deleted[session.trial_id] = None
        while len(self._deleted) > self._tombstones:
            self._deleted.popitem(last=False)
        return session

    def page(
        self,
        *,
        limit: int,
        after: str | None = None,
        position: tuple[float, str] | None = None,
    ) -> tuple[list[Session], str | None]:
        """Sessions in creation order, ``limit`` at a time: after ``after`` (the last id
        seen, a session of this registry) or after ``position`` (a session's
        ``(created_at, trial_id)``, where another replica holds it)."""
        ordered = sorted(self._sessions.values(), key=lambda s: (s.created_at, s.trial_id))
        if after is not None:
            position = self.position(after)
        if position is not None:
            ordered = [s for s in ordered if (s.created_at, s.trial_id) > position]
        page = ordered[:limit]
        cursor = page[-1].trial_id if len(ordered) > limit else None
        return page, cursor

    def position(self, trial_id: str) -> tuple[float, str]:
        """Where a session stands in creation order (a list's cursor)."""
        session = self._sessions.get(TrialId(trial_id))
        if session is None:
            raise BadRequestError(f"unknown cursor {trial_id!r}", code="invalid_cursor")
        return (session.created_at, session.trial_id)
