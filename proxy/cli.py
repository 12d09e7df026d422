"""The ``rollout-relay`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from proxy.config import ProxyConfig
from worker_client.exceptions import ConnectionRefusedByProxy

DEFAULT_TINY_MODEL = Path.home() / ".cache" / "rollout-relay" / "tiny-model"


def _proxy_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--public-url", default=None, help="URL agents use to reach the proxy")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--worker-wait-seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=4096, help="global cap per call")
    parser.add_argument("--tool-parser", default=None, help="hermes | qwen3_coder | none")
    parser.add_argument("--cache-dir", type=Path, default=None)


def _config(args: argparse.Namespace, worker_token: str | None) -> ProxyConfig:
    defaults = ProxyConfig()
    return ProxyConfig(
        host=args.host,
        port=args.port,
        public_url=args.public_url,
        max_body_bytes=args.max_body_bytes,
        worker_wait_seconds=args.worker_wait_seconds,
        max_tokens=args.max_tokens,
        worker_token=worker_token,
        tool_parser=args.tool_parser,
        cache_dir=args.cache_dir or defaults.cache_dir,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-relay", description="Token-exact LLM proxy for RL training with agents"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("proxy", help="run the proxy")
    _proxy_args(p, 8080)
    p.add_argument("--worker-token", default=os.environ.get("RELAY_WORKER_TOKEN"))

    w = sub.add_parser("worker", help="run an inference worker that dials the proxy")
    w.add_argument("--proxy", required=True, help="ws://host:port/ws/worker")
    w.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    w.add_argument("--model", required=True, help="model directory (or name for vllm)")
    w.add_argument("--name", default=None, help="model name announced to the proxy")
    w.add_argument("--token", default=os.environ.get("RELAY_WORKER_TOKEN", ""))
    w.add_argument("--max-concurrency", type=int, default=8)
    w.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw")
    w.add_argument("--worker-id", default=None)

    t = sub.add_parser("tiny-model", help="write the tiny random-weight test model")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-imprint", action="store_true", help="pure random weights")

    u = sub.add_parser("up", help="proxy + in-process hf worker on the tiny model")
    _proxy_args(u, 8080)
    u.add_argument("--model", type=Path, default=None, help="model dir (default: tiny model)")

    d = sub.add_parser("demo", help="`up`, then a multi-turn tool-using agent episode")
    _proxy_args(d, 0)
    d.add_argument("--model", type=Path, default=None)
    d.add_argument("--turns", type=int, default=6)
    d.add_argument("--seed", type=int, default=1)
    return parser


def ensure_tiny_model(path: Path | None) -> Path:
    if path is not None:
        return path
    if not (DEFAULT_TINY_MODEL / "config.json").is_file():
        from worker_client.tiny_model import write_tiny_model

        print(f"writing the tiny model to {DEFAULT_TINY_MODEL} (once)", flush=True)
        write_tiny_model(DEFAULT_TINY_MODEL)
    return DEFAULT_TINY_MODEL


async def _run_proxy(config: ProxyConfig) -> None:
    from proxy.embedded import start_proxy

    running = await start_proxy(config)
    print(f"rollout-relay proxy listening on {running.url}", flush=True)
    print(f"  workers connect to {running.worker_url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await running.stop()


async def _run_worker(args: argparse.Namespace) -> None:
    from worker_client.client import ServedModel, WorkerClient
    from worker_client.engine import Engine, LogprobsMode

    mode = LogprobsMode(args.logprobs_mode)
    engine: Engine
    if args.backend == "hf":
        from worker_client.backends.hf import HFEngine

        engine = HFEngine.load(args.model, name=args.name, logprobs_mode=mode)
    else:
        from worker_client.backends.vllm import VLLMEngine

        engine = VLLMEngine.load(args.model, name=args.name, logprobs_mode=mode)
    client = WorkerClient(
        args.proxy,
        {engine.card.name: ServedModel(engine, Path(args.model))},
        token=args.token,
        worker_id=args.worker_id,
        max_concurrency=args.max_concurrency,
    )
    await client.run()


async def _up(config: ProxyConfig, model_dir: Path) -> None:
    from proxy.embedded import start_hf_worker, start_proxy

    running = await start_proxy(config)
    try:
        start_hf_worker(running, model_dir, worker_id="embedded-hf")
        await running.wait_for_workers()
        print(f"rollout-relay is up: proxy {running.url}, worker on {model_dir.name}", flush=True)
        print(f"  register a trial:  curl -X POST {running.url}/sessions", flush=True)
        print(f"  agents then use:   {running.url}/<trial_id>/v1  (OpenAI base URL)", flush=True)
        await asyncio.Event().wait()
    finally:
        await running.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        if args.command == "proxy":
            asyncio.run(_run_proxy(_config(args, args.worker_token)))
        elif args.command == "worker":
            asyncio.run(_run_worker(args))
        elif args.command == "tiny-model":
            from worker_client.tiny_model import write_tiny_model

            path = write_tiny_model(args.out_dir, seed=args.seed, imprint=not args.no_imprint)
            print(f"wrote tiny model to {path}")
        elif args.command == "up":
            asyncio.run(_up(_config(args, None), ensure_tiny_model(args.model)))
        elif args.command == "demo":
            from sdk.demo import run_demo

            return asyncio.run(
                run_demo(_config(args, None), ensure_tiny_model(args.model), args.turns, args.seed)
            )
    except KeyboardInterrupt:
        return 130
    except ConnectionRefusedByProxy as exc:
        print(f"rollout-relay worker: the proxy refused this worker: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
