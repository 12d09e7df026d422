"""Talking to a cluster with the official Kubernetes client: server-side apply of rendered
objects, their status, their deletion. Every failure of the client (no kubeconfig, an
unreachable API server, a refusal) becomes a ``DeployError`` that says what happened."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from deploy.exceptions import DeployError
from deploy.render import (
    PROXY,
    TOKEN_SECRET,
    WORKER,
    Manifest,
    apply_order,
    namespace_of,
    token_secret,
)

__all__ = [
    "FIELD_MANAGER",
    "Cluster",
    "Status",
    "TokenPlan",
    "connect",
    "plan_tokens",
    "status_lines",
]

FIELD_MANAGER = "rollout-relay"


def connect(kubeconfig: Path | None = None, context: str | None = None) -> Cluster:
    """A client for the cluster of ``kubeconfig`` (default: $KUBECONFIG or ~/.kube/config)
    and ``context``, or of the pod this runs in."""
    configuration = client.Configuration()
    try:
        if kubeconfig is None and context is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=None if kubeconfig is None else str(kubeconfig),
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
    except (config.ConfigException, OSError, ValueError, TypeError) as exc:
        raise DeployError(
            f"no usable Kubernetes configuration ({exc}); set KUBECONFIG or pass "
            "--kubeconfig/--context"
        ) from None
    # Fail fast on an unreachable API server instead of urllib3's retries.
    configuration.retries = 0
    return Cluster(client.ApiClient(configuration))


def _api_message(exc: ApiException) -> str:
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")


@dataclass(slots=True, frozen=True)
class TokenPlan:
    """What to do with the token Secret: nothing (it exists and no tokens were given), or
    write it (``generated``: the tokens were made here, so say where to read them)."""

    secret: Manifest | None
    generated: bool


def plan_tokens(
    namespace: str, admin_token: str | None, worker_token: str | None, secret_exists: bool
) -> TokenPlan:
    if admin_token and worker_token:
        return TokenPlan(token_secret(namespace, admin_token, worker_token), generated=False)
    if admin_token or worker_token:
        raise DeployError("give both --admin-token and --worker-token, or neither")
    if secret_exists:
        return TokenPlan(None, generated=False)
    return TokenPlan(
        token_secret(namespace, secrets.token_urlsafe(32), secrets.token_urlsafe(32)),
        generated=True,
    )


@dataclass(slots=True, frozen=True)
class Status:
    """What the cluster says about one deployment (None: the object does not exist)."""

    namespace: str
    proxy: Manifest | None
    worker: Manifest | None
    claims: list[Manifest]
    secret_present: bool


def status_lines(status: Status) -> list[str]:
    """The status report, one line per part, from what the cluster returned."""
    lines = [f"namespace {status.namespace}"]
    if status.proxy is None:
        lines.append("proxy: not deployed")
    else:
        spec, state = status.proxy.get("spec", {}), status.proxy.get("status", {})
        ready = state.get("readyReplicas", 0)
        # The proxy's readiness is /readyz: a worker is connected and it is not draining.
        note = "serving, a worker connected" if ready else "not ready (no worker yet, or starting)"
        lines.append(f"proxy: {ready}/{spec.get('replicas', 1)} ready, {note}")
    if status.worker is None:
        lines.append("workers: not deployed")
    else:
        spec, state = status.worker.get("spec", {}), status.worker.get("status", {})
        lines.append(f"workers: {state.get('readyReplicas', 0)}/{spec.get('replicas', 0)} running")
    for claim in status.claims:
        phase = claim.get("status", {}).get("phase", "Unknown")
        size = claim.get("spec", {}).get("resources", {}).get("requests", {}).get("storage")
        lines.append(f"store volume {claim['metadata']['name']}: {phase}, {size}")
    if not status.claims and status.proxy is not None:
        lines.append("store volume: none yet")
    lines.append(
        f"token secret {TOKEN_SECRET}: " + ("present" if status.secret_present else "MISSING")
    )
    return lines


class Cluster:
    """One cluster, reached through ``api``."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self._dynamic: DynamicClient | None = None

    @property
    def host(self) -> str:
        return str(self.api.configuration.host)

    def _call(self, doing: str, action: Callable[[], Any], *, missing_ok: bool = False) -> Any:
        """``action()``, its client errors translated; None for a 404 when ``missing_ok``."""
        try:
            return action()
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            raise DeployError(f"the cluster refused to {doing}: {_api_message(exc)}") from None
        except urllib3.exceptions.HTTPError as exc:
            reason = getattr(exc, "reason", None) or exc
            raise DeployError(
                f"cannot reach the Kubernetes API at {self.host} ({reason})"
            ) from None
        except ResourceNotFoundError as exc:
            raise DeployError(
                f"the cluster does not serve what is needed to {doing}: {exc}"
            ) from None

    def _resource(self, api_version: str, kind: str) -> Any:
        if self._dynamic is None:
            self._dynamic = self._call("list its APIs", partial(DynamicClient, self.api))
        dynamic = self._dynamic
        return self._call(
            f"find {api_version} {kind}",
            lambda: dynamic.resources.get(api_version=api_version, kind=kind),
        )

    def _read(self, api_version: str, kind: str, name: str, namespace: str) -> Manifest | None:
        resource = self._resource(api_version, kind)
        found = self._call(
            f"read {kind} {name}",
            lambda: resource.get(name=name, namespace=namespace),
            missing_ok=True,
        )
        return None if found is None else dict(found.to_dict())

    def secret_exists(self, namespace: str) -> bool:
        return self._read("v1", "Secret", TOKEN_SECRET, namespace) is not None

    def apply(self, objects: Iterable[Manifest]) -> list[str]:
        """Server-side apply of every object, in creation order; what was applied."""
        applied = []
        for obj in apply_order(objects):
            resource = self._resource(obj["apiVersion"], obj["kind"])
            name = obj["metadata"]["name"]
            self._call(
                f"apply {obj['kind']} {name}",
                partial(
                    resource.server_side_apply,
                    body=obj,
                    name=name,
                    namespace=obj["metadata"].get("namespace"),
                    field_manager=FIELD_MANAGER,
                    force_conflicts=True,
                ),
            )
            applied.append(f"{obj['kind']}/{name}")
        return applied

    def status(self, objects: list[Manifest]) -> Status:
        namespace = namespace_of(objects)
        proxy = self._read("apps/v1", PROXY[0], PROXY[1], namespace)
        worker = self._read("apps/v1", WORKER[0], WORKER[1], namespace)
        claims: list[Manifest] = []
        for name in _claim_names(proxy):
            claim = self._read("v1", "PersistentVolumeClaim", name, namespace)
            if claim is not None:
                claims.append(claim)
        return Status(namespace, proxy, worker, claims, self.secret_exists(namespace))

    def delete(self, objects: list[Manifest], *, purge: bool) -> list[str]:
        """Delete the deployment, newest first. The store's volume, the token Secret and the
        Namespace stay unless ``purge``: a redeploy then finds every session again."""
        namespace = namespace_of(objects)
        doomed: list[tuple[str, str, str, str | None]] = [
            (obj["apiVersion"], obj["kind"], obj["metadata"]["name"], namespace)
            for obj in apply_order(objects)
            if obj["kind"] != "Namespace"
        ]
        doomed.reverse()
        if purge:
            proxy = self._read("apps/v1", PROXY[0], PROXY[1], namespace)
            doomed.extend(
                ("v1", "PersistentVolumeClaim", name, namespace) for name in _claim_names(proxy)
            )
            doomed.append(("v1", "Secret", TOKEN_SECRET, namespace))
            doomed.append(("v1", "Namespace", namespace, None))
        deleted = []
        for api_version, kind, name, where in doomed:
            resource = self._resource(api_version, kind)
            gone = self._call(
                f"delete {kind} {name}",
                partial(resource.delete, name=name, namespace=where),
                missing_ok=True,
            )
            if gone is not None:
                deleted.append(f"{kind}/{name}")
        return deleted


def _claim_names(proxy: Manifest | None) -> list[str]:
    """The proxy's store volumes: a StatefulSet names them <template>-<set>-<ordinal>."""
    if proxy is None:
        return []
    templates = proxy.get("spec", {}).get("volumeClaimTemplates", [])
    return [f"{template['metadata']['name']}-{PROXY[1]}-0" for template in templates]
