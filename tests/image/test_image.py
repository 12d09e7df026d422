"""The images, run on a real Docker engine as the manifests run them: the proxy container
non-root on a read-only root filesystem with its data volume and its tokens from the
environment, a worker container dialing out to it, one trial through the official openai
client, then ``docker stop`` (SIGTERM) and a new container on the same volume that serves
every acknowledged turn as before.

``make test-image`` (scripts/test-image.sh) starts the engine, builds the images and runs
this file with their tags in RELAY_TEST_IMAGE_PROXY and RELAY_TEST_IMAGE_WORKER; without
them every test here is skipped. The containers use the host's network on loopback only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from deploy.render import CONFIG_MAP, PROXY, PROXY_CONTAINER, WORKER, WORKER_CONTAINER, build, find
from worker_client.tiny_model import SHIPPED_TINY_MODEL

PROXY_IMAGE = os.environ.get("RELAY_TEST_IMAGE_PROXY", "")
WORKER_IMAGE = os.environ.get("RELAY_TEST_IMAGE_WORKER", "")
TIMEOUT_FACTOR = float(os.environ.get("RELAY_TEST_TIMEOUT_FACTOR", "1"))
REPO = Path(__file__).resolve().parents[2]
# The dev overlay: the CPU worker's command line (hf backend, a local model directory).
OVERLAY = REPO / "deploy" / "overlays" / "dev"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (PROXY_IMAGE and WORKER_IMAGE),
        reason="make test-image builds the images and runs these (RELAY_TEST_IMAGE_PROXY, "
        "RELAY_TEST_IMAGE_WORKER)",
    ),
]

ADMIN_TOKEN = "admin-" + secrets.token_hex(8)
WORKER_TOKEN = "worker-" + secrets.token_hex(8)


def docker(*args: str, timeout: float = 60, check: bool = True) -> str:
    """``docker ARGS`` with a bound; its stdout. The tokens reach containers by name only
    (``-e NAME``), from this environment, never on a command line."""
    env = {**os.environ, "RELAY_ADMIN_TOKEN": ADMIN_TOKEN, "RELAY_WORKER_TOKEN": WORKER_TOKEN}
    result = subprocess.run(
        ["docker", *args],
        capture_output=True,
        text=True,
        timeout=timeout * TIMEOUT_FACTOR,
        env=env,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def wait_until(what: str, predicate: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds * TIMEOUT_FACTOR
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds * TIMEOUT_FACTOR:g}s")
        time.sleep(0.25)


def request(
    method: str, url: str, body: object = None, token: str | None = ADMIN_TOKEN
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30 * TIMEOUT_FACTOR) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Pod:
    """One container of a rendered manifest, as ``docker run`` flags and arguments."""

    spec: dict[str, Any]
    container: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)

    def security_flags(self) -> list[str]:
        """The pod's and the container's securityContext, as Docker says them."""
        pod = self.spec.get("securityContext", {})
        own = self.container.get("securityContext", {})
        flags = ["--user", f"{pod['runAsUser']}:{pod['runAsGroup']}"]
        if own.get("readOnlyRootFilesystem"):
            flags.append("--read-only")
        if own.get("allowPrivilegeEscalation") is False:
            flags += ["--security-opt", "no-new-privileges"]
        flags += [f"--cap-drop={cap}" for cap in own.get("capabilities", {}).get("drop", [])]
        return flags

    def empty_dirs(self, skip: set[str]) -> list[str]:
        """Each emptyDir mount as a tmpfs the pod's user owns (fsGroup's part)."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        uid = self.spec["securityContext"]["runAsUser"]
        flags = []
        for mount in self.container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if mount["name"] in skip or "emptyDir" not in volume:
                continue
            flags += ["--tmpfs", f"{mount['mountPath']}:uid={uid},gid={uid},mode=0755"]
        return flags

    def args(self, **replace: str) -> list[str]:
        """The container's args with $(NAME) expanded as the kubelet does, each
        ``--option=`` in ``replace`` (underscores for dashes) given the new value."""
        out = []
        for arg in self.container["args"]:
            arg = re.sub(r"\$\((\w+)\)", lambda m: self.env[m.group(1)], arg)
            option = arg.split("=", 1)[0].lstrip("-").replace("-", "_")
            if arg.startswith("--") and option in replace:
                arg = f"--{option.replace('_', '-')}={replace[option]}"
            out.append(arg)
        return out

    def env_flags(self) -> list[str]:
        """Literal values as ``-e NAME=VALUE``; secrets by name only."""
        flags = [f"-e{name}={value}" for name, value in self.env.items()]
        for entry in self.container.get("env", []):
            if "secretKeyRef" in entry.get("valueFrom", {}):
                flags.append(f"-e{entry['name']}")
        return flags


def pod(kind_name: tuple[str, str], container: str, objects: list[dict[str, Any]]) -> Pod:
    obj = find(objects, *kind_name)
    spec = obj["spec"]["template"]["spec"]
    (own,) = [c for c in spec["containers"] if c["name"] == container]
    env = dict(find(objects, *CONFIG_MAP)["data"])
    for entry in own.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
    return Pod(spec, own, env)


