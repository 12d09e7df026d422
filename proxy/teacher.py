"""Scoring a recorded session with a teacher (``POST /sessions/<trial>/teacher``).

On-policy distillation: the policy sampled every token an agent's session recorded; a
teacher served by a worker (``worker --teacher``) scores each of them by teacher forcing,
on the exact ids and images the policy saw.

The refusals come first, before any worker is asked and with nothing changed
(``check_teacher``): a name that no served teacher has, a teacher whose vocabulary is not
the policy's (the same ids would be other tokens to it), a teacher that cannot take the
session's images or whose window is shorter than a trajectory. Then one teacher forcing
per path that holds turns to score (``proxy.sessions.teacher.plan_scoring``), through the
pool (``relay.scoring``), each committed to the store with its turns' logprobs before the
next: a call that stops half-way keeps what was committed, and asked again scores the rest.

The scoring belongs to the proxy, not to the request that asked for it: it runs as its own
task, awaited through ``asyncio.shield``, so a trainer that hangs up does not cut a forcing
from its commit. A trial is scored by one task at a time: a second call waits for the
first, then scores what is left (nothing, when it scored the same teacher).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.chat.messages import ImagePart
from proxy.exceptions import (
    ImageError,
    ProxyError,
    ServiceUnavailableError,
    TeacherImagesError,
    TeacherWindowError,
    TokenizerMismatchError,
    TooManyRequestsError,
    UnknownPolicyError,
    UnknownTeacherError,
    UpstreamError,
)
from proxy.models import ModelRegistry, ServedModel
from proxy.sessions.model import PlacedImage, Session, SessionState
from proxy.sessions.registry import SessionRegistry
from proxy.sessions.teacher import ScorePath, TurnTeacher, plan_scoring
from relay import protocol
from relay.exceptions import (
    NoWorkerAvailableError,
    PoolOverloadedError,
    RelayError,
    WorkerFailedError,
)
from relay.images import PromptImage
from relay.pool import WorkerPool
from relay.scoring import score


@dataclass(slots=True, frozen=True)
class TeacherReport:
    """What one call scored: ``scored_tokens`` sampled tokens in ``seconds``."""

    model: str
    scored_tokens: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "scored_tokens": self.scored_tokens,
            "seconds": round(self.seconds, 6),
            "done": True,
        }


# --------------------------------------------------------------------------- refusals


def check_teacher(
    models: ModelRegistry,
    served: Mapping[str, protocol.ModelInfo],
    session: Session,
    name: str,
) -> ServedModel:
    """The teacher ``name`` when it can score ``session`` (every model that sampled its
    turns has its vocabulary); else the refusal, a ``TeacherRefusedError``."""
    teacher = models.models.get(name)
    if name not in served or teacher is None or not teacher.teacher:
        teachers = sorted(n for n in served if n in models.models and models.models[n].teacher)
        raise UnknownTeacherError(
            f"no teacher {name!r} is served (teachers: {', '.join(teachers) or 'none'}; a "
            "teacher's worker is started with --teacher)"
        )
    for policy in _policies(session):
        known = models.models.get(policy)
        if known is None:
            raise UnknownPolicyError(
                f"model {policy!r} sampled this session, and no worker has served it since "
                f"this proxy started: its vocabulary cannot be compared with {name!r}'s "
                "(connect a worker that serves it)"
            )
        if known.vocabulary != teacher.vocabulary:
            raise TokenizerMismatchError(
                f"teacher {name!r} and policy {policy!r} have different vocabularies: the "
                f"teacher would read the policy's ids as other tokens (a teacher scores the "
                "same ids the policy sampled, so it needs the same tokenizer)"
            )
    return teacher


def _policies(session: Session) -> list[str]:
    """The models that sampled the session's tokens."""
    return sorted({node.meta.model for node in session.nodes if node.completion_ids})


def check_plans(teacher: ServedModel, session: Session, plans: Iterable[ScorePath]) -> None:
    """The teacher can run every forcing: it fits its window, and it takes the images
    in it with as many tokens as the policy gave them."""
    for plan in plans:
        if len(plan.ids) > teacher.max_model_len:
            raise TeacherWindowError(
                f"a trajectory of {len(plan.ids)} tokens does not fit teacher "
                f"{teacher.name!r}'s {teacher.max_model_len}-token window"
            )
        for image in plan.images:
            _check_image(teacher, session, plan, image)


