"""Deciding who may call what: credentials, route kinds, verdicts."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.auth import (
    AuthPolicy,
    RouteKind,
    Verdict,
    key_trial,
    new_trial_key,
    presented_credentials,
    raise_for,
    route_kind,
    secret_equal,
)
from proxy.exceptions import AuthenticationError, PermissionDeniedError

KEYS = {"a": new_trial_key("a"), "b.v2": new_trial_key("b.v2")}
POLICY = AuthPolicy(admin_token="admin-secret", worker_token="worker-secret")


def lookup(trial: str) -> str | None:
    return KEYS.get(trial)


def test_new_trial_keys_name_their_trial_and_differ() -> None:
    """A key names its trial (dots in trial ids included) and carries fresh randomness."""
    assert key_trial(KEYS["a"]) == "a"
    assert key_trial(KEYS["b.v2"]) == "b.v2"
    assert new_trial_key("a") != KEYS["a"]
    assert len(KEYS["a"].rpartition(".")[2]) >= 32


@pytest.mark.parametrize("key", ["", "rr-", "rr-.x", "rr-a.", "sk-a.x", "rr-nodot"])
def test_malformed_keys_name_no_trial(key: str) -> None:
    """Keys not made by new_trial_key claim no trial."""
    assert key_trial(key) is None


def test_secret_equal() -> None:
    """Equality on the exact strings, unicode included."""
    assert secret_equal("tök", "tök")
    assert not secret_equal("tök", "tok")
    assert not secret_equal("abc", "abcd")


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, []),
        ({"Authorization": "Bearer k1"}, ["k1"]),
        ({"authorization": "bearer   k1  "}, ["k1"]),
        ({"Authorization": "Basic dTpw"}, []),
        ({"Authorization": "Bearer "}, []),
        ({"x-api-key": "k2"}, ["k2"]),
        ({"X-Api-Key": "k2", "api-key": "k3"}, ["k2", "k3"]),
        ({"Authorization": "Bearer k1", "x-api-key": "k2"}, ["k1", "k2"]),
    ],
)
def test_presented_credentials(headers: dict[str, str], expected: list[str]) -> None:
    """Bearer, x-api-key and api-key headers, case-insensitive, in that order."""
    assert presented_credentials(CIMultiDict(headers)) == expected


@pytest.mark.parametrize(
    ("canonical", "kind"),
    [
        ("/sessions", RouteKind.ADMIN),
        ("/sessions/{trial_id}/trajectories", RouteKind.ADMIN),
        ("/{trial_id}/v1/chat/completions", RouteKind.AGENT),
        ("/{trial_id}/v1/messages/count_tokens", RouteKind.AGENT),
        ("/{trial_id}/v1/models", RouteKind.AGENT),
        ("/healthz", RouteKind.PUBLIC),
        ("/ws/worker", RouteKind.PUBLIC),
        ("/sessionsx", RouteKind.PUBLIC),
        ("", RouteKind.PUBLIC),
    ],
)
def test_route_kind(canonical: str, kind: RouteKind) -> None:
    """Routes are classified by their pattern, not by the raw path."""
    assert route_kind(canonical) is kind


@pytest.mark.parametrize(
    ("credentials", "verdict"),
    [
        ([], Verdict.MISSING),
        (["nonsense"], Verdict.INVALID),
        (["admin-secret"], Verdict.ALLOW),
        (["nonsense", "admin-secret"], Verdict.ALLOW),
        (["worker-secret"], Verdict.WRONG_KIND),
        ([KEYS["a"]], Verdict.WRONG_KIND),
        ([KEYS["a"] + "x"], Verdict.INVALID),
    ],
)
def test_admin_verdicts(credentials: list[str], verdict: Verdict) -> None:
    """Only the admin token opens the session API; known credentials of another kind 403."""
    assert POLICY.check_admin(credentials, lookup) is verdict


@pytest.mark.parametrize(
    ("credentials", "trial", "verdict"),
    [
        ([], "a", Verdict.MISSING),
        (["nonsense"], "a", Verdict.INVALID),
        ([KEYS["a"]], "a", Verdict.ALLOW),
        ([KEYS["b.v2"]], "b.v2", Verdict.ALLOW),
        ([KEYS["b.v2"]], "a", Verdict.OTHER_TRIAL),
        ([KEYS["a"]], "unknown", Verdict.OTHER_TRIAL),
        (["rr-a.forged"], "a", Verdict.INVALID),
        (["admin-secret"], "a", Verdict.WRONG_KIND),
        (["worker-secret"], "a", Verdict.WRONG_KIND),
        (["nonsense"], "unknown", Verdict.INVALID),
        (["nonsense", KEYS["a"]], "a", Verdict.ALLOW),
    ],
)
def test_agent_verdicts(credentials: list[str], trial: str, verdict: Verdict) -> None:
    """A trial key opens its own trial only; unknown trials do not reveal themselves."""
    assert POLICY.check_agent(credentials, trial, lookup) is verdict


def test_open_policy_allows_everything() -> None:
    """Without an admin token (local development) nothing is checked."""
    open_policy = AuthPolicy(admin_token=None)
    assert not open_policy.enabled
    assert open_policy.check_admin([], lookup) is Verdict.ALLOW
    assert open_policy.check_agent([], "a", lookup) is Verdict.ALLOW


def test_refusals_map_to_401_and_403_without_secrets() -> None:
    """Missing and unknown credentials are 401s, wrong kinds 403s; no secret in messages."""
    raise_for(RouteKind.AGENT, Verdict.ALLOW)
    for verdict in (Verdict.MISSING, Verdict.INVALID):
        with pytest.raises(AuthenticationError) as auth:
            raise_for(RouteKind.ADMIN, verdict)
        assert auth.value.status == 401
    for verdict in (Verdict.WRONG_KIND, Verdict.OTHER_TRIAL):
        with pytest.raises(PermissionDeniedError) as denied:
            raise_for(RouteKind.AGENT, verdict)
        assert denied.value.status == 403
        assert "secret" not in denied.value.message
