"""Credentials, TLS and limits on a real proxy with a real worker.

The secured proxy serves HTTPS with a certificate from a test CA (trustme), demands the
admin token on the session API and each trial's key on its agent routes, and admits
workers with the worker token; its worker dials in over ``wss://``.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import trustme

from proxy.appkeys import POOL
from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient, TrialSession
from sdk.exceptions import ProxyAuthError
from tests.e2e.conftest import TIMEOUT_FACTOR, wait_until_joined, worker_command
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel, WorkerClient, client_ssl_context
from worker_client.exceptions import ConnectionRefusedByProxy

pytestmark = pytest.mark.e2e

ADMIN = "admin-token-for-tests"
WORKER = "worker-token-for-tests"


@dataclass(slots=True)
class Secured:
    running: RunningProxy
    tls: ssl.SSLContext  # trusts the test CA
    ca_file: Path


@pytest.fixture(scope="module")
def ca_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A test CA and a certificate for 127.0.0.1 it signed: (ca, cert chain, key)."""
    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    paths = (root / "ca.pem", root / "cert.pem", root / "key.pem")
    ca.cert_pem.write_to_path(str(paths[0]))
    for i, pem in enumerate(issued.cert_chain_pems):
        pem.write_to_path(str(paths[1]), append=i > 0)
    issued.private_key_pem.write_to_path(str(paths[2]))
    return paths


@pytest.fixture(scope="module")
async def secured(
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    ca_files: tuple[Path, Path, Path],
) -> AsyncIterator[Secured]:
    ca_file, cert, key = ca_files
    config = ProxyConfig(
        port=0,
        admin_token=ADMIN,
        worker_token=WORKER,
        tls_cert=cert,
        tls_key=key,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=4,
        cache_dir=tmp_path_factory.mktemp("secured-cache"),
    )
    running = await start_proxy(config)
    tls = client_ssl_context(ca_file)
    assert running.worker_url.startswith("wss://")
    start_hf_worker(running, tiny_model_dir, token=WORKER, worker_id="wss-hf", ssl_context=tls)
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield Secured(running, tls, ca_file)
    await running.stop()


@pytest.fixture
async def admin(secured: Secured) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(
        secured.running.url, admin_token=ADMIN, ssl_context=secured.tls
    ) as client:
        yield client


@pytest.fixture
async def http(secured: Secured) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=secured.tls)) as session:
        yield session


@pytest.fixture
async def trials(admin: ProxyClient) -> AsyncIterator[tuple[TrialSession, TrialSession]]:
    """Two trials: the one called, and another whose key must not open it."""
    mine, other = await admin.create_session(), await admin.create_session()
    yield mine, other
    for trial in (mine, other):
        await admin.delete(trial.trial_id)


async def _call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: dict[str, str],
    body: Any = None,
) -> tuple[int, Any]:
    async with http.request(method, url, headers=headers, json=body) as response:
        return response.status, await response.json(content_type=None)


USER = [{"role": "user", "content": "hi"}]
# name, method, path under <proxy>/<trial>, body, error format
AGENT_ROUTES: list[tuple[str, str, str, Any, str]] = [
    (
        "chat",
        "POST",
        "/v1/chat/completions",
        {"model": "m", "messages": USER, "max_tokens": 2},
        "openai",
    ),
    ("responses", "POST", "/v1/responses", {"model": "m", "input": "hi"}, "openai"),
    (
        "messages",
        "POST",
        "/v1/messages",
        {"model": "m", "messages": USER, "max_tokens": 2},
        "anthropic",
    ),
    (
        "count_tokens",
        "POST",
        "/v1/messages/count_tokens",
        {"model": "m", "messages": USER},
        "anthropic",
    ),
    ("models", "GET", "/v1/models", None, "openai"),
]

# credential case -> expected status
AGENT_CREDENTIALS = {
    "none": 401,
    "unknown": 401,
    "forged_key_of_this_trial": 401,
    "admin_token": 403,
    "worker_token": 403,
    "other_trials_key": 403,
    "bearer": 200,
    "x-api-key": 200,
    "api-key": 200,
}