@dataclass
class Stack:
    """The proxy's container (replaced on restart), its volume and the worker's container."""

    port: int
    volume: str
    proxy_pod: Pod
    worker_pod: Pod
    proxy: str = ""
    worker: str = ""
    names: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_proxy(self) -> str:
        pod = self.proxy_pod
        pod.env.update(POD_NAME="proxy-0", POD_NAMESPACE="test", RELAY_PEERS=self.url)
        name = f"relay-test-proxy-{secrets.token_hex(4)}"
        self.names.append(name)
        (data,) = [m for m in pod.container["volumeMounts"] if m["name"] == "data"]
        probe = pod.container["livenessProbe"]["httpGet"]["path"]
        docker(
            "run",
            "--detach",
            "--name",
            name,
            "--network",
            "host",
            *pod.security_flags(),
            "--mount",
            f"type=volume,source={self.volume},target={data['mountPath']}",
            *pod.empty_dirs(skip={"data"}),
            *pod.env_flags(),
            # The image's HEALTHCHECK command every 2 s instead of 30 s: docker's first
            # check would otherwise come only after 30 s.
            "--health-interval=2s",
            "--health-start-period=0s",
            # The image's check asks 8080; here the port is a free one on loopback.
            "-e",
            f"RELAY_HEALTHCHECK_URL=http://127.0.0.1:{self.port}{probe}",
            PROXY_IMAGE,
            *pod.args(host="127.0.0.1", port=str(self.port), public_url=self.url),
        )
        self.proxy = name
        return name

    def fill_models(self) -> str:
        """The dev overlay's init container, run as the manifests run it, into a volume
        the worker then mounts (the pod's ``models`` emptyDir, shared by both containers;
        handed to the pod's group as the kubelet does for ``fsGroup``); returns the
        volume."""
        pod = self.worker_pod
        (init,) = pod.spec["initContainers"]
        group = pod.spec["securityContext"]["fsGroup"]
        volume = f"relay-test-models-{secrets.token_hex(4)}"
        docker("volume", "create", volume)
        self.volumes.append(volume)
        docker(
            *("run", "--rm", "--network", "none", "--user", "0", "--entrypoint", "sh"),
            *("--mount", f"type=volume,source={volume},target=/v", WORKER_IMAGE),
            *("-c", f"chgrp {group} /v && chmod 2775 /v"),
        )
        (mount,) = [m for m in init["volumeMounts"] if m["name"] == "models"]
        command, *rest = init["command"]
        own = {e["name"]: e["value"] for e in init.get("env", []) if "value" in e}
        init_pod = Pod(pod.spec, init, {**pod.env, **own})
        docker(
            "run",
            "--rm",
            "--network",
            "none",
            *init_pod.security_flags(),
            *init_pod.env_flags(),
            "--mount",
            f"type=volume,source={volume},target={mount['mountPath']}",
            "--entrypoint",
            command,
            WORKER_IMAGE,
            *rest,
            *init["args"],
            timeout=120,
        )
        written = docker(
            *("run", "--rm", "--network", "none", "--entrypoint", "sha256sum"),
            *("--mount", f"type=volume,source={volume},target=/m,readonly", WORKER_IMAGE),
            "/m/current/model.safetensors",
        )
        shipped = (SHIPPED_TINY_MODEL / "model.safetensors").read_bytes()
        assert written.split()[0] == hashlib.sha256(shipped).hexdigest()
        return volume

    def start_worker(self) -> str:
        pod = self.worker_pod
        name = f"relay-test-worker-{secrets.token_hex(4)}"
        self.names.append(name)
        (models,) = [m for m in pod.container["volumeMounts"] if m["name"] == "models"]
        filled = self.fill_models()
        docker(
            "run",
            "--detach",
            "--name",
            name,
            "--network",
            "host",
            *pod.security_flags(),
            # What the dev overlay's init container wrote there: the tiny model.
            "--mount",
            f"type=volume,source={filled},target={models['mountPath']},readonly",
            *pod.empty_dirs(skip={"models", "shm"}),
            *pod.env_flags(),
            WORKER_IMAGE,
            *pod.args(proxy=f"ws://127.0.0.1:{self.port}/ws/worker", max_concurrency="4"),
        )
        self.worker = name
        return name

    def status(self, path: str) -> int:
        return request("GET", f"{self.url}{path}", token=None)[0]

    def logs(self, name: str) -> str:
        result = subprocess.run(
            ["docker", "logs", name], capture_output=True, text=True, timeout=30, check=False
        )
        return result.stdout + result.stderr

    def running(self, name: str) -> bool:
        return docker("inspect", "--format", "{{.State.Running}}", name).strip() == "true"

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.running(self.proxy), self.logs(self.proxy)[-3000:]
            return self.status("/readyz") == 200

        wait_until("the proxy ready with a worker joined", ready, 180)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    base = build(REPO / "deploy" / "base")
    dev = build(OVERLAY)
    volume = f"relay-test-data-{secrets.token_hex(4)}"
    docker("volume", "create", volume)
    running = Stack(
        port=free_port(),
        volume=volume,
        proxy_pod=pod(PROXY, PROXY_CONTAINER, base),
        worker_pod=pod(WORKER, WORKER_CONTAINER, dev),
    )
    try:
        yield running
    finally:
        for name in running.names:
            docker("rm", "--force", name, check=False)
        for name in (volume, *running.volumes):
            docker("volume", "rm", "--force", name, check=False)