def _check_image(
    teacher: ServedModel, session: Session, plan: ScorePath, image: PlacedImage
) -> None:
    vision = teacher.vision
    if vision is None:
        raise TeacherImagesError(
            f"teacher {teacher.name!r} takes no images, and this session's prompts hold some"
        )
    data = session.images[image.sha256]
    try:
        tokens = vision.count(
            ImagePart(image.sha256, data.media_type.value, data.width, data.height)
        )
    except ImageError as exc:
        raise TeacherImagesError(f"teacher {teacher.name!r}: {exc.message}") from None
    held = image.end - image.start
    if plan.ids[image.start] != vision.pad_id or tokens != held:
        raise TeacherImagesError(
            f"teacher {teacher.name!r} gives a {data.width}x{data.height} image {tokens} "
            f"tokens of id {vision.pad_id}; the policy's prompt holds {held} of id "
            f"{plan.ids[image.start]}"
        )


# --------------------------------------------------------------------------- the service


@dataclass(slots=True)
class _TrialLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class TeacherService:
    """Scores sessions with teachers; one task per call, one call per trial at a time."""

    def __init__(
        self,
        pool: WorkerPool,
        models: ModelRegistry,
        sessions: SessionRegistry,
        *,
        retry_after_seconds: int = 5,
    ) -> None:
        self.pool = pool
        self.models = models
        self.sessions = sessions
        self.retry_after_seconds = retry_after_seconds
        self._trials: dict[str, _TrialLock] = {}
        self._tasks: set[asyncio.Task[TeacherReport]] = set()

    def __repr__(self) -> str:
        return f"<TeacherService scoring={len(self._tasks)}>"

    async def score(self, session: Session, model: str) -> TeacherReport:
        """Score every sampled token of ``session`` that ``model`` has not scored."""
        task = asyncio.get_running_loop().create_task(self._score(session, model))
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    def _finished(self, task: asyncio.Task[TeacherReport]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that left would leave it unread

    async def close(self) -> None:
        """Stop the scoring under way (the proxy shuts down): what was committed stays."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _score(self, session: Session, model: str) -> TeacherReport:
        trial = self._trials.setdefault(session.trial_id, _TrialLock())
        trial.users += 1
        try:
            async with trial.lock:
                return await self._score_alone(session, model)
        finally:
            trial.users -= 1
            if not trial.users:
                del self._trials[session.trial_id]

    async def _score_alone(self, session: Session, model: str) -> TeacherReport:
        started = time.perf_counter()
        teacher = check_teacher(self.models, self.pool.served_models(), session, model)
        plans = plan_scoring(session, model)
        check_plans(teacher, session, plans)
        scored = 0
        for plan in plans:
            if session.state is SessionState.DELETED:
                break  # deleted meanwhile: nothing left to keep the scores in
            logprobs = await self._forcing(session, model, plan)
            scores = {
                index: TurnTeacher(model, values)
                for index, values in plan.split(session, logprobs).items()
            }
            await self.sessions.save_teacher(session, scores)
            scored += plan.scored
        return TeacherReport(model, scored, time.perf_counter() - started)

    async def _forcing(self, session: Session, model: str, plan: ScorePath) -> list[float]:
        """One teacher forcing through the pool, its failures as the proxy's errors."""
        images = [
            PromptImage(i.sha256, session.images[i.sha256].data, i.start, i.end)
            for i in plan.images
        ]
        retry = self.retry_after_seconds
        try:
            return await score(
                self.pool,
                model,
                plan.ids,
                plan.start,
                images=images,
                affinity=f"teacher/{model}/{session.trial_id}",
            )
        except NoWorkerAvailableError as exc:
            raise ServiceUnavailableError(str(exc), retry_after=retry, code="no_worker") from None
        except PoolOverloadedError as exc:
            if exc.scope == "trial":
                raise TooManyRequestsError(str(exc), retry_after=retry) from None
            raise ServiceUnavailableError(str(exc), retry_after=retry, code="overloaded") from None
        except WorkerFailedError as exc:
            raise UpstreamError(f"the teacher failed: {exc.message}", code=exc.code) from None
        except RelayError as exc:
            raise ProxyError(f"relay error: {exc}") from None