def _agent_headers(case: str, mine: TrialSession, other: TrialSession) -> dict[str, str]:
    return {
        "none": {},
        "unknown": {"Authorization": "Bearer sk-not-a-key"},
        "forged_key_of_this_trial": {"x-api-key": f"rr-{mine.trial_id}.forged"},
        "admin_token": {"Authorization": f"Bearer {ADMIN}"},
        "worker_token": {"x-api-key": WORKER},
        "other_trials_key": {"Authorization": f"Bearer {other.api_key}"},
        "bearer": {"Authorization": f"Bearer {mine.api_key}"},
        "x-api-key": {"x-api-key": mine.api_key},
        "api-key": {"api-key": mine.api_key},
    }[case]


def _error_type(payload: Any, fmt: str) -> str:
    if fmt == "anthropic":
        assert payload["type"] == "error"
    return str(payload["error"]["type"])


@pytest.mark.parametrize("case", list(AGENT_CREDENTIALS))
@pytest.mark.parametrize("route", AGENT_ROUTES, ids=[r[0] for r in AGENT_ROUTES])
async def test_agent_route_auth_matrix(
    secured: Secured,
    admin: ProxyClient,
    http: aiohttp.ClientSession,
    trials: tuple[TrialSession, TrialSession],
    route: tuple[str, str, str, Any, str],
    case: str,
) -> None:
    """Only the trial's own key opens its agent routes; refusals are 401/403 in the
    route's API format, carry no secret and record nothing."""
    mine, other = trials
    _, method, path, body, fmt = route
    url = f"{secured.running.url}/{mine.trial_id}{path}"
    status, payload = await _call(http, method, url, _agent_headers(case, mine, other), body)
    expected = AGENT_CREDENTIALS[case]
    assert status == expected, payload
    summary = await admin.get_session(mine.trial_id)
    if expected == 200:
        return
    kind = "authentication_error" if expected == 401 else "permission_error"
    assert _error_type(payload, fmt) == kind
    for secret in (ADMIN, WORKER, mine.api_key, other.api_key):
        assert secret not in str(payload)
    assert summary["turns"] == 0
    assert (await admin.get_session(other.trial_id))["turns"] == 0


async def test_unknown_trial_is_not_revealed(
    secured: Secured, http: aiohttp.ClientSession, trials: tuple[TrialSession, TrialSession]
) -> None:
    """Without a valid key, an unknown trial answers 401 like a known one (not 404), with
    the scheme to use in WWW-Authenticate."""
    url = f"{secured.running.url}/no-such-trial/v1/chat/completions"
    async with http.post(url, headers={"Authorization": "Bearer x"}, json={}) as response:
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        payload = await response.json()
    assert payload["error"]["type"] == "authentication_error"


SESSION_CREDENTIALS = {
    "none": 401,
    "unknown": 401,
    "trial_key": 403,
    "worker_token": 403,
    "admin_token": 0,  # the route's success status
}


def _presented(case: str, trial: TrialSession) -> dict[str, str]:
    """The headers of one SESSION_CREDENTIALS case."""
    return {
        "none": {},
        "unknown": {"Authorization": "Bearer nope"},
        "trial_key": {"Authorization": f"Bearer {trial.api_key}"},
        "worker_token": {"Authorization": f"Bearer {WORKER}"},
        "admin_token": {"Authorization": f"Bearer {ADMIN}"},
    }[case]


# name, method, path (with {trial}), body, success status
SESSION_ROUTES: list[tuple[str, str, str, Any, int]] = [
    ("create", "POST", "/sessions", {}, 201),
    ("create_named", "POST", "/sessions/{trial}-new", {}, 201),
    ("list", "GET", "/sessions", None, 200),
    ("get", "GET", "/sessions/{trial}", None, 200),
    ("trajectories", "GET", "/sessions/{trial}/trajectories", None, 200),
    ("tree", "GET", "/sessions/{trial}/tree", None, 200),
    ("complete", "POST", "/sessions/{trial}/complete", {"reward": 1.0}, 200),
    # Past the credential check, no teacher of that name is served: 400.
    ("teacher", "POST", "/sessions/{trial}/teacher", {"model": "none"}, 400),
    ("delete", "DELETE", "/sessions/{trial}", None, 200),
]


