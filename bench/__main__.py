"""``python -m bench``: measure the proxy's own overhead and write a results table.

python -m bench                      # every section, full size (~10 min on 2 cores)
python -m bench --quick              # tiny sizes: proves the harness works
python -m bench --sections latency,context --out /tmp/results.md
python -m bench --sections vllm      # `vllm serve` beside the proxy, the real engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from bench.harness import SECTIONS, Sizes, run
from bench.report import environment, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds, not minutes)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=",".join(SECTIONS))
    parser.add_argument("--model", type=Path, default=None, help="tokenizer dir (tiny model)")
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM comparison")
    parser.add_argument(
        "--no-durability", action="store_true", help="keep sessions in memory only (no --data-dir)"
    )
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="extra argument for `rollout-relay proxy`"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    parser.add_argument("--json", type=Path, default=None, help="write raw results here")
    args = parser.parse_args(argv)

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    from rollout_relay.cli import ensure_tiny_model

    model_dir = ensure_tiny_model(args.model)
    sizes = Sizes.quick() if args.quick else Sizes()
    out_dir = (args.out.parent if args.out else Path.cwd()).resolve()
    # Stopping the benchmark must stop the processes it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def checkpoint(partial: dict[str, Any]) -> None:
        if args.json:
            args.json.write_text(json.dumps(partial, default=str, indent=1))

    results = asyncio.run(
        run(
            model_dir,
            sizes,
            sections,
            proxy_args=args.proxy_arg,
            with_litellm=not args.no_litellm,
            durable=not args.no_durability,
            out_dir=out_dir,
            checkpoint=checkpoint,
        )
    )
    command = "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    # The written account of the gaps (bench/ANALYSIS.md) goes into the report as it is.
    notes = Path(__file__).with_name("ANALYSIS.md")
    analysis = notes.read_text() if notes.is_file() else None
    text = render(results, environment(), command.strip(), analysis)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    if args.json:
        args.json.write_text(json.dumps(results, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
