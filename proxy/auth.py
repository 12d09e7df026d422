"""Who may call what.

Three kinds of credential, each opening one door:

* the **admin token** opens the session API (``/sessions...``) and the weights API
  (``/weights``), used by the trainer;
* a **trial API key**, returned when the trial is registered, opens that trial's agent
  routes (``/<trial_id>/v1/...``) and nothing else;
* the **worker token** admits a worker on ``/ws/worker``; it travels in the worker's hello
  frame and is checked there (``relay.endpoint``).

Agents present their key the way their SDK sends it: ``Authorization: Bearer`` (OpenAI,
Codex, Claude Code with ``ANTHROPIC_AUTH_TOKEN``), ``x-api-key`` (Anthropic, Claude Code
with ``ANTHROPIC_API_KEY``) or ``api-key`` (Azure OpenAI).

No credential, or one the proxy does not know, is a 401; a valid credential of the wrong
kind, or another trial's key, is a 403 (RFC 9110 §15.5.2 and §15.5.4). Secrets are compared
in constant time and never logged or echoed. Without an admin token configured the proxy
runs open (local development; the CLI insists on ``--no-auth`` for that).

This module decides and holds no I/O; ``proxy.api.auth`` reads the headers and raises.
"""

from __future__ import annotations

import enum
import hmac
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from proxy.exceptions import AuthenticationError, PermissionDeniedError

__all__ = [
    "AuthPolicy",
    "RouteKind",
    "Verdict",
    "key_trial",
    "new_trial_key",
    "presented_credentials",
    "raise_for",
    "route_kind",
    "secret_equal",
]

TRIAL_KEY_PREFIX = "rr-"
_AGENT_ROUTES = "/{trial_id}/v1/"
_ADMIN_ROUTES = ("/sessions", "/weights")


class RouteKind(enum.Enum):
    PUBLIC = "public"  # health, readiness, metrics, the worker socket (hello-authenticated)
    ADMIN = "admin"  # the session API
    AGENT = "agent"  # one trial's OpenAI / Anthropic / Responses routes


class Verdict(enum.Enum):
    ALLOW = "allow"
    MISSING = "missing"  # 401: no credential
    INVALID = "invalid"  # 401: a credential the proxy does not know
    WRONG_KIND = "wrong_kind"  # 403: a valid credential for another door
    OTHER_TRIAL = "other_trial"  # 403: a valid key of another trial


def secret_equal(expected: str, given: str) -> bool:
    """Constant-time comparison (the time does not depend on where the strings differ)."""
    return hmac.compare_digest(expected.encode(), given.encode())


def new_trial_key(trial_id: str) -> str:
    """A fresh API key for ``trial_id``: ``rr-<trial_id>.<192 random bits>``.

    The key names its trial (which is no secret: it is in every URL the agent calls), so a
    key presented on the wrong trial is recognised as another trial's key (403) with one
    lookup, without an index of every key."""
    return f"{TRIAL_KEY_PREFIX}{trial_id}.{secrets.token_urlsafe(24)}"


def key_trial(key: str) -> str | None:
    """The trial a key produced by ``new_trial_key`` claims to belong to (unverified)."""
    if not key.startswith(TRIAL_KEY_PREFIX):
        return None
    trial, dot, secret = key[len(TRIAL_KEY_PREFIX) :].rpartition(".")
    if not dot or not trial or not secret:
        return None
    return trial


def _bearer(value: str) -> str | None:
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def presented_credentials(headers: Mapping[str, str]) -> list[str]:
    """Every credential a request carries, in the order ``Authorization: Bearer``,
    ``x-api-key``, ``api-key`` (a header lookup in aiohttp is case-insensitive)."""
    found: list[str] = []
    authorization = headers.get("Authorization")
    if authorization:
        token = _bearer(authorization)
        if token:
            found.append(token)
    for name in ("x-api-key", "api-key"):
        value = (headers.get(name) or "").strip()
        if value:
            found.append(value)
    return found


def route_kind(canonical: str) -> RouteKind:
    """The door a route belongs to, from its canonical pattern (not the raw path, so a
    trial named ``sessions`` is still an agent route)."""
    if canonical.startswith(_AGENT_ROUTES):
        return RouteKind.AGENT
    for admin in _ADMIN_ROUTES:
        if canonical == admin or canonical.startswith(admin + "/"):
            return RouteKind.ADMIN
    return RouteKind.PUBLIC


# The API key of an existing trial, or None when there is no such trial.
TrialKeyLookup = Callable[[str], str | None]


@dataclass(slots=True, frozen=True)
class AuthPolicy:
    admin_token: str | None
    worker_token: str | None = None

    @property
    def enabled(self) -> bool:
        return self.admin_token is not None

    def _is_service_token(self, credential: str) -> bool:
        return any(
            token is not None and secret_equal(token, credential)
            for token in (self.admin_token, self.worker_token)
        )

    def _is_trial_key(self, credential: str, trial_key: TrialKeyLookup) -> bool:
        trial = key_trial(credential)
        if trial is None:
            return False
        expected = trial_key(trial)
        return expected is not None and secret_equal(expected, credential)

    def check_admin(self, credentials: Iterable[str], trial_key: TrialKeyLookup) -> Verdict:
        if self.admin_token is None:
            return Verdict.ALLOW
        given = list(credentials)
        if not given:
            return Verdict.MISSING
        if any(secret_equal(self.admin_token, c) for c in given):
            return Verdict.ALLOW
        if any(self._is_service_token(c) or self._is_trial_key(c, trial_key) for c in given):
            return Verdict.WRONG_KIND
        return Verdict.INVALID

    def check_agent(
        self, credentials: Iterable[str], trial_id: str, trial_key: TrialKeyLookup
    ) -> Verdict:
        if self.admin_token is None:
            return Verdict.ALLOW
        given = list(credentials)
        if not given:
            return Verdict.MISSING
        expected = trial_key(trial_id)
        if expected is not None and any(secret_equal(expected, c) for c in given):
            return Verdict.ALLOW
        if any(self._is_trial_key(c, trial_key) for c in given):
            return Verdict.OTHER_TRIAL
        if any(self._is_service_token(c) for c in given):
            return Verdict.WRONG_KIND
        return Verdict.INVALID


_MESSAGES = {
    RouteKind.ADMIN: {
        Verdict.MISSING: "the session API needs the admin token (Authorization: Bearer)",
        Verdict.INVALID: "invalid admin token",
        Verdict.WRONG_KIND: "this credential does not open the session API; use the admin token",
    },
    RouteKind.AGENT: {
        Verdict.MISSING: (
            "missing API key: send the trial's key as Authorization: Bearer, x-api-key or api-key"
        ),
        Verdict.INVALID: "invalid API key",
        Verdict.WRONG_KIND: "this credential does not open agent routes; use the trial's API key",
        Verdict.OTHER_TRIAL: "this API key belongs to another trial",
    },
}


def raise_for(kind: RouteKind, verdict: Verdict) -> None:
    """Turn a refusal into the proxy error the error middleware renders."""
    if verdict is Verdict.ALLOW:
        return
    message = _MESSAGES[kind][verdict]
    if verdict in {Verdict.MISSING, Verdict.INVALID}:
        raise AuthenticationError(message, code=f"{verdict.value}_credential")
    raise PermissionDeniedError(message, code=verdict.value)