@pytest.mark.parametrize("case", list(SESSION_CREDENTIALS))
@pytest.mark.parametrize("route", SESSION_ROUTES, ids=[r[0] for r in SESSION_ROUTES])
async def test_session_api_auth_matrix(
    secured: Secured,
    admin: ProxyClient,
    http: aiohttp.ClientSession,
    route: tuple[str, str, str, Any, int],
    case: str,
) -> None:
    """Only the admin token opens the session API; a trial's key (even for its own
    session) or the worker token is a 403; refusals change nothing."""
    trial = await admin.create_session()
    _, method, path, body, success = route
    headers = _presented(case, trial)
    before = (await admin.list_sessions(limit=1000))["sessions"]
    url = secured.running.url + path.format(trial=trial.trial_id)
    status, payload = await _call(http, method, url, headers, body)
    expected = SESSION_CREDENTIALS[case] or success
    assert status == expected, payload
    after = (await admin.list_sessions(limit=1000))["sessions"]
    if expected == success:
        for created in [s for s in after if s["trial_id"] not in {b["trial_id"] for b in before}]:
            await admin.delete(created["trial_id"])
    else:
        assert payload["error"]["type"] == (
            "authentication_error" if expected == 401 else "permission_error"
        )
        assert [(s["trial_id"], s["status"]) for s in after] == [
            (s["trial_id"], s["status"]) for s in before
        ]
    if route[0] != "delete" or expected != success:
        await admin.delete(trial.trial_id)


@pytest.mark.parametrize("case", list(SESSION_CREDENTIALS))
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_weights_api_auth_matrix(
    secured: Secured,
    admin: ProxyClient,
    http: aiohttp.ClientSession,
    method: str,
    case: str,
) -> None:
    """Only the admin token reads or updates the weights; a trial's key or the worker
    token is a 403, no credential a 401, and a refused update changes no version."""
    trial = await admin.create_session()
    headers = _presented(case, trial)
    before = await admin.weights()
    body = {"version": before["version"] + 1} if method == "POST" else None
    status, payload = await _call(http, method, secured.running.url + "/weights", headers, body)
    await admin.delete(trial.trial_id)
    expected = SESSION_CREDENTIALS[case] or 200
    assert status == expected, payload
    after = await admin.weights()
    if expected == 200:
        assert payload["version"] == after["version"]
        assert after["version"] == before["version"] + (method == "POST")
    else:
        assert payload["error"]["type"] == (
            "authentication_error" if expected == 401 else "permission_error"
        )
        assert after == before


async def test_sdk_without_admin_token_gets_auth_error(secured: Secured) -> None:
    """ProxyClient surfaces a missing admin token as ProxyAuthError (401)."""
    async with ProxyClient(secured.running.url, admin_token="", ssl_context=secured.tls) as c:
        with pytest.raises(ProxyAuthError) as exc:
            await c.create_session()
    assert exc.value.status == 401


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> HFEngine:
    return HFEngine.load(tiny_model_dir)


@pytest.mark.parametrize("case", ["none", "unknown", "admin_token", "trial_key"])
async def test_worker_socket_refuses_wrong_tokens(
    secured: Secured,
    admin: ProxyClient,
    engine: HFEngine,
    tiny_model_dir: Path,
    case: str,
) -> None:
    """A worker without the worker token is refused and never joins the pool."""
    trial = await admin.create_session()
    token = {"none": "", "unknown": "nope", "admin_token": ADMIN, "trial_key": trial.api_key}[case]
    client = WorkerClient(
        secured.running.worker_url,
        {engine.card.name: ServedModel(engine, tiny_model_dir)},
        token=token,
        worker_id=f"intruder-{case}",
        ssl_context=secured.tls,
    )
    with pytest.raises(ConnectionRefusedByProxy, match="invalid worker token"):
        await asyncio.wait_for(client.run(max_attempts=1), 30 * TIMEOUT_FACTOR)
    assert f"intruder-{case}" not in secured.running.app[POOL].workers
    await admin.delete(trial.trial_id)


