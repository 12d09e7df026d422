"""Harbor-format tasks on disk, and the archives they travel in.

A task is a directory::

    task.toml          [agent] timeout_sec, [verifier] timeout_sec, [metadata] ...
    instruction.md     what the agent is asked to do
    tests/test.sh      the verifier: writes /logs/verifier/reward.txt (one float) or
                       /logs/verifier/reward.json ({name: float})
    environment/       the container's build context (Dockerfile and the files it copies)
    solution/solve.sh  optional: the reference solution (Harbor's ``oracle`` agent runs it)

The run-submission API ships a task as a gzipped tar of that directory's contents.
"""

from __future__ import annotations

import io
import json
import math
import os
import tarfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdk.exceptions import TaskDefinitionError

DEFAULT_AGENT_TIMEOUT_SECONDS = 600.0
DEFAULT_VERIFIER_TIMEOUT_SECONDS = 600.0


@dataclass(slots=True, frozen=True)
class HarborTask:
    """A validated task directory."""

    path: Path
    name: str
    instruction: str
    agent_timeout_seconds: float
    verifier_timeout_seconds: float
    metadata: Mapping[str, Any] = field(default_factory=dict)
    workdir: str | None = None  # the Dockerfile's last WORKDIR (e.g. "/app"), if any

    @property
    def test_script(self) -> Path:
        return self.path / "tests" / "test.sh"

    @property
    def solution_script(self) -> Path | None:
        script = self.path / "solution" / "solve.sh"
        return script if script.is_file() else None

    @property
    def environment_dir(self) -> Path | None:
        env = self.path / "environment"
        return env if env.is_dir() else None


def _timeout(table: Any, section: str, default: float) -> float:
    if table is None:
        return default
    if not isinstance(table, dict):
        raise TaskDefinitionError(f"task.toml: [{section}] must be a table")
    value = table.get("timeout_sec", default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise TaskDefinitionError(f"task.toml: [{section}] timeout_sec must be a positive number")
    if not math.isfinite(value):
        raise TaskDefinitionError(f"task.toml: [{section}] timeout_sec must be finite")
    return float(value)


def _dockerfile_workdir(environment: Path) -> str | None:
    dockerfile = environment / "Dockerfile"
    if not dockerfile.is_file():
        return None
    workdir = None
    for line in dockerfile.read_text(errors="replace").splitlines():
        words = line.strip().split(maxsplit=1)
        if len(words) == 2 and words[0].upper() == "WORKDIR" and words[1].startswith("/"):
            workdir = words[1].strip().strip("\"'").rstrip("/") or None
    return workdir


def load_task(path: Path) -> HarborTask:
    """Read and validate a Harbor task directory; ``TaskDefinitionError`` says what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise TaskDefinitionError(f"{path}: not a task directory")
    toml_path = path / "task.toml"
    if not toml_path.is_file():
        raise TaskDefinitionError(f"{path.name}: task.toml is missing")
    try:
        config = tomllib.loads(toml_path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskDefinitionError(f"{path.name}: task.toml is not valid TOML: {exc}") from None
    instruction_path = path / "instruction.md"
    if not instruction_path.is_file():
        raise TaskDefinitionError(f"{path.name}: instruction.md is missing")
    if not (path / "tests" / "test.sh").is_file():
        raise TaskDefinitionError(f"{path.name}: tests/test.sh is missing")
    metadata = config.get("metadata", {})
    if not isinstance(metadata, dict):
        raise TaskDefinitionError(f"{path.name}: task.toml: [metadata] must be a table")
    environment = path / "environment"
    return HarborTask(
        path=path,
        name=str(config.get("name") or path.name),
        instruction=instruction_path.read_text(errors="replace"),
        agent_timeout_seconds=_timeout(config.get("agent"), "agent", DEFAULT_AGENT_TIMEOUT_SECONDS),
        verifier_timeout_seconds=_timeout(
            config.get("verifier"), "verifier", DEFAULT_VERIFIER_TIMEOUT_SECONDS
        ),
        metadata=metadata,
        workdir=_dockerfile_workdir(environment) if environment.is_dir() else None,
    )


def pack_task(path: Path) -> bytes:
    """The task directory as a gzipped tar (paths relative to the task root)."""
    task = load_task(path)  # refuse to ship something the server would reject
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        for entry in sorted(task.path.iterdir()):
            archive.add(entry, arcname=entry.name)
    return buffer.getvalue()


def unpack_task(archive: bytes, into: Path, *, max_unpacked_bytes: int) -> HarborTask:
    """Extract a task archive into ``into`` and validate it.

    Uses tarfile's ``data`` filter (PEP 706): absolute paths, ``..``, links leaving the
    directory and device files are refused."""
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:*") as tar:
            members = tar.getmembers()
            total = sum(member.size for member in members if member.isfile())
            if total > max_unpacked_bytes:
                raise TaskDefinitionError(
                    f"task archive unpacks to {total} bytes, over the limit of {max_unpacked_bytes}"
                )
            into.mkdir(parents=True, exist_ok=True)
            tar.extractall(into, members=members, filter="data")
    except TaskDefinitionError:
        raise
    except tarfile.FilterError as exc:
        raise TaskDefinitionError(f"task archive refused: {exc}") from None
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise TaskDefinitionError(f"task archive is not a readable tar(.gz): {exc}") from None
    # An archive of one top-level folder (``tar czf t.tgz mytask``) is accepted too.
    entries = [entry for entry in into.iterdir() if not entry.name.startswith(".")]
    root = into
    if len(entries) == 1 and entries[0].is_dir() and not (into / "task.toml").exists():
        root = entries[0]
    return load_task(root)


def read_rewards(verifier_dir: Path) -> dict[str, float] | None:
    """The verifier's rewards: ``reward.json`` ({name: number}) wins over ``reward.txt``
    (one number, named "reward"). None when neither exists; ``TaskDefinitionError`` when
    one exists but is malformed."""
    json_path = verifier_dir / "reward.json"
    text_path = verifier_dir / "reward.txt"
    if json_path.is_file():
        try:
            data = json.loads(json_path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise TaskDefinitionError(f"reward.json is not JSON: {exc}") from None
        if isinstance(data, bool) or not isinstance(data, dict | int | float):
            raise TaskDefinitionError("reward.json must be an object of numbers")
        if not isinstance(data, dict):
            data = {"reward": data}
        rewards: dict[str, float] = {}
        for name, value in data.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TaskDefinitionError(f"reward.json: {name!r} is not a number")
            if not math.isfinite(value):
                raise TaskDefinitionError(f"reward.json: {name!r} is not finite")
            rewards[str(name)] = float(value)
        return rewards
    if text_path.is_file():
        text = text_path.read_text(errors="replace").strip()
        try:
            value = float(text)
        except ValueError:
            raise TaskDefinitionError(f"reward.txt is not a number: {text[:80]!r}") from None
        if not math.isfinite(value):
            raise TaskDefinitionError("reward.txt is not finite")
        return {"reward": value}
    return None


def tree_size(path: Path) -> int:
    """Bytes of regular files under ``path`` (symlinks not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = Path(root) / name
            if full.is_file() and not full.is_symlink():
                total += full.stat().st_size
    return total
