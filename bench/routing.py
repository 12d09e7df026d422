"""``python -m bench.routing``: what recording MoE routing (R3) costs, turn by turn.

One agent's conversation grows for ``--turns`` turns (Chat Completions, not streamed; each
turn adds a user message and a 16-token reply) through the real proxy (its own process,
durable, authenticated) and an ``instant`` worker standing in for a mixture-of-experts
engine shaped like Qwen3-30B-A3B (48 MoE layers, 8 of 128 experts per token: 384 bytes a
token's row). It runs no model: its routing rows are made up, of the real size. The same
conversation runs with a session that records routing (``routed_experts``) and one that
does not. For each turn: the proxy process's CPU time, and the routing bytes the worker
sent for it (each turn asks only for the rows past what its chain holds). At the end, the
routing bytes stored per token of the recording session.

The claim under test: a turn's cost with recording on does not grow with the history (the
engine is asked for the new rows only, and the proxy never re-reads the earlier ones).

python -m bench.routing --turns 100 --conversations 3 --out bench/ROUTING.md
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import statistics
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import wait_for_model
from bench.processes import ADMIN_TOKEN, Proc, Processes, wait_http
from bench.standalone import new_session, parser, publish

MODEL = "bench-moe"
# Qwen3-30B-A3B's routing shape (its config.json): 48 layers, all MoE, 8 of 128 experts.
SHAPE = {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8}


def moe_directory(out: Path) -> Path:
    """The tiny MoE's tokenizer and template with a config of the real model's shape (the
    instant backend reads only these files)."""
    from worker_client.tiny_moe import SHIPPED_TINY_MOE

    out.mkdir(parents=True, exist_ok=True)
    for source in SHIPPED_TINY_MOE.iterdir():
        if source.is_file() and not source.name.endswith(".safetensors"):
            shutil.copy(source, out / source.name)
    config = json.loads((out / "config.json").read_text())
    config.update(SHAPE)
    (out / "config.json").write_text(json.dumps(config))
    return out


async def conversation(
    http: aiohttp.ClientSession, proxy: Proc, turns: int, *, routing: bool
) -> tuple[str, list[dict[str, float]]]:
    """One conversation; its trial id and, per turn, the proxy's CPU milliseconds."""
    body: dict[str, Any] = {"routed_experts": True} if routing else {}
    session = await new_session(http, proxy, body)
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."}]
    rows: list[dict[str, float]] = []
    for turn in range(turns):
        text = f"step {turn}: the test output says " + " ".join(f"line{i}" for i in range(30))
        messages.append({"role": "user", "content": text})
        request = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 1.0}
        before = proxy.cpu_seconds()
        async with http.post(
            f"{session['base_url']}/chat/completions", json=request, headers=headers
        ) as response:
            reply = await response.json()
            if response.status != 200:
                raise RuntimeError(f"turn {turn}: {response.status} {reply}")
        rows.append({"cpu_ms": (proxy.cpu_seconds() - before) * 1e3})
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return session["trial_id"], rows


