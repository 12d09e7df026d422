"""The authentication middleware: reads a request's credentials and lets ``proxy.auth``
decide. It runs inside the error middleware, so a refusal comes back in the caller's API
format (OpenAI or Anthropic) before the handler reads the body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.appkeys import CONFIG, SESSIONS
from proxy.auth import (
    AuthPolicy,
    RouteKind,
    TrialKeyLookup,
    presented_credentials,
    raise_for,
    route_kind,
)
from proxy.exceptions import ConflictError, NotFoundError

__all__ = ["auth_middleware"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def trial_key_lookup(app: web.Application) -> TrialKeyLookup:
    registry = app[SESSIONS]

    def lookup(trial_id: str) -> str | None:
        try:
            return registry.get(trial_id).api_key
        except (NotFoundError, ConflictError):
            return None

    return lookup


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    config = request.app[CONFIG]
    policy = AuthPolicy(config.admin_token, config.worker_token)
    if not policy.enabled:
        return await handler(request)
    resource = request.match_info.route.resource
    kind = route_kind(resource.canonical if resource is not None else "")
    if kind is RouteKind.PUBLIC:
        return await handler(request)
    credentials = presented_credentials(request.headers)
    lookup = trial_key_lookup(request.app)
    if kind is RouteKind.ADMIN:
        raise_for(kind, policy.check_admin(credentials, lookup))
    else:
        trial_id = request.match_info.get("trial_id", "")
        raise_for(kind, policy.check_agent(credentials, trial_id, lookup))
    return await handler(request)
