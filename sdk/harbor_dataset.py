"""A directory of Harbor tasks as a training dataset verl reads (a Parquet file).

Each task directory (``task.toml`` + ``instruction.md``, found at any depth) becomes one
row in verl's RLHF dataset layout:

* ``prompt``: ``[{"role": "user", "content": <instruction>}]``: verl's dataset renders it
  for length filtering and hands it to the agent loop as ``raw_prompt``; the agent itself
  reads the task on the task server;
* ``agent_name``: ``remote_agent``, so verl routes the row to ``sdk.verl.RemoteAgentLoop``;
* ``data_source``: ``harbor``; ``reward_model``: ``{"style": "remote"}`` (the reward comes
  from the task's own tests);
* ``extra_info``: ``task_path`` (absolute), ``task_name``, ``index``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AGENT_NAME = "remote_agent"


@dataclass(slots=True, frozen=True)
class TaskRow:
    path: Path
    name: str
    instruction: str

    def as_row(self, index: int, agent_name: str = AGENT_NAME) -> dict[str, Any]:
        return {
            "data_source": "harbor",
            "agent_name": agent_name,
            "prompt": [{"role": "user", "content": self.instruction}],
            "reward_model": {"style": "remote", "ground_truth": ""},
            "extra_info": {"task_path": str(self.path), "task_name": self.name, "index": index},
        }


def find_tasks(root: str | Path) -> list[TaskRow]:
    """Every Harbor task under ``root``, sorted by path. Raises ``ValueError`` for a task
    whose ``task.toml`` does not parse or that has no ``instruction.md``."""
    tasks: list[TaskRow] = []
    for toml_path in sorted(Path(root).resolve().rglob("task.toml")):
        directory = toml_path.parent
        try:
            meta = tomllib.loads(toml_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"{toml_path}: not a readable task.toml: {exc}") from exc
        instruction = directory / "instruction.md"
        if not instruction.is_file():
            raise ValueError(f"{directory}: a Harbor task needs instruction.md")
        name = str(meta.get("task", {}).get("name") or meta.get("name") or directory.name)
        tasks.append(TaskRow(directory, name, instruction.read_text()))
    return tasks


def write_verl_dataset(
    root: str | Path, out: str | Path, *, agent_name: str = AGENT_NAME
) -> list[TaskRow]:
    """Write the tasks under ``root`` to the Parquet file ``out`` (needs ``pyarrow``)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise RuntimeError("writing a verl dataset needs pyarrow (it comes with verl)") from exc
    tasks = find_tasks(root)
    if not tasks:
        raise ValueError(f"no Harbor task (task.toml) under {root}")
    rows = [task.as_row(i, agent_name) for i, task in enumerate(tasks)]
    pq.write_table(pa.Table.from_pylist(rows), str(out))
    return tasks
