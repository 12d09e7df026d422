"""The session API the trainer uses: register trials, read trajectories, complete, delete."""

from __future__ import annotations

import math
import time
from typing import Any
from urllib.parse import quote

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.errors import json_response, parse_json
from proxy.appkeys import CONFIG, POOL, SERVICE, SESSIONS, TEACHER
from proxy.cluster import CLUSTER, FORWARDED_BY, Cluster, new_owned_trial_id
from proxy.exceptions import BadRequestError, NotFoundError, StorageError
from proxy.limits import check_session_count
from proxy.sampling import validate_session_sampling
from proxy.sessions.model import Outcome, Session, SessionState
from proxy.sessions.options import validate_options
from proxy.sessions.registry import SessionRegistry
from proxy.sessions.tree import session_tree
from proxy.turns import no_routing
from relay.pool import WorkerPool


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trial_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] | None = None
    model: str | None = None
    # Session options (proxy.sessions.options), validated there for clear errors.
    history: Any = None
    chat_template_kwargs: Any = None
    cap_finish: Any = None
    routed_experts: Any = None
    budget: Any = None


class ScoreWithTeacher(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str  # the teacher's name, as its worker announces it


class CompleteSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float | dict[str, float] | None = None
    # How the episode ended (proxy.sessions.model.Outcome); checked in complete_session.
    outcome: str | None = None
    # Rewards for single agents of the trial, by agent id.
    agent_rewards: dict[str, float] | None = None


def public_url(request: web.Request) -> str:
    configured = request.app[CONFIG].public_url
    if configured:
        return configured.rstrip("/")
    return f"{request.scheme}://{request.host}"


def base_url(request: web.Request, session: Session) -> str:
    return f"{public_url(request)}/{session.trial_id}/v1"


async def _create(request: web.Request, trial_id: str | None) -> web.Response:
    raw = await request.read()
    spec = parse_json(CreateSession, raw) if raw.strip() else CreateSession()
    if trial_id is not None:
        if spec.trial_id is not None and spec.trial_id != trial_id:
            raise BadRequestError(
                "trial_id in the body differs from the path", code="invalid_request"
            )
        spec.trial_id = trial_id
    if spec.trial_id is None:  # one this replica owns (any id when there is one replica)
        spec.trial_id = new_owned_trial_id(request.app.get(CLUSTER))
    registry = request.app[SESSIONS]
    check_session_count(
        request.app[SERVICE].limits, len(registry), request.app[CONFIG].retry_after_seconds
    )
    options = validate_options(
        spec.history, spec.chat_template_kwargs, spec.cap_finish, spec.routed_experts, spec.budget
    )
    if options.routed_experts:
        _check_routing(request.app[POOL], spec.model)
    session = registry.create(
        spec.trial_id,
        metadata=spec.metadata,
        sampling=validate_session_sampling(spec.sampling),
        model=spec.model,
        options=options,
    )
    try:
        await registry.save(session)
    except StorageError:
        registry.discard(session.trial_id)  # not acknowledged: the id stays free
        raise
    return json_response(
        {
            "trial_id": session.trial_id,
            "base_url": base_url(request, session),
            "api_key": session.api_key,
        },
        status=201,
    )


def _check_routing(pool: WorkerPool, model: str | None) -> None:
    """A session that asks for routing rows is refused when the pool can tell that its
    model (the one named, else the only one served) has no worker that reports them.
    With no worker connected it cannot tell: its first request is refused instead."""
    served = pool.served_models()
    policies = [n for n, info in served.items() if not info.teacher]
    name = model if model in served else (policies[0] if len(policies) == 1 else None)
    if name is not None and pool.routing(name) is None:
        raise BadRequestError(
            f"{no_routing(pool, name)}; create the session without routed_experts",
            code="routing_unsupported",
        )


async def create_session(request: web.Request) -> web.Response:
    return await _create(request, None)


async def create_named_session(request: web.Request) -> web.Response:
    return await _create(request, request.match_info["trial_id"])


async def get_session(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    return json_response(session.summary(base_url(request, session)))


async def get_trajectories(request: web.Request) -> web.Response:
    registry = request.app[SESSIONS]
    session = registry.get(request.match_info["trial_id"])
    export = session.export()
    await _fetched(registry, session)
    return json_response(export)


async def get_tree(request: web.Request) -> web.Response:
    """The session's tree as nodes (proxy.sessions.tree): what the trajectories hold, each
    token once, for a trainer that packs the tree into one sequence."""
    registry = request.app[SESSIONS]
    session = registry.get(request.match_info["trial_id"])
    tree = session_tree(session)
    await _fetched(registry, session)
    return json_response(tree)


async def _fetched(registry: SessionRegistry, session: Session) -> None:
    """The trainer has the completed session's tokens (as trajectories or as the tree):
    the retention clock for fetched sessions starts (see proxy.sessions.expiry)."""
    if session.state is SessionState.COMPLETED and session.fetched_at is None:
        session.fetched_at = time.time()
        await registry.save(session)


async def get_image(request: web.Request) -> web.Response:
    """An image of the session's prompts, by the sha256 its trajectories name: the bytes
    as the agent sent them, with their content type."""
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    sha256 = request.match_info["sha256"]
    image = session.images.get(sha256.lower())
    if image is None:
        raise NotFoundError(
            f"session {session.trial_id} has no image {sha256}", code="image_not_found"
        )
    return web.Response(
        body=image.data,
        content_type=image.media_type.value,
        headers={
            "Cache-Control": "private, max-age=31536000, immutable",
            "ETag": f'"{image.sha256}"',
        },
    )


async def complete_session(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    raw = await request.read()
    spec = parse_json(CompleteSession, raw) if raw.strip() else CompleteSession()
    outcome = _outcome(session, spec)  # checked before anything changes
    session.transition(SessionState.COMPLETED)
    session.reward = spec.reward
    session.outcome = outcome
    session.agent_rewards = dict(spec.agent_rewards or {})
    request.app[POOL].forget_affinity(session.trial_id)
    await request.app[SESSIONS].save(session)
    return json_response(session.summary(base_url(request, session)))


def _outcome(session: Session, spec: CompleteSession) -> Outcome:
    """The outcome a completion records: the one given, else ``budget_exhausted`` when a
    request found the budget spent, else ``completed``. ``completed`` given explicitly
    needs a reward (no reward is never read as a zero)."""
    rewards = [spec.reward] if isinstance(spec.reward, float | int) else []
    if isinstance(spec.reward, dict):
        rewards = list(spec.reward.values())
    rewards += list((spec.agent_rewards or {}).values())
    if not all(math.isfinite(r) for r in rewards):
        raise BadRequestError("rewards must be finite numbers", code="invalid_reward")
    unknown = sorted(set(spec.agent_rewards or {}) - set(session.agents))
    if unknown:
        raise BadRequestError(
            f"agent_rewards names agents that made no turn in this trial: {unknown}",
            code="unknown_agent",
        )
    if spec.outcome is None:
        return session.outcome or Outcome.COMPLETED
    try:
        outcome = Outcome(spec.outcome)
    except ValueError:
        allowed = ", ".join(o.value for o in Outcome)
        raise BadRequestError(
            f"outcome must be one of: {allowed}", code="invalid_outcome"
        ) from None
    if outcome is Outcome.COMPLETED and spec.reward is None and not spec.agent_rewards:
        raise BadRequestError(
            'outcome "completed" needs a reward; give another outcome for an episode that has none',
            code="invalid_outcome",
        )
    return outcome


async def score_with_teacher(request: web.Request) -> web.Response:
    """Every sampled token of the trial's trajectories scored by a teacher (proxy.teacher):
    ``{"model", "scored_tokens", "seconds", "done": true}``, ``scored_tokens`` counting
    what this call scored (asked again, only what is new)."""
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    spec = parse_json(ScoreWithTeacher, await request.read())
    report = await request.app[TEACHER].score(session, spec.model)
    return json_response(report.as_dict())


async def get_agents(request: web.Request) -> web.Response:
    """The trial's agents: the main one and the sub-agents it spawned, with their turns."""
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    return json_response({"trial_id": session.trial_id, "agents": session.agent_list()})


async def delete_session(request: web.Request) -> web.Response:
    session = await request.app[SESSIONS].remove(request.match_info["trial_id"])
    request.app[POOL].forget_affinity(session.trial_id)
    return json_response({"trial_id": session.trial_id, "deleted": True})


async def list_sessions(request: web.Request) -> web.Response:
    """Every replica's sessions, asked of any replica: each pages its own, and the one
    asked merges them in creation order (a replica asked by another lists its own)."""
    try:
        limit = int(request.query.get("limit", "100"))
    except ValueError:
        raise BadRequestError("limit must be an integer", code="invalid_request") from None
    if not 1 <= limit <= 1000:
        raise BadRequestError("limit must be between 1 and 1000", code="invalid_request")
    after = request.query.get("after")
    cluster = request.app.get(CLUSTER)
    if cluster is None or FORWARDED_BY in request.headers:
        # Asked for its part by another replica: the cursor's place comes along.
        at = request.query.get("at") if cluster is not None else None
        position = _position(at, after) if at is not None else None
        sessions, cursor = request.app[SESSIONS].page(
            limit=limit, after=None if position else after, position=position
        )
        return json_response(
            {"sessions": [s.summary(base_url(request, s)) for s in sessions], "next": cursor}
        )
    return json_response(await _every_replica(request, cluster, limit, after))


def _position(at: str, after: str | None) -> tuple[float, str]:
    try:
        created = float(at)
    except ValueError:
        raise BadRequestError("at must be a number", code="invalid_cursor") from None
    if after is None:
        raise BadRequestError("at needs after", code="invalid_cursor")
    return (created, after)


async def _every_replica(
    request: web.Request, cluster: Cluster, limit: int, after: str | None
) -> dict[str, Any]:
    registry = request.app[SESSIONS]
    position: tuple[float, str] | None = None
    if after is not None:
        owner = cluster.owner_of(after)
        if owner is None:
            position = registry.position(after)
        else:  # the cursor's session lives on its owner: its place comes from there
            status, body = await cluster.ask(owner, f"/sessions/{quote(after, safe='')}", request)
            if status != 200:
                raise BadRequestError(f"unknown cursor {after!r}", code="invalid_cursor")
            position = (float(body["created_at"]), after)
    query = {"limit": str(limit)}
    if position is not None:
        query |= {"after": position[1], "at": repr(position[0])}
    parts = await cluster.gather(request, query)
    mine, cursor = registry.page(limit=limit, position=position)
    rows = [s.summary(base_url(request, s)) for s in mine]
    for part in parts:
        rows += part["sessions"]
    rows.sort(key=lambda row: (row["created_at"], row["trial_id"]))
    more = len(rows) > limit or cursor is not None or any(p["next"] for p in parts)
    page = rows[:limit]
    return {"sessions": page, "next": page[-1]["trial_id"] if more and page else None}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/sessions", create_session)
    app.router.add_get("/sessions", list_sessions)
    app.router.add_post("/sessions/{trial_id}", create_named_session)
    app.router.add_get("/sessions/{trial_id}", get_session)
    app.router.add_get("/sessions/{trial_id}/trajectories", get_trajectories)
    app.router.add_get("/sessions/{trial_id}/tree", get_tree)
    app.router.add_get("/sessions/{trial_id}/images/{sha256}", get_image)
    app.router.add_get("/sessions/{trial_id}/agents", get_agents)
    app.router.add_post("/sessions/{trial_id}/complete", complete_session)
    app.router.add_post("/sessions/{trial_id}/teacher", score_with_teacher)
    app.router.add_delete("/sessions/{trial_id}", delete_session)
