"""The layering of the packages, read from their imports: the service and the worker client
stand on the relay alone, the SDK never reaches into the service, the relay imports no other
package of the project, and only the commands' package wires them together. The picture is
drawn in docs/architecture.md.

An import is any statement that imports (``import``, ``from ... import``) and any call
that imports a name written out in the source (``importlib.import_module("...")``,
``__import__("...")``, also an f-string whose package is written out); a name computed at
run time cannot be read here."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What each package may import of the project (besides itself). The commands' package
# (rollout_relay), the benchmark and the examples wire everything together and may import
# any of them.
EVERYTHING = frozenset({"relay", "proxy", "worker_client", "sdk", "deploy", "rollout_relay"})
MAY_IMPORT: dict[str, frozenset[str]] = {
    "relay": frozenset(),
    "proxy": frozenset({"relay"}),
    "worker_client": frozenset({"relay"}),
    "sdk": frozenset({"relay", "worker_client"}),
    "deploy": frozenset(),
    "rollout_relay": EVERYTHING,
    "bench": EVERYTHING,
    "examples": EVERYTHING,
}


def imported_modules(source: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import in ``source``: at the top, inside functions
    and under ``if TYPE_CHECKING``, since each of them is a dependency all the same; and of
    every call that imports a module named in the source (see the module docstring)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and _imports(node.func) and node.args:
            module = _written_name(node.args[0])
            if module:
                yield node.lineno, module


def _imports(func: ast.expr) -> bool:
    """Whether a call of ``func`` imports its first argument: ``importlib.import_module``
    (or ``import_module`` taken from importlib), ``__import__`` (or ``builtins.__import__``)."""
    if isinstance(func, ast.Name):
        return func.id in ("import_module", "__import__")
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return (func.value.id, func.attr) in (
            ("importlib", "import_module"),
            ("builtins", "__import__"),
        )
    return False


def _written_name(arg: ast.expr) -> str | None:
    """The absolute module name ``arg`` writes out, or as much of it as an f-string writes
    before its first placeholder (whole names only); None for a relative name or one
    computed at run time."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        name = arg.value
    elif (
        isinstance(arg, ast.JoinedStr)
        and arg.values
        and isinstance(head := arg.values[0], ast.Constant)
        and isinstance(head.value, str)
        and "." in head.value
    ):
        name = head.value.rpartition(".")[0]
    else:
        return None
    return None if not name or name.startswith(".") else name


def packages(root: Path) -> set[str]:
    """The top-level folders under ``root`` that Python can import from: those holding a
    ``.py`` file at any depth, with or without ``__init__.py`` (a folder without one is a
    namespace package all the same); hidden folders, the tests and what git ignores (a
    ``build/`` that ``pip wheel .`` leaves) aside."""
    return {
        path.name
        for path in root.iterdir()
        if path.is_dir()
        and not path.name.startswith(".")
        and path.name != "tests"
        and next(path.rglob("*.py"), None) is not None
        and not _ignored(root, path)
    }


def _ignored(root: Path, path: Path) -> bool:
    """Whether git ignores ``path`` (False where ``root`` is no git checkout)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "check-ignore", "-q", path.name],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except FileNotFoundError:  # no git here
        return False
    return done.returncode == 0


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
    """A new top-level package cannot escape the check: every folder at the top of the
    repository that holds Python (tests aside) is named in the rules."""
    assert packages(REPO) == set(MAY_IMPORT)


def test_a_folder_without_init_that_holds_python_is_a_package(tmp_path: Path) -> None:
    """A top-level folder with Python at any depth and no ``__init__.py`` is counted as a
    package; folders without Python, hidden ones and the tests are not."""
    for folder, name in [
        ("regular", "__init__.py"),
        ("scripts", "tool.py"),
        ("namespace/deeper", "mod.py"),
        ("docs", "guide.md"),
        (".venv/lib", "site.py"),
        ("tests", "test_x.py"),
    ]:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / name).write_text("")
    (tmp_path / "setup.py").write_text("")
    assert packages(tmp_path) == {"regular", "scripts", "namespace"}


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
        ("proxy", 'importlib.import_module("sdk.client")', "sdk.client"),
        ("relay", 'import_module("proxy.app")', "proxy.app"),
        ("worker_client", 'config = __import__("proxy.config")', "proxy.config"),
        ("sdk", 'builtins.__import__("rollout_relay")', "rollout_relay"),
        ("deploy", 'importlib.import_module(f"proxy.api.{name}")', "proxy.api"),
        ("rollout_relay", "import examples.image_turn", "examples.image_turn"),
    ],
)
def test_a_forbidden_import_is_reported(
    tmp_path: Path, package: str, line: str, module: str
) -> None:
    """The check can fail: each import the layering forbids is reported with its place, also
    when it hides inside a function or under TYPE_CHECKING, or is a call that imports a
    module named in the source."""
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
        "relay": 'importlib.import_module(".protocol", "relay")\n'
        "importlib.import_module(module)\n"
        'importlib.import_module(f"{base}.sampling_params")\n'
        'importlib.import_module("json")\n__import__("relay.protocol")',
    }
    for name in MAY_IMPORT:
        (tmp_path / name).mkdir()
        (tmp_path / name / "mod.py").write_text(allowed.get(name, ""))
    assert violations(tmp_path, MAY_IMPORT) == []
