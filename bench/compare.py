"""``python -m bench.compare``: the streamed token of several checkouts, in one session.

This machine's speed moves by a third within an hour and more between days, so code is
compared only side by side: each round runs every checkout's own proxy and ``instant``
worker in turn, at an engine's pace (every stream gets a token per engine step), and
reports proxy CPU per token for streamed replies, whole replies at the same pace and,
where the checkout's proxy has ``--stream-interval``, streams grouped by it.

python -m bench.compare /tmp/before .                   # two rounds at 32 and 128 streams
python -m bench.compare A B --streams 32 --rounds 3 --modes streamed,whole

A checkout is a directory with rollout-relay's packages (``git worktree add DIR REV``);
it runs with this environment's Python and packages. Older workers refuse a newer
proxy's protocol and the reverse, so each checkout brings its own worker. Its ``instant``
backend must step every running request together (as since the shared-clock pacing):
with a timer per request, every token is its own frame, which no batching engine sends.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.agents import Target, run_load
from bench.harness import PACED_MODEL, wait_for_model
from bench.processes import Processes, cli_module, wait_http

MODES = ("streamed", "whole", "grouped")


@dataclass(frozen=True, slots=True)
class Cell:
    """One run: a checkout's proxy CPU (and its worker's) per delivered token."""

    checkout: str
    mode: str
    streams: int
    proxy_us: float | None  # None: the checkout's proxy does not run this mode
    worker_us: float | None = None
    errors: int = 0


async def measure(
    checkout: Path,
    model_dir: Path,
    *,
    mode: str,
    streams: list[int],
    pace: float,
    tokens: int,
    turns_per_stream: int,
    interval: int,
    name: str,
) -> list[Cell]:
    """Every stream count through one fresh proxy and worker of ``checkout`` (an
    absolute path), its cells named ``name``."""
    extra = ["--stream-interval", str(interval)] if mode == "grouped" else []
    with Processes(checkout=checkout) as procs:
        proxy = procs.proxy(extra, name=f"proxy-{mode}")
        try:
            wait_http(proxy, "/healthz", within=60)
        except RuntimeError:  # exited: an older proxy without this mode's flag
            return [Cell(name, mode, n, None) for n in streams]
        worker = procs.instant_worker(
            proxy, model_dir, reply_tokens=tokens, name=PACED_MODEL, tokens_per_second=pace
        )
        await wait_for_model(proxy.url, PACED_MODEL)
        cells = []
        for count in streams:
            proxy_before, worker_before = proxy.cpu_seconds(), worker.cpu_seconds()
            result = await run_load(
                Target("proxy", proxy.url),
                concurrency=count,
                total_turns=count * turns_per_stream,
                turns_per_session=8,
                stream=mode != "whole",
                max_tokens=tokens,
                model=PACED_MODEL,
            )
            delivered = sum(call.completion_tokens for call in result.calls) or 1
            cells.append(
                Cell(
                    name,
                    mode,
                    count,
                    (proxy.cpu_seconds() - proxy_before) / delivered * 1e6,
                    (worker.cpu_seconds() - worker_before) / delivered * 1e6,
                    result.errors,
                )
            )
        return cells


def table(cells: list[Cell], checkouts: list[str]) -> str:
    """Markdown: a row per mode and stream count, a column per checkout, each cell the
    rounds' figures in order."""
    rows = sorted({(c.mode, c.streams) for c in cells}, key=lambda r: (MODES.index(r[0]), r[1]))
    lines = [
        "| proxy CPU µs per token (worker's) | " + " | ".join(checkouts) + " |",
        "|---|" + "---:|" * len(checkouts),
    ]
    for mode, count in rows:
        out = []
        for checkout in checkouts:
            runs = [c for c in cells if (c.checkout, c.mode, c.streams) == (checkout, mode, count)]
            figures = [
                "-" if c.proxy_us is None else f"{c.proxy_us:.0f} ({c.worker_us or 0:.0f})"
                for c in runs
            ]
            if any(c.errors for c in runs):
                figures.append(f"{sum(c.errors for c in runs)} errors")
            out.append(", ".join(figures))
        lines.append(f"| {mode}, {count} streams | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkouts", nargs="+", type=Path, help="directories of rollout-relay")
    parser.add_argument("--streams", default="32,128", help="stream counts (default 32,128)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help=",".join(MODES))
    parser.add_argument("--pace", type=float, default=50.0, help="tokens/s of each stream")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per reply")
    parser.add_argument("--turns-per-stream", type=int, default=8)
    parser.add_argument("--interval", type=int, default=8, help="--stream-interval, grouped")
    parser.add_argument("--model", type=Path, default=None, help="tokenizer dir (tiny model)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    for checkout in args.checkouts:
        if not cli_module(checkout):
            parser.error(f"{checkout} is not a checkout of rollout-relay (no command line)")
    try:
        streams = [int(n) for n in args.streams.split(",")]
    except ValueError:
        parser.error("--streams takes whole numbers separated by commas")
    from rollout_relay.cli import ensure_tiny_model

    model_dir = ensure_tiny_model(args.model)
    cells: list[Cell] = []
    for round_ in range(args.rounds):
        for checkout in args.checkouts:
            for mode in modes:
                done = asyncio.run(
                    measure(
                        checkout.resolve(),
                        model_dir,
                        mode=mode,
                        streams=streams,
                        pace=args.pace,
                        tokens=args.tokens,
                        turns_per_stream=args.turns_per_stream,
                        interval=args.interval,
                        name=str(checkout),
                    )
                )
                for cell in done:
                    shown = "-" if cell.proxy_us is None else f"{cell.proxy_us:.1f} us/token"
                    print(f"round {round_ + 1} {checkout} {mode} {cell.streams}: {shown}")
                cells += done
    print(table(cells, [str(c) for c in args.checkouts]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
