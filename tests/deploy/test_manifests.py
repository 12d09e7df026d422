"""The manifests under deploy/: they build, match kustomize, validate against the Kubernetes
API schemas, keep the security settings, and agree with the proxy's real CLI and routes."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from deploy.render import PROXY, SERVICE, WORKER, DeployOptions, build, customize, find
from proxy.app import build_app
from proxy.config import ProxyConfig
from relay.cluster import ClusterError, validate_peers
from rollout_relay.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ["base", "overlays/dev", "overlays/prod"]
# Oldest and newest Kubernetes minor versions the manifests must be valid for.
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]
# Variables the containers set for libraries rather than for the rollout-relay CLI.
LIBRARY_ENV = {"HOME", "HF_HOME", "HF_HUB_OFFLINE"}

Manifest = dict[str, Any]


def rendered(overlay: str) -> list[Manifest]:
    return build(DEPLOY / overlay)


def pod_specs(objects: list[Manifest]) -> list[tuple[str, Manifest]]:
    return [
        (f"{obj['kind']}/{obj['metadata']['name']}", obj["spec"]["template"]["spec"])
        for obj in objects
        if "template" in obj.get("spec", {})
    ]


def get_routes() -> set[str]:
    app = build_app(ProxyConfig())
    return {
        route.resource.canonical
        for route in app.router.routes()
        if route.method == "GET" and route.resource is not None
    }


def container_env(
    container: Manifest, objects: list[Manifest], fields: dict[str, str] | None = None
) -> dict[str, str]:
    """The container's environment as Kubernetes builds it; a Secret's value stands for
    itself as <secret/key>, as the cluster would fill it in; a pod field (downward API)
    takes its value from ``fields``."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(find(objects, "ConfigMap", name)["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in item["valueFrom"]:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = (fields or {}).get(path, f"<{path}>")
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = f"<{ref['name']}/{ref['key']}>"
    return env


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(args: list[str], env: dict[str, str]) -> tuple[list[str], set[str], list[str]]:
    """Kubernetes' $(VAR) expansion of container args: the args, the names used, and the
    problems (names the environment lacks)."""
    used: set[str] = set()
    problems: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        used.add(name)
        if name not in env:
            problems.append(f"$({name}) is not in the container's environment")
            return match.group(0)
        return env[name]

    return [_VAR.sub(substitute, arg) for arg in args], used, problems


