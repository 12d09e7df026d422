"""``python -m bench.train_memory``: does a long ``make train`` run stay flat in memory?

Runs ``rollout-relay train``'s loop (the proxy, an ``hf`` worker on the tiny model and
TRL's GRPOTrainer, all in this process, as ``make train`` runs them) for ``--steps``
steps and records the process's resident memory (RSS) after every step's rollout. It
reports the slope of RSS over the steps after the first ``--warmup`` (a least-squares
line: what each step adds for good) and the growth from the first ten steps after the
warm-up to the last ten (medians: one step's allocator spike is not growth). Not part of ``python -m bench``'s default sections: it takes minutes.

python -m bench.train_memory --steps 150 --json /tmp/rss.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(slots=True, frozen=True)
class MemoryFigures:
    steps: int
    warmup: int
    rss_mb: list[float]  # after each step's rollout
    slope_kb_per_step: float  # after the warm-up
    growth_mb: float  # median of the last 10 steps minus that of the first 10 after warm-up
    seconds: float


def figures(rss_mb: list[float], warmup: int, seconds: float) -> MemoryFigures:
    """The slope (least squares, KB per step) and the growth after the warm-up."""
    tail = rss_mb[warmup:]
    if len(tail) < 2:
        raise ValueError("need at least two steps after the warm-up")
    slope, _ = statistics.linear_regression(range(len(tail)), tail)
    return MemoryFigures(
        steps=len(rss_mb),
        warmup=warmup,
        rss_mb=[round(x, 2) for x in rss_mb],
        slope_kb_per_step=round(slope * 1024, 2),
        growth_mb=round(statistics.median(tail[-10:]) - statistics.median(tail[:10]), 2),
        seconds=round(seconds, 1),
    )


def measure(steps: int, warmup: int, generations: int, prompts_per_step: int) -> MemoryFigures:
    import psutil
    import torch

    from proxy.config import ProxyConfig
    from rollout_relay.cli import ensure_tiny_model
    from rollout_relay.train import _start
    from sdk.train import TrainSettings, train
    from sdk.trl import BackgroundLoop

    torch.set_num_threads(1)  # as rollout-relay train: one intra-op thread
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    model_dir = ensure_tiny_model(None)
    process = psutil.Process()
    rss: list[float] = []

    def on_step(_line: str) -> None:  # sdk.train says one line per step's rollout
        rss.append(process.memory_info().rss / 2**20)
        if len(rss) % 10 == 0:
            print(f"step {len(rss)}: RSS {rss[-1]:.1f} MB", flush=True)

    settings = TrainSettings(
        steps=steps, generations=generations, prompts_per_step=prompts_per_step
    )
    config = ProxyConfig(host="127.0.0.1", port=0)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as out, BackgroundLoop("bench-train") as loop:
        running = loop.run(_start(config, model_dir))
        try:
            train(running.url, model_dir, Path(out), loop=loop, settings=settings, say=on_step)
        finally:
            loop.run(running.stop())
    return figures(rss, warmup, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train_memory")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of the slope")
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args.steps, args.warmup, args.generations, args.prompts_per_step)
    summary: dict[str, Any] = {k: v for k, v in asdict(result).items() if k != "rss_mb"}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
