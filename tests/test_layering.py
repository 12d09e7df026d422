"""The layering of the packages, read from their imports: the service and the worker client
stand on the relay alone, the SDK never reaches into the service, the relay imports no other
package of the project, and only the commands' package wires them together. The picture is
drawn in docs/architecture.md."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What each package may import of the project (besides itself). The commands' package
# (rollout_relay) and the benchmark wire everything together and may import any of them.
EVERYTHING = frozenset({"relay", "proxy", "worker_client", "sdk", "deploy", "rollout_relay"})
MAY_IMPORT: dict[str, frozenset[str]] = {
    "relay": frozenset(),
    "proxy": frozenset({"relay"}),
    "worker_client": frozenset({"relay"}),
    "sdk": frozenset({"relay", "worker_client"}),
    "deploy": frozenset(),
    "rollout_relay": EVERYTHING,
    "bench": EVERYTHING,
}


def imported_modules(source: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import in ``source``: at the top, inside functions
    and under ``if TYPE_CHECKING``, since each of them is a dependency all the same."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def violations(root: Path, rules: dict[str, frozenset[str]]) -> list[str]:
    """``path:line: package imports module`` for every import that crosses a line the rules
    do not allow, under ``root``."""
    found = []
    for package, allowed in rules.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imported_modules(path.read_text(encoding="utf-8")):
                top = module.partition(".")[0]
                if top in rules and top != package and top not in allowed:
                    found.append(f"{path.relative_to(root)}:{line}: {package} imports {module}")
    return found


def test_the_packages_import_only_what_the_layering_allows() -> None:
    """No package of the project imports one its layer may not depend on."""
    assert violations(REPO, MAY_IMPORT) == []


def test_every_package_of_the_project_has_a_rule() -> None:
    """A new top-level package cannot escape the check: every folder with an
    ``__init__.py`` at the top of the repository (tests aside) is named in the rules."""
    packages = {
        path.parent.name
        for path in REPO.glob("*/__init__.py")
        if path.parent.name != "tests" and not path.parent.name.startswith(".")
    }
    assert packages == set(MAY_IMPORT)


@pytest.mark.parametrize(
    ("package", "line", "module"),
    [
        ("proxy", "from sdk.client import ProxyClient", "sdk.client"),
        ("proxy", "import worker_client.engine", "worker_client.engine"),
        ("proxy", "from rollout_relay.embedded import start_proxy", "rollout_relay.embedded"),
        ("proxy", "from deploy.render import render", "deploy.render"),
        ("worker_client", "from proxy.config import ProxyConfig", "proxy.config"),
        ("worker_client", "from sdk import samples", "sdk"),
        ("sdk", "from proxy.app import build_app", "proxy.app"),
        ("sdk", "import rollout_relay.cli as cli", "rollout_relay.cli"),
        ("relay", "from worker_client.engine import Engine", "worker_client.engine"),
        ("relay", "from proxy import exceptions", "proxy"),
        ("deploy", "from proxy.exceptions import ProxyError", "proxy.exceptions"),
    ],
)
def test_a_forbidden_import_is_reported(
    tmp_path: Path, package: str, line: str, module: str
) -> None:
    """The check can fail: each import the layering forbids is reported with its place, also
    when it hides inside a function or under TYPE_CHECKING."""
    for name in MAY_IMPORT:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / package / "top.py").write_text(f"{line}\n")
    (tmp_path / package / "nested.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        f"    {line}\n"
        "def late() -> None:\n"
        f"    {line}\n"
    )
    assert violations(tmp_path, MAY_IMPORT) == [
        f"{package}/nested.py:3: {package} imports {module}",
        f"{package}/nested.py:5: {package} imports {module}",
        f"{package}/top.py:1: {package} imports {module}",
    ]


def test_allowed_imports_are_not_reported(tmp_path: Path) -> None:
    """The service on the relay, the SDK on the worker client and the commands on everything
    are allowed, as are imports of a package's own modules and of other libraries."""
    allowed = {
        "proxy": "from relay import protocol\nfrom proxy.config import ProxyConfig\nimport aiohttp",
        "sdk": "from worker_client.client import WorkerClient\nfrom relay.protocol import Hello",
        "rollout_relay": "from proxy.app import build_app\nfrom sdk.client import ProxyClient\n"
        "from deploy.command import run_deploy\nfrom worker_client.fleet import WorkerFleet",
        "deploy": "import yaml\nfrom deploy.exceptions import DeployError",
    }
    for name in MAY_IMPORT:
        (tmp_path / name).mkdir()
        (tmp_path / name / "mod.py").write_text(allowed.get(name, ""))
    assert violations(tmp_path, MAY_IMPORT) == []