@pytest.fixture(scope="module")
def trial(stack: Stack) -> dict[str, Any]:
    """The proxy and a worker started; one trial registered."""
    stack.start_proxy()
    wait_until("the proxy's /healthz", lambda: stack.status("/healthz") == 200, 120)
    stack.start_worker()
    stack.wait_ready()
    status, body = request("POST", f"{stack.url}/sessions", {"metadata": {"task": "image"}})
    assert status == 201, body
    created: dict[str, Any] = json.loads(body)
    return created


def test_proxy_image_carries_no_torch() -> None:
    """The proxy's image has no torch (it tokenizes with `tokenizers`); the worker's has
    the CPU build."""
    find_torch = "import importlib.util as u; print(u.find_spec('torch') is not None)"
    proxy = docker("run", "--rm", "--entrypoint", "python", PROXY_IMAGE, "-c", find_torch)
    assert proxy.strip() == "False"
    check = "import torch; print(torch.__version__)"
    worker = docker("run", "--rm", "--entrypoint", "python", WORKER_IMAGE, "-c", check)
    assert worker.strip().endswith("+cpu")


def test_probes_and_healthcheck_answer(stack: Stack, trial: dict[str, Any]) -> None:
    """The manifests' probes answer (/healthz alive, /readyz ready with a worker); the
    image's HEALTHCHECK reports healthy; the proxy runs as uid 10001 and cannot write its
    root filesystem."""
    container = stack.proxy_pod.container
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert stack.status(container[probe]["httpGet"]["path"]) == 200, probe

    def healthy() -> bool:
        state = docker("inspect", "--format", "{{.State.Health.Status}}", stack.proxy)
        return state.strip() == "healthy"

    wait_until("docker's health status", healthy, 60)
    assert docker("exec", stack.proxy, "id", "-u").strip() == "10001"
    touched = subprocess.run(
        ["docker", "exec", stack.proxy, "touch", "/opt/venv/x"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert touched.returncode != 0


def test_tokens_are_required(stack: Stack, trial: dict[str, Any]) -> None:
    """The tokens from the environment are in force: the session API refuses a caller
    without the admin token."""
    assert request("GET", f"{stack.url}/sessions", token=None)[0] == 401
    assert request("GET", f"{stack.url}/sessions", token="wrong")[0] == 401
    assert request("GET", f"{stack.url}/sessions")[0] == 200


def test_trial_survives_stop_and_a_new_container(stack: Stack, trial: dict[str, Any]) -> None:
    """A trial's turns through the official openai client are exported; ``docker stop``
    drains the proxy and it exits 0; a new container on the same volume serves the
    session and its trajectories byte-identical, the worker rejoins by itself, and the
    agent's next turn continues the same trajectory."""
    tid = trial["trial_id"]
    agent = OpenAI(base_url=trial["base_url"], api_key=trial["api_key"], max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "list the files"}]
    first = agent.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=1)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "and now?"},
    ]
    stream = agent.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, seed=2, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]

    paths = (f"/sessions/{tid}", f"/sessions/{tid}/trajectories")
    before = {path: request("GET", f"{stack.url}{path}") for path in paths}
    assert all(status == 200 for status, _ in before.values())
    exported = json.loads(before[f"/sessions/{tid}/trajectories"][1])
    (trajectory,) = exported["trajectories"]
    assert [turn["turn"] for turn in trajectory["turns"]] == [0, 1]

    old = stack.proxy
    grace = stack.proxy_pod.spec["terminationGracePeriodSeconds"]
    docker("stop", "--time", str(grace), old, timeout=grace + 30)
    state = json.loads(docker("inspect", "--format", "{{json .State}}", old))
    logs = stack.logs(old)
    assert state["ExitCode"] == 0, logs[-3000:]
    assert not state["OOMKilled"]
    assert "draining" in logs
    assert "drained" in logs

    stack.start_proxy()
    stack.wait_ready()
    after = {path: request("GET", f"{stack.url}{path}") for path in paths}
    assert after == before

    agent = OpenAI(base_url=trial["base_url"], api_key=trial["api_key"], max_retries=0)
    third = agent.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=3)
    assert third.choices[0].message is not None
    status, body = request("GET", f"{stack.url}/sessions/{tid}/trajectories")
    assert status == 200
    (continued,) = json.loads(body)["trajectories"]
    assert [turn["turn"] for turn in continued["turns"]] == [0, 1, 2]
    assert continued["prompt_ids"] == trajectory["prompt_ids"]
    n = len(trajectory["response_ids"])
    assert continued["response_ids"][:n] == trajectory["response_ids"]
