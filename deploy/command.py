"""``rollout-relay deploy render|apply|status|delete``: the arguments and what each does.

Imports of the Kubernetes client, PyYAML and jsonpatch (the ``deploy`` extra) wait until a
deploy command runs, so the proxy and worker never need them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.render import DeployOptions, Manifest

__all__ = ["add_deploy_parser", "at_least_one_arg", "count_arg", "run_deploy"]

_ACTIONS = {
    "render": "print the manifests as YAML (e.g. for `kubectl apply -f -`)",
    "apply": "create or update the deployment (server-side apply) and its token Secret",
    "status": "show the proxy, workers, store volume and token Secret",
    "delete": "remove the deployment (the store volume and tokens stay unless --purge)",
}


def _quantity(text: str) -> str:
    from kubernetes.utils.quantity import parse_quantity

    try:
        parse_quantity(text)  # type: ignore[no-untyped-call]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Kubernetes quantity (e.g. 500m, 4, 8Gi)"
        ) from None
    return text


def count_arg(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (0 or more)")
    return value


def at_least_one_arg(what: str) -> Callable[[str], int]:
    """An argparse type: a count of ``what`` that must be 1 or more."""

    def parse(text: str) -> int:
        value = count_arg(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: at least one {what}")
        return value

    return parse


def add_deploy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    deploy = sub.add_parser("deploy", help="deploy the proxy and workers to Kubernetes")
    actions = deploy.add_subparsers(dest="deploy_action", required=True)
    for action, text in _ACTIONS.items():
        a = actions.add_parser(action, help=text, description=text)
        a.add_argument(
            "--overlay",
            default="prod",
            help="an overlay under the manifests' overlays/ (dev, prod), base, or a"
            " kustomization directory (default: prod)",
        )
        a.add_argument(
            "--manifests",
            type=Path,
            default=None,
            help="the deploy/ directory (default: the one beside these sources)",
        )
        a.add_argument("--namespace", default=None, help="instead of the overlay's namespace")
        a.add_argument("--image", default=None, help="the proxy's image")
        a.add_argument("--worker-image", default=None, help="the workers' image")
        a.add_argument("--workers", type=count_arg, default=None, help="worker replicas")
        a.add_argument(
            "--replicas",
            type=at_least_one_arg("replica"),
            default=None,
            help="proxy replicas (each owns a share of the trials, with its own store)",
        )
        a.add_argument("--model", default=None, help="the model workers serve (a hub id)")
        a.add_argument("--proxy-cpu", type=_quantity, default=None, help="e.g. 4")
        a.add_argument("--proxy-memory", type=_quantity, default=None, help="e.g. 8Gi")
        a.add_argument("--storage", type=_quantity, default=None, help="store volume size")
        a.add_argument(
            "--worker-gpus", type=count_arg, default=None, help="GPUs per worker (0: CPU workers)"
        )
        if action == "render":
            continue
        a.add_argument("--kubeconfig", type=Path, default=None, help="default: $KUBECONFIG")
        a.add_argument("--context", default=None, help="kubeconfig context")
        if action == "apply":
            a.add_argument(
                "--admin-token",
                default=os.environ.get("RELAY_ADMIN_TOKEN"),
                help="writes the token Secret (env RELAY_ADMIN_TOKEN); without tokens an"
                " existing Secret is kept, or new tokens are generated",
            )
            a.add_argument(
                "--worker-token",
                default=os.environ.get("RELAY_WORKER_TOKEN"),
                help="env RELAY_WORKER_TOKEN",
            )
        if action == "delete":
            a.add_argument(
                "--purge",
                action="store_true",
                help="also delete the store volume (every session), the tokens and the namespace",
            )


def _options(args: argparse.Namespace) -> DeployOptions:
    from deploy.render import DeployOptions

    return DeployOptions(
        namespace=args.namespace,
        image=args.image,
        worker_image=args.worker_image,
        workers=args.workers,
        replicas=args.replicas,
        model=args.model,
        proxy_cpu=args.proxy_cpu,
        proxy_memory=args.proxy_memory,
        storage=args.storage,
        worker_gpus=args.worker_gpus,
    )


def _overlay_dir(args: argparse.Namespace) -> Path:
    from deploy.exceptions import DeployError
    from deploy.render import default_manifest_dir

    manifests = args.manifests or default_manifest_dir()
    named = manifests / "overlays" / args.overlay
    for candidate in (named, manifests / args.overlay, Path(args.overlay)):
        if (candidate / "kustomization.yaml").is_file():
            return candidate
    raise DeployError(
        f"no overlay {args.overlay!r}: neither {named} nor {args.overlay} holds a "
        "kustomization.yaml (pass --manifests with the deploy/ directory of a checkout)"
    )


def _connection_lines(objects: list[Manifest]) -> list[str]:
    from deploy.render import SERVICE, endpoints, namespace_of

    where = endpoints(objects)
    namespace = namespace_of(objects)
    return [
        f"agents connect to   {where.agents}",
        f"trials registered   POST {where.sessions}  (Authorization: Bearer <admin token>)",
        f"workers connect to  {where.workers}  (with the worker token)",
        f"metrics             {where.metrics}",
        f"from outside: kubectl -n {namespace} port-forward svc/{SERVICE[1]} 8080:8080",
    ]


def _apply(args: argparse.Namespace, objects: list[Manifest]) -> None:
    from deploy.kube import connect, plan_tokens
    from deploy.render import TOKEN_SECRET, namespace_of

    namespace = namespace_of(objects)
    cluster = connect(args.kubeconfig, args.context)
    tokens = plan_tokens(
        namespace,
        args.admin_token,
        args.worker_token,
        secret_exists=not (args.admin_token or args.worker_token)
        and cluster.secret_exists(namespace),
    )
    secret = [] if tokens.secret is None else [tokens.secret]
    for applied in cluster.apply([*objects, *secret]):
        print(f"applied {applied}")
    if tokens.generated:
        print(
            f"generated new tokens in Secret {TOKEN_SECRET}; read the admin token with\n"
            f"  kubectl -n {namespace} get secret {TOKEN_SECRET} "
            "-o jsonpath='{.data.admin-token}' | base64 -d"
        )
    elif tokens.secret is None:
        print(f"kept the tokens in Secret {TOKEN_SECRET}")
    for line in _connection_lines(objects):
        print(line)


def run_deploy(args: argparse.Namespace) -> int:
    """Run one deploy action; 2 (after saying why on stderr) when it cannot."""
    try:
        import yaml

        from deploy.kube import connect, status_lines
        from deploy.render import render
    except ImportError as exc:
        print(
            f"rollout-relay deploy needs the deploy extra ({exc.name} is missing): "
            "pip install 'rollout-relay[deploy]'",
            file=sys.stderr,
        )
        return 2
    from deploy.exceptions import DeployError

    try:
        objects = render(_overlay_dir(args), _options(args))
        if args.deploy_action == "render":
            sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
        elif args.deploy_action == "apply":
            _apply(args, objects)
        elif args.deploy_action == "status":
            for line in status_lines(connect(args.kubeconfig, args.context).status(objects)):
                print(line)
            for line in _connection_lines(objects):
                print(line)
        else:
            cluster = connect(args.kubeconfig, args.context)
            for deleted in cluster.delete(objects, purge=args.purge):
                print(f"deleted {deleted}")
    except DeployError as exc:
        print(f"rollout-relay deploy: {exc.message}", file=sys.stderr)
        return 2
    return 0
