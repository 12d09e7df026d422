"""The ``rollout-relay demo`` episode: a small tool-using agent driven through the official
``openai`` client against a trial's base URL, and a description of what a trainer gets.
(``rollout_relay.demo`` starts the proxy and the worker the episode runs against.)

The agent's tools run locally and are harmless: they read a scratch workspace and never
run a shell (the tiny model's output is random, so its commands are not trusted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from sdk.client import TrialSession

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a read-only command (ls, cat, wc, pwd, echo) in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


class Workspace:
    """A scratch directory with a few files, and tools that only read it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "README.md").write_text("# demo\nA tiny project.\n")
        (root / "main.py").write_text("print('hello')\n")

    def _inside(self, relative: str) -> Path | None:
        path = (self.root / relative).resolve()
        return path if path.is_relative_to(self.root.resolve()) else None

    def run(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments) if arguments else {}
        except ValueError:
            return "error: arguments are not valid JSON"
        if not isinstance(args, dict):
            return "error: arguments must be an object"
        if name == "read_file":
            path = self._inside(str(args.get("path", "")))
            if path is None or not path.is_file():
                return "error: no such file"
            return path.read_text()[:2000]
        if name == "bash":
            words = str(args.get("command", "")).split()
            if not words:
                return "error: empty command"
            if words[0] == "ls":
                return "\n".join(sorted(p.name for p in self.root.iterdir()))
            if words[0] == "pwd":
                return str(self.root)
            if words[0] == "echo":
                return " ".join(words[1:])
            if words[0] in {"cat", "wc"} and len(words) > 1:
                path = self._inside(words[-1])
                if path is None or not path.is_file():
                    return f"{words[0]}: {words[-1]}: No such file"
                text = path.read_text()
                return text if words[0] == "cat" else f"{len(text.splitlines())} {words[-1]}"
            return f"error: command not allowed: {words[0]}"
        return f"error: unknown tool {name!r}"


@dataclass(slots=True)
class Received:
    """What the agent got back for one call (to check against the recorded tokens)."""

    content: str
    tool_calls: list[tuple[str, str]]
    finish_reason: str


@dataclass(slots=True)
class EpisodeLog:
    received: list[Received] = field(default_factory=list)
    tool_runs: int = 0
    branches_made: list[str] = field(default_factory=list)


async def run_episode(
    trial: TrialSession,
    workspace: Workspace,
    *,
    turns: int = 6,
    seed: int = 1,
    max_tokens: int = 96,
) -> EpisodeLog:
    """A multi-turn tool-using episode that also rewrites its history once (a summary
    replaces the middle of the conversation) and resumes once from an older point."""
    client = AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
    log = EpisodeLog()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant with tools."},
        {"role": "user", "content": "Look at the workspace and tell me what main.py does."},
    ]
    snapshot: list[dict[str, Any]] | None = None
    try:
        for turn in range(turns):
            if turn == turns - 2 and snapshot is not None:
                # Resume from an older point: continue the conversation as it was after
                # the first reply, asking something else (like a retry or best-of-n).
                messages = [*snapshot, {"role": "user", "content": "Now list the files."}]
                log.branches_made.append("resumed_older_point")
            elif turn == turns - 3 and len(messages) > 4:
                # Rewrite history: replace the middle with a summary (context pruning).
                summary = "Summary so far: the workspace was inspected."
                messages = [messages[0], {"role": "user", "content": summary}]
                log.branches_made.append("history_rewritten")
            response = await client.chat.completions.create(
                model="tiny",
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                seed=seed + turn,
            )
            choice = response.choices[0]
            message = choice.message
            function_calls = [
                c
                for c in message.tool_calls or []
                if isinstance(c, ChatCompletionMessageFunctionToolCall)
            ]
            calls = [(c.function.name, c.function.arguments) for c in function_calls]
            log.received.append(Received(message.content or "", calls, choice.finish_reason))
            messages.append(message.model_dump(exclude_none=True))
            if snapshot is None:
                snapshot = list(messages)
            if function_calls:
                for call in function_calls:
                    log.tool_runs += 1
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            "content": workspace.run(call.function.name, call.function.arguments),
                        }
                    )
            else:
                messages.append({"role": "user", "content": "Thanks. Keep going."})
    finally:
        await client.close()
    return log


def describe(export: dict[str, Any]) -> str:
    """The session's trajectories in words a newcomer reads at a glance."""
    trajectories = export["trajectories"]
    turns = {t["turn"] for traj in trajectories for t in traj["turns"]}
    lines = [
        f"  the session is a tree of {len(turns)} turns; each root-to-leaf path is one "
        f"trajectory ({len(trajectories)}):"
    ]
    for i, traj in enumerate(trajectories, 1):
        mask = traj["response_mask"]
        sampled = sum(mask)
        lps = [lp for lp, m in zip(traj["response_logprobs"], mask, strict=True) if m]
        mean = sum(lps) / len(lps) if lps else float("nan")
        path = " -> ".join(t["branch_reason"] for t in traj["turns"])
        lines.append(
            f"    #{i}: {len(traj['turns'])} turn(s) [{path}]: prompt {len(traj['prompt_ids'])}"
            f" tokens, then {sampled} sampled (mask 1, mean logprob {mean:.2f}) and"
            f" {len(mask) - sampled} of context between turns (mask 0)"
        )
    return "\n".join(lines)
