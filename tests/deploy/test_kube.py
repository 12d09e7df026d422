"""`rollout-relay deploy apply|status|delete` through the official Kubernetes client.

No Kubernetes API server can run on the test machines, so a small in-process stand-in on
loopback answers what the client asks: discovery (/version, /api, /apis, resource lists),
server-side apply (PATCH application/apply-patch+yaml with fieldManager and force), GET and
DELETE, with 404 for unknown objects and namespaces, and 403 for kinds it is told to refuse.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from deploy.exceptions import DeployError
from deploy.kube import Status, connect, plan_tokens, status_lines
from rollout_relay.cli import main

RESOURCES = {
    "v1": [
        ("namespaces", "Namespace", False),
        ("serviceaccounts", "ServiceAccount", True),
        ("configmaps", "ConfigMap", True),
        ("secrets", "Secret", True),
        ("services", "Service", True),
        ("persistentvolumeclaims", "PersistentVolumeClaim", True),
    ],
    "apps/v1": [("statefulsets", "StatefulSet", True), ("deployments", "Deployment", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
}
KIND_OF = {plural: kind for group in RESOURCES.values() for plural, kind, _ in group}


class FakeApiServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        # (kind, namespace or "", name) -> object
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.applies: list[tuple[str, str, dict[str, list[str]]]] = []
        self.forbidden: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(
            code,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            },
        )

    def _discovery(self, path: str) -> Any:
        if path == "/version":
            return {"major": "1", "minor": "37", "gitVersion": "v1.37.0"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            groups = []
            for group_version in RESOURCES:
                if "/" in group_version:
                    name, version = group_version.split("/")
                    entry = {"groupVersion": group_version, "version": version}
                    groups.append({"name": name, "versions": [entry], "preferredVersion": entry})
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        for group_version, resources in RESOURCES.items():
            prefix = "/api/" if group_version == "v1" else "/apis/"
            if path == prefix + group_version:
                return {
                    "kind": "APIResourceList",
                    "groupVersion": group_version,
                    "resources": [
                        {
                            "name": plural,
                            "singularName": kind.lower(),
                            "namespaced": namespaced,
                            "kind": kind,
                            "verbs": ["create", "delete", "get", "list", "patch"],
                        }
                        for plural, kind, namespaced in resources
                    ],
                }
        return None

    def _key(self, path: str) -> tuple[str, str, str] | None:
        parts = path.strip("/").split("/")
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        if rest[:1] != ["namespaces"]:
            return None
        if len(rest) == 2:
            return ("Namespace", "", rest[1])
        if len(rest) == 4:
            return (KIND_OF[rest[2]], rest[1], rest[3])
        return None

    def _object(self) -> tuple[tuple[str, str, str], Any] | None:
        key = self._key(urlsplit(self.path).path)
        if key is None:
            self._status(404, "NotFound", "no such path")
            return None
        return key, self.server.objects.get(key)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        discovered = self._discovery(path)
        if discovered is not None:
            self._send(200, discovered)
            return
        found = self._object()
        if found is None:
            return
        key, obj = found
        if obj is None:
            self._status(404, "NotFound", f'{key[0].lower()}s "{key[2]}" not found')
        else:
            self._send(200, obj)

    def do_PATCH(self) -> None:
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.applies.append((self.headers["Content-Type"], split.path, query))
        found = self._object()
        if found is None:
            return
        key, _ = found
        if key[0] in self.server.forbidden:
            self._status(403, "Forbidden", f"{key[0].lower()}s is forbidden: user cannot patch")
            return
        if key[1] and ("Namespace", "", key[1]) not in self.server.objects:
            self._status(404, "NotFound", f'namespaces "{key[1]}" not found')
            return
        self.server.objects[key] = body
        self._send(200, body)

    def do_DELETE(self) -> None:
        found = self._object()
        if found is None:
            return
        key, obj = found
        if obj is None:
            self._status(404, "NotFound", f'"{key[2]}" not found')
            return
        del self.server.objects[key]
        self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def deploy(*args: str) -> list[str]:
    return ["deploy", *args]


def test_apply_creates_everything_namespace_first_with_generated_tokens(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """apply server-side-applies every object (Namespace first, as field manager
    rollout-relay), writes a token Secret with fresh tokens, and says where to connect."""
    config = str(kubeconfig(tmp_path, api.url))
    assert main(deploy("apply", "--overlay", "dev", "--kubeconfig", config)) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "applied Namespace/rollout-relay-dev"
    assert "applied Secret/rollout-relay-tokens" in out
    assert "generated new tokens" in out
    assert (
        "agents connect to   http://rollout-relay.rollout-relay-dev.svc:8080/<trial_id>/v1" in out
    )
    assert "ws://rollout-relay.rollout-relay-dev.svc:8080/ws/worker" in out
    kinds = {key[0] for key in api.objects}
    assert kinds == {
        "Namespace",
        "ServiceAccount",
        "ConfigMap",
        "Secret",
        "Service",
        "StatefulSet",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    assert all(ct == "application/apply-patch+yaml" for ct, _, _ in api.applies)
    assert all(q["fieldManager"] == ["rollout-relay"] for _, _, q in api.applies)
    tokens = api.objects[("Secret", "rollout-relay-dev", "rollout-relay-tokens")]["stringData"]
    assert set(tokens) == {"admin-token", "worker-token"}
    assert tokens["admin-token"] != tokens["worker-token"]
    assert min(len(t) for t in tokens.values()) >= 32
    assert tokens["admin-token"] not in out


def test_apply_keeps_existing_tokens_or_writes_given_ones(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second apply without tokens keeps the Secret; given tokens replace it; one token
    alone is refused before anything changes."""
    config = str(kubeconfig(tmp_path, api.url))
    key = ("Secret", "rollout-relay", "rollout-relay-tokens")
    assert main(deploy("apply", "--kubeconfig", config)) == 0
    first = api.objects[key]
    assert main(deploy("apply", "--kubeconfig", config, "--workers", "2")) == 0
    assert "kept the tokens" in capsys.readouterr().out
    assert api.objects[key] == first
    assert (
        api.objects[("Deployment", "rollout-relay", "rollout-relay-worker")]["spec"]["replicas"]
        == 2
    )
    args = ["--admin-token", "admin-" + "a" * 32, "--worker-token", "worker-" + "w" * 32]
    assert main(deploy("apply", "--kubeconfig", config, *args)) == 0
    assert api.objects[key]["stringData"]["worker-token"] == "worker-" + "w" * 32
    before = dict(api.objects)
    assert main(deploy("apply", "--kubeconfig", config, "--admin-token", "x" * 40)) == 2
    assert "give both --admin-token and --worker-token" in capsys.readouterr().err
    assert api.objects == before


