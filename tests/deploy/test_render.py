"""Rendering the kustomize tree and applying the deploy options, without a cluster."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from deploy.exceptions import DeployError
from deploy.render import (
    CONFIG_MAP,
    PROXY,
    WORKER,
    DeployOptions,
    build,
    customize,
    default_manifest_dir,
    endpoints,
    find,
    namespace_of,
    render,
    token_secret,
)

DEPLOY = default_manifest_dir()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: app}
spec:
  replicas: 1
  template:
    spec:
      initContainers: [{name: init, image: "reg.io:5000/team/app:1.0"}]
      containers:
        - {name: main, image: app}
        - {name: side, image: "other@sha256:abc"}
"""


def test_default_manifest_dir_is_the_checkouts_deploy_tree() -> None:
    """Without --manifests the CLI renders the deploy/ beside these sources."""
    assert (DEPLOY / "base" / "kustomization.yaml").is_file()


def test_images_namespace_replicas_and_patches(tmp_path: Path) -> None:
    """Kustomize's image, namespace, replica and JSON-patch rules, applied in its order."""
    write(tmp_path / "app.yaml", DEPLOYMENT)
    write(tmp_path / "ns.yaml", "apiVersion: v1\nkind: Namespace\nmetadata: {name: old}\n")
    write(
        tmp_path / "kustomization.yaml",
        """\
resources: [ns.yaml, app.yaml]
namespace: new
images:
  - {name: reg.io:5000/team/app, newTag: "2.0"}
  - {name: app, newName: mirror/app, digest: "sha256:def"}
  - {name: other, newTag: v3}
replicas: [{name: app, count: 3}]
patches:
  - target: {kind: Deployment, name: app}
    patch: |
      - {op: add, path: /metadata/labels, value: {tier: x}}
""",
    )
    objects = build(tmp_path)
    namespace, app = objects
    assert namespace["metadata"]["name"] == "new"
    assert "namespace" not in namespace["metadata"]
    assert app["metadata"] == {"name": "app", "namespace": "new", "labels": {"tier": "x"}}
    assert app["spec"]["replicas"] == 3
    pod = app["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["image"] == "reg.io:5000/team/app:2.0"
    assert pod["containers"][0]["image"] == "mirror/app@sha256:def"
    assert pod["containers"][1]["image"] == "other:v3@sha256:abc"


@pytest.mark.parametrize(
    ("kustomization", "message"),
    [
        ("resources: [app.yaml]\ncommonLabels: {a: b}\n", "unsupported kustomization fields"),
        ("resources: [missing.yaml]\n", "cannot read"),
        (
            "resources: [app.yaml]\npatches: [{target: {kind: Deployment, name: nope}, patch: '[]'}]\n",
            "no Deployment named nope",
        ),
        (
            "resources: [app.yaml]\npatches:\n  - target: {kind: Deployment, name: app}\n"
            "    patch: '[{op: replace, path: /spec/nothing/here, value: 1}]'\n",
            "patch for Deployment/app fails",
        ),
        (
            "resources: [app.yaml]\npatches:\n  - target: {kind: Deployment, name: app}\n"
            "    patch: 'spec: {replicas: 2}'\n",
            "only JSON patches",
        ),
        ("resources: [app.yaml]\npatches: [{patch: '[]'}]\n", "needs a target"),
        ("resources: [bad.yaml]\n", "not valid YAML"),
        ("resources: [list.yaml]\n", "must be a Kubernetes object"),
    ],
)
def test_unsupported_or_broken_input_is_refused(
    tmp_path: Path, kustomization: str, message: str
) -> None:
    """What the renderer cannot do exactly as kustomize would is an error, never a guess."""
    write(tmp_path / "app.yaml", DEPLOYMENT)
    write(tmp_path / "bad.yaml", "a: [\n")
    write(tmp_path / "list.yaml", "- 1\n- 2\n")
    write(tmp_path / "kustomization.yaml", kustomization)
    with pytest.raises(DeployError, match=re.escape(message)):
        build(tmp_path)


def test_a_directory_without_kustomization_is_refused(tmp_path: Path) -> None:
    """An overlay path that is not a kustomization says so."""
    with pytest.raises(DeployError, match=r"has no kustomization\.yaml"):
        build(tmp_path)


def test_options_change_only_what_they_name() -> None:
    """Every deploy option lands where the manifests read it; nothing else moves."""
    plain = build(DEPLOY / "overlays" / "prod")
    options = DeployOptions(
        namespace="rl-team",
        image="reg/proxy:9",
        worker_image="reg/vllm:9",
        workers=3,
        model="org/model",
        proxy_cpu="6",
        proxy_memory="12Gi",
        storage="500Gi",
        worker_gpus=2,
    )
    changed = customize(plain, options)
    assert plain == build(DEPLOY / "overlays" / "prod"), "customize must not touch its input"
    assert namespace_of(changed) == "rl-team"
    assert {o["metadata"].get("namespace", "rl-team") for o in changed} == {"rl-team"}
    proxy = find(changed, *PROXY)
    container = proxy["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/proxy:9"
    assert container["resources"] == {
        "requests": {"cpu": "6", "memory": "12Gi"},
        "limits": {"cpu": "6", "memory": "12Gi"},
    }
    assert proxy["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"] == {
        "storage": "500Gi"
    }
    worker = find(changed, *WORKER)
    pod = worker["spec"]["template"]["spec"]
    assert worker["spec"]["replicas"] == 3
    assert {c["image"] for c in pod["initContainers"] + pod["containers"]} == {"reg/vllm:9"}
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert find(changed, *CONFIG_MAP)["data"]["RELAY_MODEL"] == "org/model"


def test_zero_gpus_makes_cpu_workers() -> None:
    """--worker-gpus 0 drops the GPU request and limit."""
    worker = find(render(DEPLOY / "base", DeployOptions(worker_gpus=0)), *WORKER)
    resources = worker["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources["requests"]
    assert "nvidia.com/gpu" not in resources["limits"]


def test_render_orders_objects_for_creation() -> None:
    """The Namespace comes first, what pods need before the pods."""
    kinds = [o["kind"] for o in render(DEPLOY / "overlays" / "dev")]
    assert kinds[0] == "Namespace"
    assert kinds.index("ConfigMap") < kinds.index("StatefulSet")
    assert kinds.index("Service") < kinds.index("StatefulSet") < kinds.index("Deployment")


def test_manifests_missing_a_known_object_are_refused(tmp_path: Path) -> None:
    """Options need the proxy StatefulSet and the worker Deployment; without them, a clear
    error."""
    write(tmp_path / "app.yaml", DEPLOYMENT)
    write(tmp_path / "kustomization.yaml", "resources: [app.yaml]\n")
    with pytest.raises(DeployError, match="no StatefulSet rollout-relay-proxy"):
        render(tmp_path)


def test_endpoints_follow_the_service_and_namespace() -> None:
    """Where agents, the trainer and workers connect, from the rendered Service."""
    where = endpoints(render(DEPLOY / "base", DeployOptions(namespace="rl")))
    assert where.agents == "http://rollout-relay.rl.svc:8080/<trial_id>/v1"
    assert where.sessions == "http://rollout-relay.rl.svc:8080/sessions"
    assert where.workers == "ws://rollout-relay.rl.svc:8080/ws/worker"


def test_token_secret_carries_both_keys_the_pods_read() -> None:
    """The Secret has exactly the keys the manifests reference."""
    secret = token_secret("rl", "a" * 8, "w" * 8)
    assert secret["metadata"] == {
        "name": "rollout-relay-tokens",
        "namespace": "rl",
        "labels": {"app.kubernetes.io/part-of": "rollout-relay"},
    }
    assert secret["stringData"] == {"admin-token": "a" * 8, "worker-token": "w" * 8}


def test_a_copied_tree_renders_the_same(tmp_path: Path) -> None:
    """--manifests may point at a copy of deploy/ anywhere."""
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    assert render(tmp_path / "deploy" / "overlays" / "prod") == render(DEPLOY / "overlays" / "prod")