async def _turn_sizes(http: aiohttp.ClientSession, proxy: Proc, trial: str) -> list[int]:
    """Per turn, the positions whose rows it asked for: its context and sampled tokens
    (its chain held the rest)."""
    async with http.get(
        f"{proxy.url}/sessions/{trial}/trajectories",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as response:
        export = await response.json()
    (trajectory,) = export["trajectories"]
    ends = [t["prompt_tokens"] + t["completion_tokens"] for t in trajectory["turns"]]
    return [end - before for before, end in zip([1, *ends[:-1]], ends, strict=True)]


def _median_by_turn(runs: list[list[dict[str, float]]]) -> list[float]:
    return [statistics.median(run[t]["cpu_ms"] for run in runs) for t in range(len(runs[0]))]


def slope(values: list[float]) -> float:
    """Least-squares growth of ``values`` per turn."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    return cov / sum((x - mean_x) ** 2 for x in range(n))


async def measure(turns: int, conversations: int, log_dir: Path) -> dict[str, Any]:
    model_dir = moe_directory(log_dir / "model")
    row_bytes = SHAPE["num_hidden_layers"] * SHAPE["num_experts_per_tok"]  # uint8
    with Processes(log_dir) as procs:
        proxy = procs.proxy([])
        wait_http(proxy, "/healthz")
        procs.instant_worker(proxy, model_dir, reply_tokens=16, name=MODEL)
        await wait_for_model(proxy.url, MODEL)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await conversation(http, proxy, 5, routing=True)  # warm up
            off_runs, on_runs = [], []
            for _ in range(conversations):  # interleaved: the machine's drift hits both
                off_runs.append((await conversation(http, proxy, turns, routing=False))[1])
                trial, on = await conversation(http, proxy, turns, routing=True)
                on_runs.append(on)
            sizes = await _turn_sizes(http, proxy, trial)
    db = sqlite3.connect(log_dir / "data" / "relay.db")
    stored, tokens = db.execute(
        "SELECT SUM(LENGTH(routing)), SUM(LENGTH(context_ids) + LENGTH(completion_ids)) / 4 "
        "FROM turns WHERE trial_id = ?",
        (trial,),
    ).fetchone()
    db.close()
    return {
        "turns": turns,
        "row_bytes": row_bytes,
        "conversations": conversations,
        "cpu_ms_off": _median_by_turn(off_runs),
        "cpu_ms_on": _median_by_turn(on_runs),
        "bytes_moved": [n * row_bytes for n in sizes],
        "stored_bytes": stored,
        "stored_tokens": tokens,
    }


def report(results: dict[str, Any]) -> str:
    turns = results["turns"]
    edge = max(1, turns // 10)
    off, on, moved = results["cpu_ms_off"], results["cpu_ms_on"], results["bytes_moved"]

    def median(values: list[float], last: bool) -> float:
        return statistics.median(values[-edge:] if last else values[1 : 1 + edge])

    lines = [
        "# Recording MoE routing: proxy CPU and bytes per turn",
        "",
        f"`python -m bench.routing --turns {turns} --conversations {results['conversations']}`: "
        "conversations growing by a user message and a 16-token reply each turn, with routing "
        "recorded and without (median per turn); the proxy's own "
        f"process; routing rows of a Qwen3-30B-A3B shape ({results['row_bytes']} bytes a "
        "token), made up by the instant backend.",
        "",
        "| turns | CPU ms a turn, off | CPU ms a turn, on | routing KB moved a turn |",
        "|---|---:|---:|---:|",
        f"| 2-{1 + edge} | {median(off, False):.2f} | {median(on, False):.2f} "
        f"| {median([m / 1e3 for m in moved], False):.1f} |",
        f"| {turns - edge + 1}-{turns} | {median(off, True):.2f} | {median(on, True):.2f} "
        f"| {median([m / 1e3 for m in moved], True):.1f} |",
        "",
        f"Growth of the CPU per turn (least squares): {slope(off) * 100:+.2f} ms per 100 turns "
        f"off, {slope(on) * 100:+.2f} ms per 100 turns on.",
        "",
        f"Stored: {results['stored_bytes'] / max(results['stored_tokens'], 1):.0f} bytes of "
        f"routing per stored token ({results['stored_bytes'] / 1e6:.2f} MB for "
        f"{results['stored_tokens']} tokens). The worker sent {sum(moved) / 1e6:.2f} MB of "
        "routing over the conversation; asking for the whole prefix every turn would have "
        f"sent {sum(sum(moved[: i + 1]) for i in range(turns)) / 1e6:.1f} MB.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser("python -m bench.routing", __doc__ or "", turns=100).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as log_dir:
        results = asyncio.run(measure(args.turns, args.conversations, Path(log_dir)))
    publish(report(results), results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