def parse_cli(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The container's command line through the real parser, with its environment set."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        return None
    finally:
        for name in env:
            monkeypatch.delenv(name, raising=False)


def read_by_cli(name: str, command: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the CLI takes a default from environment variable ``name`` for ``command``."""
    sentinel = "sentinel-value-from-env"
    minimal = {"proxy": ["proxy"], "worker": ["worker", "--proxy", "ws://x/", "--model", "m"]}
    parsed = parse_cli(minimal[command], {name: sentinel}, monkeypatch)
    return parsed is not None and sentinel in {str(v) for v in vars(parsed).values()}


def mount_paths(container: Manifest) -> dict[str, str]:
    return {mount["mountPath"]: mount["name"] for mount in container.get("volumeMounts", [])}


def check_agreement(objects: list[Manifest], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Everything the manifests assume of the proxy and worker CLIs and routes that is not so."""
    problems: list[str] = []
    routes = get_routes()
    proxy_set = find(objects, *PROXY)
    pod = proxy_set["spec"]["template"]["spec"]
    proxy = next(c for c in pod["containers"] if c["name"] == "proxy")
    namespace = proxy_set["metadata"].get("namespace", "default")
    name = proxy_set["metadata"]["name"]
    env = container_env(
        proxy, objects, {"metadata.name": f"{name}-0", "metadata.namespace": namespace}
    )
    args, used, missing = expand(proxy["args"], env)
    problems += missing
    parsed = parse_cli(args, env, monkeypatch)
    if parsed is None or parsed.command != "proxy":
        return [*problems, f"the proxy CLI rejects {args}"]
    # Every replica finds itself in the peer list (the proxy refuses to start otherwise).
    for index in range(int(proxy_set["spec"]["replicas"])):
        own = container_env(
            proxy,
            objects,
            {"metadata.name": f"{name}-{index}", "metadata.namespace": namespace},
        )
        mine = parse_cli(expand(proxy["args"], own)[0], own, monkeypatch)
        try:
            validate_peers(mine.public_url, mine.peers.split(","))
        except ClusterError as exc:
            problems.append(f"replica {index}: {exc}")
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    if parsed.port != ports.get("http"):
        problems.append(f"--port {parsed.port} is not the container port {ports.get('http')}")
    if parsed.host != "0.0.0.0":
        problems.append(f"--host {parsed.host} is not reachable from other pods")
    if not (parsed.admin_token and parsed.worker_token):
        problems.append("the proxy gets no admin and worker tokens from its environment")
    mounts = mount_paths(proxy)
    claims = {t["metadata"]["name"] for t in proxy_set["spec"].get("volumeClaimTemplates", [])}
    if mounts.get(str(parsed.data_dir)) not in claims:
        problems.append(f"--data-dir {parsed.data_dir} is not on the persistent volume")
    if str(parsed.cache_dir) not in mounts:
        problems.append(f"--cache-dir {parsed.cache_dir} is not a writable volume")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if parsed.drain_seconds >= grace:
        problems.append(f"--drain-seconds {parsed.drain_seconds} >= grace period {grace}s")
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = proxy.get(probe_name, {}).get("httpGet")
        if probe is None:
            problems.append(f"the proxy has no HTTP {probe_name}")
            continue
        if probe["path"] not in routes:
            problems.append(f"{probe_name} path {probe['path']} is not a proxy route")
        if probe["port"] not in ports and probe["port"] not in ports.values():
            problems.append(f"{probe_name} port {probe['port']} is not a container port")
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe_name, path in expected.items():
        if proxy.get(probe_name, {}).get("httpGet", {}).get("path") != path:
            problems.append(f"{probe_name} does not probe {path}")
    problems += unused_env(proxy, used, "proxy", monkeypatch)

    service = find(objects, *SERVICE)
    labels = pod_labels(proxy_set)
    if not service["spec"]["selector"].items() <= labels.items():
        problems.append("the Service does not select the proxy pods")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for port in service_ports.values():
        if port["targetPort"] not in ports and port["targetPort"] not in ports.values():
            problems.append(f"Service targetPort {port['targetPort']} is not a proxy port")

    worker_set = find(objects, *WORKER)
    worker_pod = worker_set["spec"]["template"]["spec"]
    worker = next(c for c in worker_pod["containers"] if c["name"] == "worker")
    worker_env = container_env(worker, objects)
    wargs, wused, wmissing = expand(worker["args"], worker_env)
    problems += wmissing
    wparsed = parse_cli(wargs, worker_env, monkeypatch)
    if wparsed is None or wparsed.command != "worker":
        return [*problems, f"the worker CLI rejects {wargs}"]
    # Workers dial the StatefulSet's headless Service: a name with every replica's address,
    # ready or not (a replica is ready only once a worker joined it).
    (dialed,) = wparsed.proxy
    url = urlsplit(dialed)
    headless = find(objects, "Service", proxy_set["spec"]["serviceName"])
    service_port = {p["name"]: p for p in headless["spec"]["ports"]}["http"]["port"]
    if url.scheme != "ws" or url.hostname != headless["metadata"]["name"]:
        problems.append(f"workers dial {dialed}, not the replicas' headless Service")
    if headless["spec"].get("clusterIP") != "None" or not headless["spec"].get(
        "publishNotReadyAddresses"
    ):
        problems.append("the replicas' Service is not headless with not-ready addresses")
    if url.port != service_port:
        problems.append(f"workers dial port {url.port}, the Service listens on {service_port}")
    if url.path not in routes:
        problems.append(f"workers dial {url.path}, which is not a proxy route")
    if not wparsed.token:
        problems.append("the worker gets no worker token from its environment")
    if worker_env.get("RELAY_WORKER_TOKEN") != env.get("RELAY_WORKER_TOKEN"):
        problems.append("the worker and the proxy read the worker token from different keys")
    if str(wparsed.model) not in mount_paths(worker) and not any(
        str(wparsed.model).startswith(path + "/") for path in mount_paths(worker)
    ):
        problems.append(f"--model {wparsed.model} is not on a volume")
    fetched = [arg for init in worker_pod.get("initContainers", []) for arg in init.get("args", [])]
    if str(wparsed.model) not in fetched:
        problems.append(f"no init container writes the model to {wparsed.model}")
    problems += unused_env(worker, wused, "worker", monkeypatch)
    init_used = {
        name
        for init in worker_pod.get("initContainers", [])
        for name in expand(init.get("args", []), worker_env)[1]
    }
    problems += unused_config(
        objects,
        {"proxy": ("proxy", used), "worker": ("worker", wused | init_used)},
        monkeypatch,
    )

    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if port["port"] not in ports and port["port"] not in ports.values():
                    problems.append(f"{policy['metadata']['name']}: ingress port {port['port']}")
    return problems


def unused_env(
    container: Manifest,
    used: set[str],
    command: str,
    monkeypatch: pytest.MonkeyPatch,
) -> list[str]:
    """Variables the container sets itself (env) that neither its args nor the CLI read."""
    problems = []
    for item in container.get("env", []):
        name = item["name"]
        if name in used or name in LIBRARY_ENV or read_by_cli(name, command, monkeypatch):
            continue
        problems.append(f"{command} sets {name}, which neither its args nor the CLI read")
    return problems


def unused_config(
    objects: list[Manifest],
    readers: dict[str, tuple[str, set[str]]],
    monkeypatch: pytest.MonkeyPatch,
) -> list[str]:
    """ConfigMap keys that no container uses: neither in its args nor read by its CLI.
    ``readers``: container name -> (CLI command, names its args use)."""
    problems = []
    for config_map in (o for o in objects if o["kind"] == "ConfigMap"):
        for key in config_map["data"]:
            if not any(
                key in used or read_by_cli(key, command, monkeypatch)
                for command, used in readers.values()
            ):
                problems.append(f"ConfigMap key {key} is read by no container")
    return problems


def pod_labels(obj: Manifest) -> dict[str, str]:
    return dict(obj["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_parses_and_builds(overlay: str) -> None:
    """Each kustomization builds into named, typed objects, all in one namespace."""
    objects = rendered(overlay)
    assert {"Namespace", "ServiceAccount", "ConfigMap", "Service", "StatefulSet"} <= {
        obj["kind"] for obj in objects
    }
    (namespace,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    for obj in objects:
        assert obj["apiVersion"]
        assert obj["metadata"]["name"]
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]


def test_every_yaml_file_parses() -> None:
    """No YAML file under deploy/ is malformed, and none holds a Secret's values."""
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 10
    for path in files:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, path
        for document in documents:
            assert not (isinstance(document, dict) and document.get("kind") == "Secret"), path


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_render_matches_kustomize(overlay: str) -> None:
    """`rollout-relay deploy` builds exactly what `kubectl kustomize` builds."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out)}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in rendered(overlay)}
    assert ours == theirs


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate_against_kubernetes_schemas(overlay: str, version: str) -> None:
    """Every object is valid for the Kubernetes API schemas, unknown fields refused."""
    for obj in rendered(overlay):
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_a_bad_field() -> None:
    """The schema check refuses what the API server would (a misspelt field, a bad type)."""
    proxy = copy.deepcopy(find(rendered("base"), *PROXY))
    proxy["spec"]["replica"] = 1
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(proxy, "1.37.0", strict=True)
    proxy = copy.deepcopy(find(rendered("base"), *PROXY))
    proxy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(proxy, "1.37.0", strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_locked_down(overlay: str) -> None:
    """Every pod runs as non-root on a read-only root filesystem, with no capabilities, no
    privilege escalation, no API token, and resource requests and limits."""
    for where, pod in pod_specs(rendered(overlay)):
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] != 0, where
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        assert pod["automountServiceAccountToken"] is False, where
        for container in pod.get("initContainers", []) + pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, (where, container["name"])
            assert context["allowPrivilegeEscalation"] is False, (where, container["name"])
            assert context["capabilities"]["drop"] == ["ALL"], (where, container["name"])
            for section in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"][section]), where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_proxy_is_one_replica_with_a_persistent_store(overlay: str) -> None:
    """SQLite has one writer: one proxy replica, a ReadWriteOnce claim, guarded against
    voluntary eviction; workers are drained one at a time."""
    objects = rendered(overlay)
    proxy = find(objects, *PROXY)
    assert proxy["spec"]["replicas"] == 1
    (claim,) = proxy["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    budgets = {
        o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PodDisruptionBudget"
    }
    assert budgets["rollout-relay-proxy"]["minAvailable"] == "51%"  # a majority
    assert budgets["rollout-relay-worker"]["maxUnavailable"] == 1
    assert (
        budgets["rollout-relay-proxy"]["selector"]["matchLabels"].items()
        <= pod_labels(proxy).items()
    )


def test_network_policy_lets_only_clients_and_workers_in() -> None:
    """The proxy takes ingress only on its port from labelled clients, the workers and the
    other replicas, and opens nothing but DNS and the other replicas' port (forwarding to
    a trial's owner); workers take no ingress."""
    objects = rendered("base")
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    proxy = policies["rollout-relay-proxy"]
    assert proxy["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = proxy["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["http"]
    peers = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert {"rollout-relay.io/client": "true"} in peers
    replicas = {"app.kubernetes.io/name": "rollout-relay", "app.kubernetes.io/component": "proxy"}
    assert replicas in peers
    assert {p["port"] for r in proxy["egress"] for p in r["ports"]} == {53, 8080}
    (forwarding,) = [r for r in proxy["egress"] if {p["port"] for p in r["ports"]} == {8080}]
    assert [peer["podSelector"]["matchLabels"] for peer in forwarding["to"]] == [replicas]
    assert policies["rollout-relay-worker"]["ingress"] == []


@pytest.mark.parametrize("overlay", ["overlays/dev", "overlays/prod"])
def test_dev_runs_without_a_gpu_and_prod_asks_for_one(overlay: str) -> None:
    """dev: a CPU worker on the tiny model; prod: GPU workers on vLLM."""
    worker = find(rendered(overlay), *WORKER)["spec"]["template"]["spec"]
    resources = worker["containers"][0]["resources"]
    args = worker["containers"][0]["args"]
    if overlay == "overlays/dev":
        assert "nvidia.com/gpu" not in resources["limits"]
        assert "--backend=hf" in args
        assert worker["initContainers"][0]["args"][:2] == ["tiny-model", "--shipped"]
    else:
        assert resources["limits"]["nvidia.com/gpu"] == "1"
        assert "--backend=vllm" in args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_agree_with_the_cli_and_routes(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every flag, env name, port, probe path and URL the manifests use exists in the real
    CLI parser and the proxy's routes."""
    assert check_agreement(rendered(overlay), monkeypatch) == []


def _mutated(change: str) -> list[Manifest]:
    objects = copy.deepcopy(rendered("base"))
    proxy = find(objects, *PROXY)["spec"]["template"]["spec"]["containers"][0]
    worker = find(objects, *WORKER)["spec"]["template"]["spec"]["containers"][0]
    if change == "port":
        proxy["args"] = [a.replace("--port=8080", "--port=9090") for a in proxy["args"]]
    elif change == "probe":
        proxy["readinessProbe"]["httpGet"]["path"] = "/ready"
    elif change == "flag":
        proxy["args"].append("--max-inflight=4")
    elif change == "env":
        proxy["env"].append({"name": "RELAY_MAX_INFLIGHT", "value": "4"})
    elif change == "worker-url":
        worker["args"] = [
            a.replace("/ws/worker", "/ws/workers") if a.startswith("--proxy") else a
            for a in worker["args"]
        ]
    elif change == "data-dir":
        proxy["args"] = [a.replace("/var/lib/", "/srv/") for a in proxy["args"]]
    elif change == "config-key":
        find(objects, "ConfigMap", "rollout-relay-config")["data"]["RELAY_MAX_QUEUE"] = "1"
    return objects


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ("port", "--port 9090"),
        ("probe", "readinessProbe path /ready"),
        ("flag", "the proxy CLI rejects"),
        ("env", "RELAY_MAX_INFLIGHT"),
        ("worker-url", "/ws/workers"),
        ("data-dir", "--data-dir /srv/rollout-relay"),
        ("config-key", "RELAY_MAX_QUEUE"),
    ],
)
def test_agreement_check_catches_a_drift(
    change: str, complaint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest that drifts from the CLI or the routes is reported, naming the drift."""
    problems = check_agreement(_mutated(change), monkeypatch)
    assert any(complaint in problem for problem in problems), problems


def test_secret_is_referenced_not_shipped() -> None:
    """Both tokens come from keys of the Secret that `rollout-relay deploy apply` writes."""
    refs = set()
    for _, pod in pod_specs(rendered("base")):
        for container in pod["containers"]:
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add((item["name"], ref["name"], ref["key"]))
    assert refs == {
        ("RELAY_ADMIN_TOKEN", "rollout-relay-tokens", "admin-token"),
        ("RELAY_WORKER_TOKEN", "rollout-relay-tokens", "worker-token"),
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_proxy_scales_to_three_replicas(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`deploy apply --replicas 3`: three replicas, each finding its own per-pod URL in the
    peer list, a claim each, a majority kept by the disruption budget, still valid for the
    API schemas and in agreement with the CLI."""
    objects = customize(rendered(overlay), DeployOptions(replicas=3))
    proxy = find(objects, *PROXY)
    assert proxy["spec"]["replicas"] == 3
    assert proxy["spec"]["podManagementPolicy"] == "Parallel"
    namespace = proxy["metadata"]["namespace"]
    peers = find(objects, "ConfigMap", "rollout-relay-config")["data"]["RELAY_PEERS"]
    assert peers.split(",") == [
        f"http://rollout-relay-proxy-{i}.rollout-relay-proxy.{namespace}.svc:8080" for i in range(3)
    ]
    assert check_agreement(objects, monkeypatch) == []
    for obj in objects:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)


def test_a_peer_list_out_of_step_with_the_replicas_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scaling the StatefulSet without the peer list leaves replicas that are not in it:
    the agreement check names them (the proxy itself would refuse to start)."""
    objects = copy.deepcopy(rendered("base"))
    find(objects, *PROXY)["spec"]["replicas"] = 2
    problems = check_agreement(objects, monkeypatch)
    assert any(p.startswith("replica 1: --peers must include") for p in problems), problems
