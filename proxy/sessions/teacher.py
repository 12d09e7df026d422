"""A teacher's logprobs on a session's sampled tokens (on-policy distillation).

A turn keeps the teacher's logprob of each token it sampled (``TurnTeacher``), with the
name of the teacher that scored it. A trajectory carries them (``teacher_logprobs``,
aligned with ``response_ids``, 0.0 where the mask is 0, and ``teacher_model``) when every
turn on its path that sampled tokens was scored by the same teacher (``export_teacher``).

What to score is decided here, before any I/O (``plan_scoring``): one teacher forcing per
root-to-leaf path that holds a turn the teacher asked has not scored yet, over the path's
ids up to the end of its last such turn, from the first token its first such turn
sampled, with the images its prompt holds where they are. A turn that several paths share
is scored in the first of them only; a turn scored by that teacher is never scored again.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # the session model holds a TurnTeacher per turn: imported for types only
    from proxy.sessions.model import PlacedImage, Session, TurnNode


class TurnTeacher(msgspec.Struct, frozen=True, gc=False):
    """A teacher's logprob of each token a turn sampled, by teacher forcing."""

    model: str
    logprobs: array[float]


@dataclass(slots=True, frozen=True)
class ScorePath:
    """One teacher forcing: ``ids`` (a path's tokens up to the end of the last turn it
    scores) scored from ``start`` on, with its ``images``; it scores ``turns``, which
    sampled ``scored`` tokens."""

    ids: array[int]
    start: int
    turns: tuple[int, ...]
    images: tuple[PlacedImage, ...]
    scored: int

    def split(self, session: Session, logprobs: Sequence[float]) -> dict[int, array[float]]:
        """The logprobs of ``ids[start:]`` cut into each scored turn's sampled tokens."""
        out: dict[int, array[float]] = {}
        for index in self.turns:
            node = session.nodes[index]
            lo, hi = node.prompt_len - self.start, node.end - self.start
            out[index] = array("f", logprobs[lo:hi])
        return out


def needs_score(node: TurnNode, model: str) -> bool:
    """Whether ``model`` has yet to score the turn: it sampled tokens, and no score of
    ``model``'s is kept for them (another teacher's is replaced)."""
    return bool(node.completion_ids) and (node.teacher is None or node.teacher.model != model)


def plan_scoring(session: Session, model: str) -> list[ScorePath]:
    """The teacher forcings that give ``model``'s logprob to every sampled token of the
    session it has not scored: one per path that holds such a turn not planned yet."""
    planned: set[int] = set()
    plans: list[ScorePath] = []
    for leaf in session.leaves():
        path = session.path(leaf.index)
        todo = [n for n in path if n.index not in planned and needs_score(n, model)]
        if not todo:
            continue
        last = todo[-1].index
        ids: array[int] = array("i")
        for node in path:
            ids.extend(node.context_ids)
            ids.extend(node.completion_ids)
            if node.index == last:
                break
        turns = tuple(n.index for n in todo)
        scored = sum(len(n.completion_ids) for n in todo)
        images = tuple(session.prompt_images(last))
        plans.append(ScorePath(ids, todo[0].prompt_len, turns, images, scored))
        planned.update(turns)
    return plans


def turn_teacher_logprobs(node: TurnNode) -> list[float] | None:
    """A teacher's logprob of each of a turn's tokens, its context's (0.0) then its
    sampled ones', as a tree's node holds them; None while no teacher scored it."""
    if node.teacher is None:
        return None
    return [0.0] * len(node.context_ids) + node.teacher.logprobs.tolist()


def export_teacher(path: Sequence[TurnNode]) -> tuple[str, list[float]] | None:
    """A trajectory's teacher and its logprobs aligned with ``response_ids`` (0.0 on the
    context between turns); None unless one teacher scored every turn that sampled."""
    models = {node.teacher.model for node in path if node.teacher is not None}
    if len(models) != 1 or any(n.completion_ids and n.teacher is None for n in path):
        return None
    logprobs: list[float] = []
    for i, node in enumerate(path):
        if i > 0:
            logprobs.extend([0.0] * len(node.context_ids))
        if node.teacher is not None:
            logprobs.extend(node.teacher.logprobs)
    return models.pop(), logprobs