async def test_worker_socket_admits_the_worker_token_over_wss(
    secured: Secured, engine: HFEngine, tiny_model_dir: Path
) -> None:
    """The right token over wss:// joins the pool."""
    client = WorkerClient(
        secured.running.worker_url,
        {engine.card.name: ServedModel(engine, tiny_model_dir)},
        token=WORKER,
        worker_id="second-wss",
        ssl_context=secured.tls,
    )
    task = asyncio.create_task(client.run(max_attempts=1))
    try:
        await asyncio.wait_for(client.connected.wait(), 30 * TIMEOUT_FACTOR)
        assert "second-wss" in secured.running.app[POOL].workers
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_openai_and_anthropic_sdks_over_https(
    secured: Secured, admin: ProxyClient, trials: tuple[TrialSession, TrialSession]
) -> None:
    """The official SDKs reach the trial over HTTPS with its key; the turns are recorded;
    the SDKs raise their own auth errors for a wrong or foreign key."""
    mine, other = trials
    assert mine.base_url.startswith("https://")
    # Each SDK's own default HTTP client, verifying against the test CA.
    async with (
        openai.DefaultAsyncHttpxClient(verify=secured.tls) as transport,
        anthropic.DefaultAsyncHttpxClient(verify=secured.tls) as anthropic_transport,
    ):
        client = openai.AsyncOpenAI(
            base_url=mine.base_url, api_key=mine.api_key, max_retries=0, http_client=transport
        )
        reply = await client.chat.completions.create(model="m", messages=USER, max_tokens=3)  # type: ignore[arg-type]
        assert reply.usage is not None
        assert reply.usage.completion_tokens >= 1
        wrong = openai.AsyncOpenAI(
            base_url=mine.base_url, api_key="sk-wrong", max_retries=0, http_client=transport
        )
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="m", messages=USER, max_tokens=3)  # type: ignore[arg-type]

        claude = anthropic.AsyncAnthropic(
            base_url=mine.anthropic_base_url,
            api_key=mine.api_key,
            max_retries=0,
            http_client=anthropic_transport,
        )
        message = await claude.messages.create(model="m", messages=USER, max_tokens=3)  # type: ignore[arg-type]
        assert message.usage.output_tokens >= 1
        foreign = anthropic.AsyncAnthropic(
            base_url=mine.anthropic_base_url,
            api_key=other.api_key,
            max_retries=0,
            http_client=anthropic_transport,
        )
        with pytest.raises(anthropic.PermissionDeniedError):
            await foreign.messages.create(model="m", messages=USER, max_tokens=3)  # type: ignore[arg-type]
    summary = await admin.get_session(mine.trial_id)
    assert summary["turns"] == 2
    export = await admin.trajectories(mine.trial_id)
    assert sum(sum(t["response_mask"]) for t in export["trajectories"]) == (
        reply.usage.completion_tokens + message.usage.output_tokens
    )


async def test_clients_that_do_not_trust_the_certificate_fail(
    secured: Secured,
    trials: tuple[TrialSession, TrialSession],
    engine: HFEngine,
    tiny_model_dir: Path,
) -> None:
    """Certificate verification is on: a client without the CA cannot connect."""
    mine, _ = trials
    client = openai.AsyncOpenAI(base_url=mine.base_url, api_key=mine.api_key, max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        await client.models.list()
    await client.close()
    worker = WorkerClient(
        secured.running.worker_url,
        {engine.card.name: ServedModel(engine, tiny_model_dir)},
        token=WORKER,
        worker_id="untrusting",
        ssl_context=ssl.create_default_context(),
    )
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(worker.run(max_attempts=1), 30 * TIMEOUT_FACTOR)


async def test_worker_cli_dials_wss_with_a_ca_file(secured: Secured, tiny_model_dir: Path) -> None:
    """`rollout-relay worker --proxy wss://... --ca-file CA --token W` joins over TLS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    worker = await asyncio.create_subprocess_exec(
        *worker_command(
            secured.running.worker_url,
            tiny_model_dir,
            "--token",
            WORKER,
            "--ca-file",
            str(secured.ca_file),
            "--worker-id",
            "cli-wss",
        ),
        env=env,
    )
    try:
        await wait_until_joined(secured.running, worker, "cli-wss")
    finally:
        worker.terminate()
        await worker.wait()
