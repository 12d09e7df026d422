"""``python -m bench.tree``: a session's tree packed into one sequence vs its trajectories
flat, on recorded episodes, with the tiny model's forward time for each.

python -m bench.tree                        # the demo's episode (seeds 1-3) and a longer one
python -m bench.tree --exports DIR          # also every export saved as DIR/*.json
python -m bench.tree --json /tmp/tree.json  # the figures as JSON too

Per episode: its trajectories; the tokens a trainer runs forward flat (every trajectory's
``prompt_ids + response_ids``), as the tree's nodes (``GET /sessions/<trial>/tree``: each
stored token once) and packed (``sdk.tree.pack_tree``: siblings' common context merged as
well); then the tiny model in float32 on one CPU thread: one forward of the packed tree
(4D mask; eager and sdpa attention) against one forward per trajectory and one padded
batch of them, the median of ``--reps``; and the largest gap between a token's logprob in
the packed forward and in its trajectory's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (turns, seed) of the demo's episodes: `rollout-relay demo`'s own (6 turns, seed 1) first.
DEMO_EPISODES = ((6, 1), (6, 2), (6, 3), (10, 1))


async def record_demo(model_dir: Path, episodes: tuple[tuple[int, int], ...]) -> list[Any]:
    """Run the demo's agent episode through a real proxy and ``hf`` worker on the tiny
    model for each (turns, seed); each as (name, tree, export)."""
    from proxy.config import ProxyConfig
    from rollout_relay.embedded import start_hf_worker, start_proxy
    from sdk.client import ProxyClient
    from sdk.demo import Workspace, run_episode

    recorded = []
    with tempfile.TemporaryDirectory() as cache:
        running = await start_proxy(ProxyConfig(port=0, cache_dir=Path(cache)))
        try:
            start_hf_worker(running, model_dir, worker_id="bench-tree")
            await running.wait_for_workers()
            async with ProxyClient(running.url) as proxy:
                for turns, seed in episodes:
                    trial = await proxy.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
                    with tempfile.TemporaryDirectory() as tmp:
                        await run_episode(trial, Workspace(Path(tmp)), turns=turns, seed=seed)
                    tree = await proxy.tree(trial.trial_id)
                    export = await proxy.trajectories(trial.trial_id)
                    recorded.append((f"demo, {turns} turns, seed {seed}", tree, export))
        finally:
            await running.stop()
    return recorded


def _median_seconds(run: Callable[[], object], reps: int) -> float:
    run()  # warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    model: Any, name: str, export: dict[str, Any], tree: dict[str, Any] | None, reps: int
) -> dict[str, Any]:
    """Token counts and forward times of one episode, packed and flat (the tree's nodes
    rebuilt from the export when there is no tree answer)."""
    import torch

    from sdk.tree import export_nodes, pack_tree, tree_nodes

    packed = pack_tree(tree if tree is not None else export)
    nodes = tree_nodes(tree) if tree is not None else export_nodes(export)
    flat = [t["prompt_ids"] + t["response_ids"] for t in export["trajectories"]]
    longest = max(len(ids) for ids in flat)
    batch = torch.tensor([ids + [0] * (longest - len(ids)) for ids in flat])
    padding = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in flat])
    inputs = packed.model_inputs()
    out: dict[str, Any] = {
        "episode": name,
        "trajectories": len(flat),
        "flat_tokens": sum(len(ids) for ids in flat),
        "node_tokens": sum(len(node.ids) for node in nodes),
        "tree_tokens": packed.tree_tokens,
    }
    out["node_ratio"] = out["node_tokens"] / out["flat_tokens"]
    out["tree_ratio"] = out["tree_tokens"] / out["flat_tokens"]
    with torch.no_grad():
        for attention in ("eager", "sdpa"):
            model.set_attn_implementation(attention)
            out[f"packed_ms_{attention}"] = 1e3 * _median_seconds(
                lambda: model(**inputs, use_cache=False), reps
            )
            out[f"flat_ms_{attention}"] = 1e3 * _median_seconds(
                lambda: [model(input_ids=torch.tensor([ids]), use_cache=False) for ids in flat],
                reps,
            )
            out[f"batch_ms_{attention}"] = 1e3 * _median_seconds(
                lambda: model(input_ids=batch, attention_mask=padding, use_cache=False), reps
            )
        scores = packed.token_logprobs(model(**inputs, use_cache=False).logits)
        gap = 0.0
        for tokens, ids in zip(packed.paths, flat, strict=True):
            alone = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            expected = alone[:-1].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            gap = max(gap, float((scores[tokens[1:]] - expected).abs().max()))
    out["max_logprob_gap"] = gap
    return out


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| episode | trajectories | flat tokens | nodes (÷ flat) | packed (÷ flat) "
        "| forward packed / per trajectory / padded batch, eager (ms) | same, sdpa (ms) "
        "| largest gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['episode']} | {r['trajectories']} | {r['flat_tokens']} "
            f"| {r['node_tokens']} ({r['node_ratio']:.2f}) | {r['tree_tokens']} "
            f"({r['tree_ratio']:.2f}) "
            f"| {r['packed_ms_eager']:.1f} / {r['flat_ms_eager']:.1f} / {r['batch_ms_eager']:.1f} "
            f"| {r['packed_ms_sdpa']:.1f} / {r['flat_ms_sdpa']:.1f} / {r['batch_ms_sdpa']:.1f} "
            f"| {r['max_logprob_gap']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tree", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", type=Path, default=None, help="the tiny model's folder")
    parser.add_argument("--exports", type=Path, default=None, help="a folder of saved exports")
    parser.add_argument("--reps", type=int, default=20, help="forwards per timing (median)")
    parser.add_argument("--no-demo", action="store_true", help="only the saved exports")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from rollout_relay.cli import ensure_tiny_model

    model_dir = ensure_tiny_model(args.model)
    episodes: list[Any] = [] if args.no_demo else asyncio.run(record_demo(model_dir, DEMO_EPISODES))
    for path in sorted(args.exports.glob("*.json")) if args.exports else []:
        export = json.loads(path.read_text())
        episodes.append((path.stem, None, export))
    torch.set_num_threads(1)  # steadier on a shared machine; the ratio of times is the point
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    rows = [measure(model, name, export, tree, args.reps) for name, tree, export in episodes]
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