def test_status_reports_each_part(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """status reads the proxy, workers, store volume and Secret from the cluster."""
    config = str(kubeconfig(tmp_path, api.url))
    assert main(deploy("status", "--kubeconfig", config)) == 0
    assert "proxy: not deployed" in capsys.readouterr().out
    assert main(deploy("apply", "--kubeconfig", config)) == 0
    proxy = api.objects[("StatefulSet", "rollout-relay", "rollout-relay-proxy")]
    proxy["status"] = {"replicas": 1, "readyReplicas": 1}
    api.objects[("PersistentVolumeClaim", "rollout-relay", "data-rollout-relay-proxy-0")] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data-rollout-relay-proxy-0"},
        "spec": {"resources": {"requests": {"storage": "200Gi"}}},
        "status": {"phase": "Bound"},
    }
    capsys.readouterr()
    assert main(deploy("status", "--kubeconfig", config)) == 0
    out = capsys.readouterr().out.splitlines()
    assert "proxy: 1/1 ready, serving, a worker connected" in out
    assert "workers: 0/8 running" in out
    assert "store volume data-rollout-relay-proxy-0: Bound, 200Gi" in out
    assert "token secret rollout-relay-tokens: present" in out


def test_delete_keeps_the_store_unless_purged(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """delete removes the workloads but keeps the namespace, the store volume and the
    tokens; --purge removes those too; deleting twice is not an error."""
    config = str(kubeconfig(tmp_path, api.url))
    assert main(deploy("apply", "--kubeconfig", config)) == 0
    claim = ("PersistentVolumeClaim", "rollout-relay", "data-rollout-relay-proxy-0")
    api.objects[claim] = {"apiVersion": "v1", "kind": claim[0], "metadata": {"name": claim[2]}}
    assert main(deploy("delete", "--kubeconfig", config)) == 0
    assert set(api.objects) == {
        ("Namespace", "", "rollout-relay"),
        ("Secret", "rollout-relay", "rollout-relay-tokens"),
        claim,
    }
    assert main(deploy("delete", "--kubeconfig", config)) == 0
    # The proxy is gone, so its claim is found by re-applying and purging.
    assert main(deploy("apply", "--kubeconfig", config)) == 0
    assert main(deploy("delete", "--purge", "--kubeconfig", config)) == 0
    assert api.objects == {}
    assert "deleted Namespace/rollout-relay" in capsys.readouterr().out


def test_a_refusal_is_reported_not_raised(
    api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """RBAC refusing a kind: exit 2 and the API server's reason, no traceback."""
    api.forbidden.add("Secret")
    config = str(kubeconfig(tmp_path, api.url))
    assert main(deploy("apply", "--kubeconfig", config)) == 2
    err = capsys.readouterr().err
    assert "the cluster refused to apply Secret rollout-relay-tokens: 403 Forbidden" in err
    assert "secrets is forbidden" in err
    assert "Traceback" not in err


def test_no_cluster_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No kubeconfig, or an API server that does not answer: exit 2 with what is wrong."""
    missing = str(tmp_path / "nope")
    for action in ("apply", "status", "delete"):
        assert main(deploy(action, "--kubeconfig", missing)) == 2
        assert "no usable Kubernetes configuration" in capsys.readouterr().err
    with socket_closed() as url:
        config = str(kubeconfig(tmp_path, url))
        assert main(deploy("status", "--kubeconfig", config)) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the Kubernetes API at {url}" in err
    assert "Traceback" not in err


class socket_closed:
    """A loopback address where nothing listens."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        return None


def test_connect_reads_the_kubeconfig(tmp_path: Path) -> None:
    """connect points the client at the kubeconfig's server."""
    cluster = connect(kubeconfig(tmp_path, "http://127.0.0.1:6443"))
    assert cluster.host == "http://127.0.0.1:6443"
    with pytest.raises(DeployError, match="no usable Kubernetes configuration"):
        connect(kubeconfig(tmp_path, "http://127.0.0.1:6443"), context="other")


def test_plan_tokens() -> None:
    """Both tokens given: written; none and a Secret exists: kept; none and no Secret:
    generated; one alone: refused."""
    given = plan_tokens("ns", "a", "w", secret_exists=True)
    assert given.secret is not None
    assert given.secret["stringData"] == {"admin-token": "a", "worker-token": "w"}
    assert plan_tokens("ns", None, None, secret_exists=True).secret is None
    fresh = plan_tokens("ns", None, None, secret_exists=False)
    assert fresh.generated
    assert fresh.secret is not None
    with pytest.raises(DeployError):
        plan_tokens("ns", "a", None, secret_exists=False)


def test_status_lines_for_a_missing_deployment() -> None:
    """Nothing deployed: each part says so, and a missing Secret is loud."""
    lines = status_lines(Status("ns", None, None, [], secret_present=False))
    assert lines == [
        "namespace ns",
        "proxy: not deployed",
        "workers: not deployed",
        "token secret rollout-relay-tokens: MISSING",
    ]
