"""From the kustomize tree under ``deploy/`` to the objects a cluster is given; no I/O beyond
reading those files.

``build`` implements the part of kustomize the tree uses (``resources``, ``namespace``,
``images``, ``replicas``, and RFC 6902 JSON ``patches`` with a kind/name ``target``) and
refuses any other field, so that ``kubectl apply -k`` and ``rollout-relay deploy`` never
disagree silently; tests compare the two where ``kubectl`` is installed. ``customize`` then
applies the ``rollout-relay deploy`` options.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

from deploy.exceptions import DeployError

__all__ = [
    "CONFIG_MAP",
    "PROXY",
    "PROXY_CONTAINER",
    "SERVICE",
    "TOKEN_SECRET",
    "WORKER",
    "WORKER_CONTAINER",
    "DeployOptions",
    "Endpoints",
    "apply_order",
    "build",
    "customize",
    "default_manifest_dir",
    "endpoints",
    "find",
    "namespace_of",
    "render",
    "token_secret",
]

Manifest = dict[str, Any]

# The objects the deploy options address (deploy/base).
PROXY = ("StatefulSet", "rollout-relay-proxy")
PROXY_CONTAINER = "proxy"
WORKER = ("Deployment", "rollout-relay-worker")
WORKER_CONTAINER = "worker"
CONFIG_MAP = ("ConfigMap", "rollout-relay-config")
SERVICE = ("Service", "rollout-relay")
TOKEN_SECRET = "rollout-relay-tokens"

_KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "replicas"}
_KUSTOMIZATION_FIELDS |= {"patches"}
_CLUSTER_SCOPED = {"Namespace"}
_SCALABLE = {"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"}
# Creation order: what others refer to first (kubectl apply and Helm order similarly).
_APPLY_ORDER = [
    "Namespace",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "PersistentVolumeClaim",
    "Service",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "StatefulSet",
    "Deployment",
]


def default_manifest_dir() -> Path:
    """The folder of this package, which holds the manifests (``base/``, ``overlays/``)."""
    return Path(__file__).resolve().parent


def _load_yaml(path: Path) -> list[Any]:
    try:
        return list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise DeployError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise DeployError(f"{path} is not valid YAML: {exc}") from None


def _load_documents(path: Path) -> list[Manifest]:
    documents = _load_yaml(path)
    objects: list[Manifest] = []
    for document in documents:
        if document is None:
            continue
        if not isinstance(document, dict) or "kind" not in document:
            raise DeployError(f"{path}: every document must be a Kubernetes object")
        objects.append(document)
    return objects


def _kustomization(directory: Path) -> Manifest:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise DeployError(f"{directory} has no kustomization.yaml")
    documents = _load_yaml(path)
    if len(documents) != 1 or not isinstance(documents[0], dict):
        raise DeployError(f"{path} must hold exactly one Kustomization")
    spec = documents[0]
    unknown = sorted(set(spec) - _KUSTOMIZATION_FIELDS)
    if unknown:
        raise DeployError(
            f"{path}: unsupported kustomization fields {', '.join(unknown)} "
            "(rollout-relay deploy renders resources, namespace, images, replicas and JSON "
            "patches; use `kubectl apply -k` for more)"
        )
    return spec


def build(directory: Path) -> list[Manifest]:
    """``kustomize build directory`` for the supported subset."""
    spec = _kustomization(directory)
    objects: list[Manifest] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objects.extend(build(path) if path.is_dir() else _load_documents(path))
    if "namespace" in spec:
        _set_namespace(objects, spec["namespace"])
    for patch in spec.get("patches", []):
        _apply_patch(directory, objects, patch)
    for replica in spec.get("replicas", []):
        scalable = [obj for obj in objects if obj["kind"] in _SCALABLE]
        for obj in _targets(scalable, None, replica["name"], directory):
            obj["spec"]["replicas"] = int(replica["count"])
    for image in spec.get("images", []):
        _set_image(objects, image)
    return objects


def _targets(
    objects: Iterable[Manifest], kind: str | None, name: str | None, where: Path
) -> list[Manifest]:
    found = [
        obj
        for obj in objects
        if (kind is None or obj["kind"] == kind)
        and (name is None or obj["metadata"]["name"] == name)
    ]
    if not found:
        raise DeployError(f"{where}: no {kind or 'object'} named {name} to change")
    return found


def _apply_patch(directory: Path, objects: list[Manifest], patch: Manifest) -> None:
    target = patch.get("target") or {}
    unsupported = sorted(set(target) - {"kind", "name"})
    if unsupported or not target:
        raise DeployError(f"{directory}: a patch needs a target of kind and name only")
    if "path" in patch:
        documents = _load_yaml(directory / patch["path"])
        operations = documents[0] if len(documents) == 1 else None
    else:
        try:
            operations = yaml.safe_load(patch.get("patch", ""))
        except yaml.YAMLError as exc:
            raise DeployError(f"{directory}: a patch is not valid YAML: {exc}") from None
    if not isinstance(operations, list):
        raise DeployError(
            f"{directory}: only JSON patches (RFC 6902, a list of operations) are supported"
        )
    for obj in _targets(objects, target.get("kind"), target.get("name"), directory):
        try:
            patched = jsonpatch.apply_patch(obj, operations)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise DeployError(
                f"{directory}: patch for {obj['kind']}/{obj['metadata']['name']} fails: {exc}"
            ) from None
        obj.clear()
        obj.update(patched)


def _set_namespace(objects: Iterable[Manifest], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] == "Namespace":
            obj["metadata"]["name"] = namespace
        elif obj["kind"] not in _CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _containers(obj: Manifest) -> Iterator[Manifest]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def _set_image(objects: Iterable[Manifest], image: Manifest) -> None:
    for obj in objects:
        for container in _containers(obj):
            name, tag, digest = _split_image(container["image"])
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            if "digest" in image:
                container["image"] = f"{name}@{image['digest']}"
                continue
            tag = str(image["newTag"]) if "newTag" in image else tag
            reference = name if tag is None else f"{name}:{tag}"
            container["image"] = reference if digest is None else f"{reference}@{digest}"


@dataclass(slots=True, frozen=True)
class DeployOptions:
    """What ``rollout-relay deploy`` may change on top of an overlay (None: as rendered)."""

    namespace: str | None = None
    image: str | None = None
    worker_image: str | None = None
    workers: int | None = None
    replicas: int | None = None  # proxy replicas
    model: str | None = None
    proxy_cpu: str | None = None
    proxy_memory: str | None = None
    storage: str | None = None
    worker_gpus: int | None = None


def find(objects: Iterable[Manifest], kind: str, name: str) -> Manifest:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise DeployError(f"the manifests have no {kind} {name}")


def _container(obj: Manifest, name: str) -> Manifest:
    for container in obj["spec"]["template"]["spec"]["containers"]:
        if container["name"] == name:
            return container  # type: ignore[no-any-return]
    raise DeployError(f"{obj['kind']} {obj['metadata']['name']} has no container {name}")


def customize(objects: list[Manifest], options: DeployOptions) -> list[Manifest]:
    """The rendered objects with ``options`` applied (a copy; ``objects`` is untouched)."""
    out = copy.deepcopy(objects)
    if options.namespace is not None:
        _set_namespace(out, options.namespace)
    proxy = find(out, *PROXY)
    worker = find(out, *WORKER)
    if options.image is not None:
        _container(proxy, PROXY_CONTAINER)["image"] = options.image
    if options.worker_image is not None:
        for container in _containers(worker):
            container["image"] = options.worker_image
    if options.workers is not None:
        worker["spec"]["replicas"] = options.workers
    if options.replicas is not None:
        proxy["spec"]["replicas"] = options.replicas
    # The replica list always follows the replica count and the namespace.
    find(out, *CONFIG_MAP)["data"]["RELAY_PEERS"] = proxy_peers(proxy)
    if options.model is not None:
        find(out, *CONFIG_MAP)["data"]["RELAY_MODEL"] = options.model
    resources = _container(proxy, PROXY_CONTAINER).setdefault("resources", {})
    for key, value in (("cpu", options.proxy_cpu), ("memory", options.proxy_memory)):
        if value is not None:
            # Requests equal to limits: the proxy is never throttled below what it asked for.
            resources.setdefault("requests", {})[key] = value
            resources.setdefault("limits", {})[key] = value
    if options.storage is not None:
        for claim in proxy["spec"].get("volumeClaimTemplates", []):
            claim["spec"]["resources"]["requests"]["storage"] = options.storage
    if options.worker_gpus is not None:
        limits = _container(worker, WORKER_CONTAINER).setdefault("resources", {})
        for section in ("requests", "limits"):
            bucket = limits.setdefault(section, {})
            if options.worker_gpus:
                bucket["nvidia.com/gpu"] = str(options.worker_gpus)
            else:
                bucket.pop("nvidia.com/gpu", None)
    return out


def proxy_peers(proxy: Manifest) -> str:
    """Every proxy replica's URL: pod N of the StatefulSet through its headless Service
    (what each pod's ``--public-url`` expands to)."""
    namespace = proxy["metadata"].get("namespace", "default")
    service = proxy["spec"]["serviceName"]
    port = next(
        p["containerPort"]
        for p in _container(proxy, PROXY_CONTAINER)["ports"]
        if p.get("name") == "http"
    )
    name = proxy["metadata"]["name"]
    return ",".join(
        f"http://{name}-{i}.{service}.{namespace}.svc:{port}"
        for i in range(int(proxy["spec"]["replicas"]))
    )


def render(directory: Path, options: DeployOptions = DeployOptions()) -> list[Manifest]:
    """An overlay (or the base) built and customized, in the order to apply it."""
    return apply_order(customize(build(directory), options))


def apply_order(objects: Iterable[Manifest]) -> list[Manifest]:
    rank = {kind: index for index, kind in enumerate(_APPLY_ORDER)}
    return sorted(objects, key=lambda obj: rank.get(obj["kind"], len(rank)))


def namespace_of(objects: Iterable[Manifest]) -> str:
    for obj in objects:
        if obj["kind"] == "Namespace":
            return str(obj["metadata"]["name"])
    raise DeployError("the manifests have no Namespace")


def token_secret(namespace: str, admin_token: str, worker_token: str) -> Manifest:
    """The Secret the proxy and workers read their tokens from (values never printed)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": TOKEN_SECRET,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "rollout-relay"},
        },
        "type": "Opaque",
        "stringData": {"admin-token": admin_token, "worker-token": worker_token},
    }


@dataclass(slots=True, frozen=True)
class Endpoints:
    """Where agents, the trainer and workers connect, inside the cluster."""

    agents: str
    sessions: str
    workers: str
    metrics: str


def endpoints(objects: list[Manifest]) -> Endpoints:
    service = find(objects, *SERVICE)
    namespace = service["metadata"].get("namespace", "default")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    host = f"{service['metadata']['name']}.{namespace}.svc:{port}"
    return Endpoints(
        agents=f"http://{host}/<trial_id>/v1",
        sessions=f"http://{host}/sessions",
        workers=f"ws://{host}/ws/worker",
        metrics=f"http://{host}/metrics",
    )
