"""The ``rollout-relay`` command line."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from deploy.command import add_deploy_parser, at_least_one_arg, run_deploy
from proxy.appkeys import MODELS
from proxy.coalesce import CoalesceMode
from proxy.config import ProxyConfig
from proxy.exceptions import ConfigurationError, StorageError
from proxy.logs import configure_logging
from rollout_relay.worker_process import DEFAULT_VLLM_PYTHON, WorkerProcessError
from worker_client.exceptions import ConnectionRefusedByProxy, EngineUnavailableError

T = TypeVar("T")

# The signals that stop every long-running command cleanly.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Where the tiny model is written when the installation does not ship it.
DEFAULT_TINY_MODEL = Path.home() / ".cache" / "rollout-relay" / "tiny-model"
# Where ``train --backend vllm`` writes it with heads 32 wide (vLLM's CPU attention).
DEFAULT_VLLM_TINY_MODEL = DEFAULT_TINY_MODEL.with_name("tiny-model-hd32")


def _proxy_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--public-url", default=None, help="URL agents use to reach the proxy")
    parser.add_argument(
        "--peers",
        default=None,
        metavar="URL,URL,...",
        help="every proxy replica's public URL, this one's included: each trial is owned by "
        "one replica (chosen from its id), the others forward to it",
    )
    limits = ProxyConfig()
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=limits.max_body_bytes,
        help="request body size at most (histories resend their images as base64 each turn)",
    )
    parser.add_argument("--worker-wait-seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=4096, help="global cap per call")
    parser.add_argument("--tool-parser", default=None, help="hermes | qwen3_coder | none")
    parser.add_argument(
        "--stream-interval",
        type=at_least_one_arg("token"),
        default=1,
        metavar="TOKENS",
        help="tokens per streamed event (1: every engine step; more: fewer, larger events "
        "for less CPU per token; the first tokens and the end go out at once)",
    )
    parser.add_argument(
        "--stream-coalesce",
        type=CoalesceMode,
        choices=list(CoalesceMode),
        default=CoalesceMode.ADAPTIVE,
        metavar="{" + ",".join(m.value for m in CoalesceMode) + "}",
        help="adaptive (default): while the proxy's event loop runs behind, a stream's "
        "tokens wait a few ms and go out together, otherwise every engine step at once; "
        "off: every step at once however busy (with --stream-interval above 1: off)",
    )
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=limits.max_in_flight,
        help="requests running on workers overall (0: the workers' announced concurrency)",
    )
    parser.add_argument(
        "--max-in-flight-per-worker",
        type=int,
        default=limits.max_in_flight_per_worker,
        help="caps each worker's announced concurrency (0: no cap)",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=limits.max_queued,
        help="requests waiting for a worker overall; beyond it 503 with Retry-After",
    )
    parser.add_argument(
        "--max-queued-per-trial",
        type=int,
        default=limits.max_queued_per_trial,
        help="requests one trial may have waiting; beyond it 429 with Retry-After",
    )
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=limits.heartbeat_seconds,
        help="WebSocket ping interval; a worker that misses a pong is evicted",
    )
    parser.add_argument(
        "--weights-phase-seconds",
        type=float,
        default=limits.weights_phase_seconds,
        help="how long each phase of a weight update (pause, load, commit or rollback) may "
        "take on the workers; a whole POST /weights takes at most three phases",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=limits.drain_seconds,
        help="on SIGTERM, how long running turns may take to finish",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("RELAY_DATA_DIR") or None,
        help="store sessions and turns here (SQLite, WAL) so they survive a restart"
        " (env RELAY_DATA_DIR; default: in memory only, lost when the proxy stops)",
    )
    parser.add_argument(
        "--session-idle-seconds",
        type=float,
        default=limits.session_idle_seconds,
        help="complete a session after this long without a request (0: never)",
    )
    parser.add_argument(
        "--session-max-age-seconds",
        type=float,
        default=limits.session_max_age_seconds,
        help="complete a session at this age (0: never)",
    )
    parser.add_argument(
        "--retention-seconds",
        type=float,
        default=limits.retention_seconds,
        help="remove a completed session this long after it completed (0: keep)",
    )
    parser.add_argument(
        "--fetched-retention-seconds",
        type=float,
        default=limits.fetched_retention_seconds,
        help="remove a completed session this long after its trajectories were first"
        " fetched (0: keep until --retention-seconds)",
    )
    parser.add_argument(
        "--max-messages",
        type=int,
        default=limits.max_messages,
        help="messages in one agent request (0: no limit)",
    )
    parser.add_argument(
        "--max-session-tokens",
        type=int,
        default=limits.max_session_tokens,
        help="tokens one session may store, context and sampled (0: no limit)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=limits.max_sessions,
        help="sessions held at once (registered and not deleted; 0: no limit)",
    )
    parser.add_argument(
        "--history-memory-mb",
        type=int,
        default=limits.history_memory_mb,
        help="what the sessions' memories of their recent histories hold together, at most "
        "(MiB; the least recently used are dropped first, their next turn parses its whole "
        "history once)",
    )
    parser.add_argument(
        "--image-url-allow",
        nargs="+",
        action="extend",
        default=[],
        metavar="HOST",
        help="hosts http(s) image URLs may be fetched from (repeatable): an exact host name, "
        "or .example.org for its subdomains, on port 80 (http) or 443 (https), or HOST:PORT "
        "for that port; only at public addresses, never from https to http; none (the "
        "default): only base64 images",
    )
    parser.add_argument(
        "--image-fetch-seconds",
        type=float,
        default=limits.image_fetch_seconds,
        help="how long fetching one image URL may take",
    )
    parser.add_argument(
        "--max-image-bytes",
        type=int,
        default=limits.max_image_bytes,
        help="bytes one image may have (0: no limit)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=limits.max_image_pixels,
        help="pixels (width x height) one image may have (0: no limit)",
    )
    parser.add_argument(
        "--max-images",
        type=int,
        default=limits.max_images,
        help="images one request may hold, its history's included (0: no limit)",
    )


def _config(
    args: argparse.Namespace, worker_token: str | None, admin_token: str | None = None
) -> ProxyConfig:
    defaults = ProxyConfig()
    return ProxyConfig(
        host=args.host,
        port=args.port,
        public_url=args.public_url,
        peers=tuple(p for p in (getattr(args, "peers", None) or "").split(",") if p.strip()),
        max_body_bytes=args.max_body_bytes,
        worker_wait_seconds=args.worker_wait_seconds,
        max_tokens=args.max_tokens,
        admin_token=admin_token,
        worker_token=worker_token,
        tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None),
        max_messages=args.max_messages,
        max_session_tokens=args.max_session_tokens,
        max_sessions=args.max_sessions,
        history_memory_mb=args.history_memory_mb,
        tool_parser=args.tool_parser,
        image_url_allow=tuple(args.image_url_allow),
        image_fetch_seconds=args.image_fetch_seconds,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        max_images=args.max_images,
        stream_interval=args.stream_interval,
        stream_coalesce=args.stream_coalesce,
        max_in_flight=args.max_in_flight,
        max_in_flight_per_worker=args.max_in_flight_per_worker,
        max_queued=args.max_queued,
        max_queued_per_trial=args.max_queued_per_trial,
        heartbeat_seconds=args.heartbeat_seconds,
        weights_phase_seconds=args.weights_phase_seconds,
        drain_seconds=args.drain_seconds,
        data_dir=Path(args.data_dir) if args.data_dir is not None else None,
        session_idle_seconds=args.session_idle_seconds,
        session_max_age_seconds=args.session_max_age_seconds,
        retention_seconds=args.retention_seconds,
        fetched_retention_seconds=args.fetched_retention_seconds,
        cache_dir=args.cache_dir or defaults.cache_dir,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-relay", description="Token-exact LLM proxy for RL training with agents"
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        default=None,
        help="json lines with trial_id and request_id (default for proxy and worker) or text",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("proxy", help="run the proxy")
    _proxy_args(p, 8080)
    p.add_argument(
        "--admin-token",
        default=os.environ.get("RELAY_ADMIN_TOKEN"),
        help="opens the session API (env RELAY_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--worker-token",
        default=os.environ.get("RELAY_WORKER_TOKEN"),
        help="admits workers on /ws/worker (env RELAY_WORKER_TOKEN)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="run without any authentication (local development only)",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key")
    p.add_argument(
        "--event-loop",
        choices=["asyncio", "uvloop"],
        default="uvloop",
        help="uvloop (default) measured ~12%% less proxy CPU per turn than asyncio's own loop "
        "(bench/RESULTS.md)",
    )

    w = sub.add_parser("worker", help="run an inference worker that dials the proxy")
    w.add_argument(
        "--proxy",
        required=True,
        action="append",
        help="ws://host:port/ws/worker; repeat it for several proxy replicas, or give a name "
        "that resolves to all of them (re-resolved every --resolve-seconds)",
    )
    w.add_argument("--resolve-seconds", type=float, default=30.0)
    w.add_argument(
        "--backend",
        choices=["hf", "vllm", "openai", "instant"],
        default="hf",
        help="openai: an existing vLLM/SGLang server (--upstream-url); "
        "instant: benchmark-only, no model, replies at once with seeded noise tokens",
    )
    w.add_argument(
        "--model",
        required=True,
        help="model directory (or name for vllm; for openai, the directory with its tokenizer)",
    )
    w.add_argument(
        "--upstream-url",
        default=None,
        help="openai backend: the upstream server's /v1 URL, e.g. http://127.0.0.1:8000/v1",
    )
    w.add_argument(
        "--upstream-model",
        default=None,
        help="openai backend: the model name the upstream serves (default: --name)",
    )
    w.add_argument(
        "--upstream-api-key",
        default=os.environ.get("RELAY_UPSTREAM_API_KEY"),
        help="openai backend: bearer key for the upstream (env RELAY_UPSTREAM_API_KEY)",
    )
    w.add_argument(
        "--weights-api",
        choices=["sglang", "vllm"],
        default=None,
        help="openai backend: how the upstream server loads a new checkpoint on POST /weights "
        "(sglang: /update_weights_from_disk; vllm: its RL routes, VLLM_SERVER_DEV_MODE=1)",
    )
    w.add_argument(
        "--images-api",
        choices=["sglang"],
        default=None,
        help="openai backend: a vision-language model's images go to the upstream SGLang "
        "server's native /generate (input_ids + image_data); without it the model serves "
        "text only (vLLM's OpenAI-compatible server takes no images with token-id prompts)",
    )
    w.add_argument(
        "--routed-experts",
        choices=["vllm", "sglang"],
        default=None,
        help="a mixture-of-experts model's routing, returned per request for routing replay "
        "(off by default): vllm (the vllm backend, which starts vLLM with "
        "enable_return_routed_experts, or an openai-backend vLLM server) or sglang (an "
        "openai-backend SGLang server); either server started with "
        "--enable-return-routed-experts. The hf backend reports any MoE it loads",
    )
    w.add_argument(
        "--device", default="cpu", help="hf backend: the torch device (cpu, cuda, cuda:1, ...)"
    )
    w.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="vllm backend: the dtype the engine computes in (default: vLLM's auto, except "
        "that a float32 checkpoint is served in float32 on CPU; a trainer in float32 "
        "reproduces only float32 logprobs)",
    )
    w.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vllm backend: no CUDA graphs or torch.compile (starts in a third of the time)",
    )
    w.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="vllm backend: the context window (default: the model's)",
    )
    w.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm backend: any other vLLM engine argument (AsyncEngineArgs), repeated; "
        'VALUE is read as JSON where it parses (8, true, {"image": 1}), else as text; '
        "e.g. --engine-arg enable_prefix_caching=false",
    )
    w.add_argument("--name", default=None, help="model name announced to the proxy")
    w.add_argument(
        "--teacher",
        action="store_true",
        help="serve the model as a teacher: it scores recorded sessions "
        "(POST /sessions/<trial>/teacher), takes no weight updates, and an agent reaches it "
        "only by naming it exactly (hf and vllm backends)",
    )
    w.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template that replaces the model's own in what the proxy renders "
        "(e.g. a tool-aware one where the model's template ignores tools)",
    )
    w.add_argument("--token", default=os.environ.get("RELAY_WORKER_TOKEN", ""))
    w.add_argument("--max-concurrency", type=int, default=8)
    w.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw")
    w.add_argument("--worker-id", default=None)
    w.add_argument(
        "--ca-file",
        type=Path,
        default=os.environ.get("RELAY_CA_FILE"),
        help="PEM CA bundle to verify a wss:// proxy with (e.g. a self-signed deployment)",
    )
    w.add_argument("--reply-tokens", type=int, default=16, help="instant backend: tokens per reply")
    w.add_argument(
        "--tokens-per-second",
        type=float,
        default=0.0,
        help="instant backend: pace each reply's tokens (0: back to back)",
    )

    t = sub.add_parser("tiny-model", help="write the tiny random-weight test model")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--no-imprint",
        action="store_true",
        help="the seed's random weights, untrained (the text model and the MoE)",
    )
    t.add_argument(
        "--family",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="a model family's folder (chat_template.jinja + family.json, e.g. "
        "tests/fixtures/families/qwen3): tiny weights on that family's vocabulary and template",
    )
    t.add_argument(
        "--moe",
        action="store_true",
        help="the tiny mixture-of-experts model (Qwen3-MoE's architecture) instead",
    )
    t.add_argument(
        "--vlm",
        action="store_true",
        help="the tiny vision-language model (Qwen3-VL's architecture and template) instead",
    )
    t.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="attention heads this wide (vLLM's CPU attention takes 32 and up; the tiny "
        "models' are 16): the MoE and VLM drawn anew with them; the text model is the "
        "shipped one with its heads widened, computing the same function",
    )
    t.add_argument(
        "--shipped",
        action="store_true",
        help="copy the model the project ships (the text model, or with --moe or --vlm that "
        "one) instead of writing one: seconds, where training a text model or MoE takes "
        "minutes",
    )

    u = sub.add_parser("up", help="proxy + in-process hf worker on the tiny model")
    _proxy_args(u, 8080)
    u.add_argument("--model", type=Path, default=None, help="model dir (default: tiny model)")

    d = sub.add_parser("demo", help="`up`, then a multi-turn tool-using agent episode")
    _proxy_args(d, 0)
    d.add_argument("--model", type=Path, default=None)
    d.add_argument("--turns", type=int, default=6)
    d.add_argument("--seed", type=int, default=1)
    d.add_argument(
        "--keep", action="store_true", help="keep the proxy up afterwards to read it at /ui/"
    )
    d.add_argument("-v", "--verbose", action="store_true", help="log to the console, not to a file")

    tr = sub.add_parser(
        "train",
        help="train the tiny model with TRL's GRPOTrainer through the proxy and real agents",
    )
    tr.add_argument("--model", type=Path, default=None, help="model dir (default: tiny model)")
    tr.add_argument("--steps", type=int, default=40, help="optimizer steps")
    tr.add_argument(
        "--out", type=Path, default=Path(".cache/train"), help="plot, figures and checkpoints"
    )
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--learning-rate", type=float, default=1e-3)
    tr.add_argument("--generations", type=int, default=8, help="episodes per prompt (a group)")
    tr.add_argument("--prompts-per-step", type=int, default=2)
    tr.add_argument(
        "--torch-threads", type=int, default=1, help="torch's intra-op threads (tiny model: 1)"
    )
    tr.add_argument(
        "--moe",
        action="store_true",
        help="serve and train the tiny mixture-of-experts model (unless --model)",
    )
    tr.add_argument(
        "--routed-experts",
        action="store_true",
        help="rollout routing replay (R3): record each token's experts, replay them in training",
    )
    tr.add_argument(
        "--backend",
        choices=["hf", "vllm"],
        default="hf",
        help="the worker that serves the policy: hf (in this process) or vllm (the real vLLM "
        "engine, its CPU build, in a process of its own from --vllm-python; the model's "
        "heads must be 32 wide or more: by default the tiny model widened to 32)",
    )
    tr.add_argument(
        "--vllm-python",
        type=Path,
        default=DEFAULT_VLLM_PYTHON,
        help="--backend vllm: the Python of vLLM's side environment (scripts/vllm-env.sh)",
    )
    tr.add_argument(
        "--proxy",
        default=None,
        help="train through this proxy (http://host:port) and the workers it has, which serve "
        "--model as version 0, instead of starting a proxy and a worker; the admin token "
        "from --admin-token",
    )
    tr.add_argument(
        "--admin-token",
        default=os.environ.get("RELAY_ADMIN_TOKEN"),
        help="--proxy: its admin token (env RELAY_ADMIN_TOKEN)",
    )
    tr.add_argument(
        "-v", "--verbose", action="store_true", help="log to the console, not to a file"
    )

    ts = sub.add_parser(
        "task-server",
        help="run Harbor-format tasks as local processes behind the run-submission API",
    )
    ts.add_argument("--host", default="127.0.0.1")
    ts.add_argument("--port", type=int, default=8090)
    ts.add_argument("--runs-dir", type=Path, default=None, help="default: a temporary directory")
    ts.add_argument("--max-concurrent-runs", type=int, default=2)
    ts.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="an agent the runs may name: a shell command run in the task's workspace with "
        "OPENAI_BASE_URL, ANTHROPIC_BASE_URL, TASK_INSTRUCTION, ... set (repeatable)",
    )
    ts.add_argument(
        "--token",
        default=os.environ.get("RELAY_TASK_SERVER_TOKEN"),
        help="bearer token the API requires (env RELAY_TASK_SERVER_TOKEN)",
    )
    ts.add_argument("--keep-finished", type=int, default=1000, help="finished runs kept")

    add_deploy_parser(sub)
    return parser


def _task_server(args: argparse.Namespace) -> int:
    from sdk.taskserver.server import TaskServerConfig, parse_agents, serve_forever

    try:
        agents = parse_agents(args.agent)
    except ValueError as exc:
        print(f"rollout-relay task-server: {exc}", file=sys.stderr)
        return 2
    if args.max_concurrent_runs < 1:
        print("rollout-relay task-server: --max-concurrent-runs must be >= 1", file=sys.stderr)
        return 2
    if not args.token:
        print(
            f"rollout-relay task-server: no --token: anyone who can reach {args.host} can "
            "submit a task, and a task's tests/test.sh runs on this machine. Keep it on "
            "loopback or give it a token.",
            file=sys.stderr,
            flush=True,
        )
    config = TaskServerConfig(
        host=args.host,
        port=args.port,
        runs_dir=args.runs_dir,
        max_concurrent_runs=args.max_concurrent_runs,
        agents=agents,
        token=args.token,
        keep_finished=args.keep_finished,
    )
    asyncio.run(serve_forever(config))
    return 0


def ensure_tiny_model(path: Path | None, say: Callable[[str], None] = print) -> Path:
    """The model to serve: ``path``, or the tiny model the project ships; where the
    installation lacks it, one written once under ~/.cache (a few minutes on two cores:
    a BPE tokenizer, then a few hundred training steps, with progress)."""
    from worker_client.tiny_model import SHIPPED_TINY_MODEL

    if path is not None:
        return path
    if (SHIPPED_TINY_MODEL / "model.safetensors").is_file():
        return SHIPPED_TINY_MODEL
    if not (DEFAULT_TINY_MODEL / "model.safetensors").is_file():
        from worker_client.tiny_model import write_tiny_model

        say(f"writing the tiny model to {DEFAULT_TINY_MODEL} (first run only, minutes on CPU)")

        def progress(done: int, total: int) -> None:
            say(f"  training its weights on synthetic chats: {100 * done // total}%")

        write_tiny_model(DEFAULT_TINY_MODEL, progress=progress)
    return DEFAULT_TINY_MODEL


# How long the cleanup a third stop signal cuts gets to unwind before the process exits
# without it (an engine closing in a thread is not interrupted by cancelling its await).
CUT_SECONDS = 5.0


class Stopped(Exception):
    """A stop signal ended the command, once its cleanup was done."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as shells and Kubernetes read a signalled exit."""
        return 128 + self.signum


def _run_loop(
    main: Coroutine[Any, Any, T], kind: str = "asyncio", *, stop_on_signal: bool = True
) -> T:
    """Run ``main`` on the standard event loop or on uvloop's. With ``stop_on_signal``,
    SIGTERM or SIGINT cancels it, so that its own ``finally`` blocks close what it opened
    (the proxy, the worker's engine), and ``Stopped`` is raised once they are done. A
    second signal does not cut that cleanup; a third does, and the process exits at most
    ``CUT_SECONDS`` later (see ``_until_signalled``). The handlers are installed whatever
    the process inherited: a process started from a non-interactive shell has SIGINT
    ignored, and nothing else would stop it short of SIGKILL."""
    factory = None
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError as exc:
            raise ConfigurationError("--event-loop uvloop needs the uvloop package") from exc
        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_until_signalled(main) if stop_on_signal else main)


async def _until_signalled(main: Coroutine[Any, Any, T]) -> T:
    """Await ``main``; the first stop signal cancels it, and ``Stopped`` is raised when it
    has unwound. A second signal only says that the cleanup goes on: cancelling again would
    cut the ``finally`` that closes the engine. A third cancels the cleanup too, and ends
    the process ``CUT_SECONDS`` later if it has not ended by then (a thread closing an
    engine, or the loop's shutdown waiting for it, can outlast any cancel)."""
    task = asyncio.ensure_future(main)
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def exit_now() -> None:
        print(
            f"rollout-relay: the cleanup did not end within {CUT_SECONDS:g}s of the third "
            "signal: exiting without it",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(128 + received[0])

    def stop(signum: int) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            logging.getLogger("rollout_relay").info("%s received: stopping", name)
            task.cancel()
        elif len(received) == 2:
            print(
                f"rollout-relay: {name} again: still closing what the command opened; "
                "a third signal cuts that short",
                file=sys.stderr,
                flush=True,
            )
        elif len(received) == 3:
            print(
                f"rollout-relay: {name} a third time: cutting the cleanup short; exiting "
                f"within {CUT_SECONDS:g}s",
                file=sys.stderr,
                flush=True,
            )
            task.cancel()
            loop.call_later(CUT_SECONDS, exit_now)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    try:
        result = await task
    except asyncio.CancelledError:
        if not received:
            raise
    else:
        if not received:
            return result
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
    raise Stopped(received[0])


def _freeze_alive() -> None:
    gc.collect()
    gc.freeze()


async def _run_proxy(config: ProxyConfig) -> None:
    from rollout_relay.embedded import start_proxy

    running = await start_proxy(config)
    # Everything alive now (modules, the app, the sessions restored from the store) lives
    # as long as the process or is freed by reference counting: frozen, it is no longer
    # rescanned by every full garbage collection, whose pause grows with what it scans.
    # So is each tokenizer a worker brings, with the modules its loading imported (a
    # full collection took ~100 ms over them). Only here, in a process of our own: an
    # embedded proxy leaves its host's collector be.
    _freeze_alive()
    running.app[MODELS].on_added = _freeze_alive
    terminate = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Before saying it listens: whoever waits for that line may signal at once.
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, terminate.set)
    print(f"rollout-relay proxy listening on {running.url}", flush=True)
    print(f"  workers connect to {running.worker_url}", flush=True)
    stopped = False
    try:
        await terminate.wait()
        logging.getLogger("proxy").info("signal received: draining, then stopping")
        await running.shutdown(config.drain_seconds)
        stopped = True
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        if not stopped:
            await running.stop()


# The backends whose engines score ids by teacher forcing (``PromptScorer``).
_SCORING_BACKENDS = ("hf", "vllm")


async def _run_worker(args: argparse.Namespace) -> None:
    from worker_client.client import ServedModel, client_ssl_context
    from worker_client.engine import Engine, LogprobsMode
    from worker_client.fleet import WorkerFleet

    mode = LogprobsMode(args.logprobs_mode)
    engine: Engine
    if args.backend != "vllm" and _vllm_arguments(args, None):
        raise ConfigurationError(
            "--dtype, --enforce-eager, --max-model-len and --engine-arg are for --backend vllm"
        )
    if args.backend == "hf":
        from worker_client.backends.hf import HFEngine

        engine = HFEngine.load(args.model, name=args.name, logprobs_mode=mode, device=args.device)
    elif args.backend == "instant":
        from worker_client.backends.instant import InstantEngine

        engine = InstantEngine.load(
            args.model,
            name=args.name,
            reply_tokens=args.reply_tokens,
            tokens_per_second=args.tokens_per_second,
        )
    elif args.backend == "openai":
        from worker_client.backends.openai import OpenAIEngine

        engine = OpenAIEngine.load(
            args.model,
            base_url=args.upstream_url,
            name=args.name,
            upstream_model=args.upstream_model,
            api_key=args.upstream_api_key,
            logprobs_mode=mode,
            weights_api=args.weights_api,
            images_api=args.images_api,
            routing_api=args.routed_experts,
        )
    else:
        from worker_client.backends.vllm import VLLMEngine, engine_arguments

        engine = VLLMEngine.load(
            args.model,
            name=args.name,
            logprobs_mode=mode,
            routed_experts=args.routed_experts == "vllm",
            **_vllm_arguments(args, engine_arguments),
        )
    fleet = WorkerFleet(
        args.proxy,
        {
            engine.card.name: ServedModel(
                engine, Path(args.model), args.chat_template, teacher=args.teacher
            )
        },
        token=args.token,
        worker_id=args.worker_id,
        max_concurrency=args.max_concurrency,
        ssl_context=lambda url: (
            client_ssl_context(args.ca_file) if url.startswith("wss://") else None
        ),
        resolve_seconds=args.resolve_seconds,
    )
    # The engine and what loading it imported live as long as the process (see the proxy).
    _freeze_alive()
    try:
        await fleet.run()
    finally:
        # Cancelled by SIGTERM or SIGINT too: an engine with processes of its own (vLLM's
        # engine core) must not outlive the worker.
        await engine.close()


def _vllm_arguments(
    args: argparse.Namespace, parse: Callable[[list[str]], dict[str, Any]] | None
) -> dict[str, Any]:
    """The vLLM engine arguments the worker's flags give (``parse``: how ``--engine-arg``
    pairs are read; None: only whether any are given)."""
    given: dict[str, Any] = {}
    if args.engine_arg:
        try:
            given = parse(args.engine_arg) if parse is not None else {"engine_arg": True}
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    named = {"dtype": args.dtype, "max_model_len": args.max_model_len}
    for key, value in named.items():
        if value is not None:
            given[key] = value
    if args.enforce_eager:
        given["enforce_eager"] = True
    return given


async def _up(config: ProxyConfig, model_dir: Path) -> None:
    from rollout_relay.embedded import start_hf_worker, start_proxy

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


_OPEN_WARNING = (
    "AUTHENTICATION IS OFF ({why}): anyone who can reach {where} can register trials, read "
    "every trajectory, call any trial's agent routes and connect a worker that reads prompts "
    "and forges replies. Use it on loopback for local development only."
)


def _warn_open(why: str, host: str = "127.0.0.1") -> None:
    where = f"{host} (all interfaces)" if host in {"0.0.0.0", "::", ""} else host
    bar = "!" * 78
    message = _OPEN_WARNING.format(why=why, where=where)
    logging.getLogger("proxy").warning("authentication is off (%s)", why)
    print(f"{bar}\n{message}\n{bar}", file=sys.stderr, flush=True)


def _demo(args: argparse.Namespace) -> int:
    from rollout_relay.demo import run_demo

    if args.host not in {"127.0.0.1", "localhost", "::1"}:
        _warn_open("`rollout-relay demo`", args.host)
    say = _console(
        "rollout-relay demo: an agent episode through the proxy on a tiny random model (CPU)",
        "demo",
        "the proxy's and worker's",
        verbose=args.verbose,
    )
    model = ensure_tiny_model(args.model, say)
    say(f"[1/5] model: {model}")
    try:
        return _run_loop(
            run_demo(
                _config(args, None),
                model,
                turns=args.turns,
                seed=args.seed,
                keep=args.keep,
                say=say,
            )
        )
    except Stopped:
        say("stopped")
        raise


def _console(title: str, name: str, whose: str, *, verbose: bool) -> Callable[[str], None]:
    """What a console command (demo, train) tells its user, line by line: the title now;
    unless ``verbose``, the logs go to a file, and the user is told where."""
    from rollout_relay.demo import log_to_file

    def say(line: str) -> None:
        print(line, flush=True)

    say(title)
    if not verbose:
        log_file = Path(tempfile.gettempdir()) / f"rollout-relay-{name}.log"
        log_to_file(log_file)
        say(f"  ({whose} logs: {log_file}; -v shows them here)")
    return say


def _train(args: argparse.Namespace) -> int:
    from rollout_relay.train import run_train

    # GRPO compares the episodes of a group: two at least.
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--generations", args.generations, 2),
        ("--prompts-per-step", args.prompts_per_step, 1),
        ("--torch-threads", args.torch_threads, 1),
    ):
        if value < least:
            print(f"rollout-relay train: {flag} must be at least {least}", file=sys.stderr)
            return 2
    if args.learning_rate <= 0:
        print("rollout-relay train: --learning-rate must be positive", file=sys.stderr)
        return 2
    refusal = _train_refusal(args)
    if refusal is not None:
        print(f"rollout-relay train: {refusal}", file=sys.stderr)
        return 2
    say = _console(
        "rollout-relay train: TRL's GRPOTrainer trains a policy through the proxy (CPU)",
        "train",
        "the proxy's, worker's and trainer's",
        verbose=args.verbose,
    )
    if args.moe and args.model is None:
        from worker_client.tiny_moe import SHIPPED_TINY_MOE

        model = SHIPPED_TINY_MOE
    elif args.backend == "vllm" and args.model is None and args.proxy is None:
        model = ensure_vllm_tiny_model(say)
    else:
        model = ensure_tiny_model(args.model, say)
    say(f"[1/3] model: {model} (the workers' version 0 and the trainer's start)")
    try:
        return run_train(
            model,
            args.out,
            steps=args.steps,
            seed=args.seed,
            learning_rate=args.learning_rate,
            generations=args.generations,
            prompts_per_step=args.prompts_per_step,
            torch_threads=args.torch_threads,
            routed_experts=args.routed_experts,
            backend=args.backend,
            vllm_python=args.vllm_python,
            proxy_url=args.proxy,
            admin_token=args.admin_token,
            say=say,
        )
    except KeyboardInterrupt:
        say("stopped")
        return 130
    except WorkerProcessError as exc:
        print(f"rollout-relay train: {exc}", file=sys.stderr)
        return 1


def _train_refusal(args: argparse.Namespace) -> str | None:
    """Why ``rollout-relay train``'s flags do not go together (None: they do)."""
    if args.proxy is not None and args.backend != "hf":
        return "--proxy trains through the workers that proxy has; --backend starts one"
    if args.backend == "vllm":
        if args.moe or args.routed_experts:
            return (
                "--backend vllm trains the text model: vLLM's CPU build returns no routed "
                "experts (its Model Runner V2 needs Triton)"
            )
        if not args.vllm_python.is_file():
            return (
                f"--backend vllm runs the worker from vLLM's side environment, and "
                f"{args.vllm_python} is not there: run scripts/vllm-env.sh first (make "
                "train-vllm does), or give --vllm-python"
            )
    return None


def _copy_shipped_model(args: argparse.Namespace) -> int:
    """``tiny-model --shipped``: the shipped text, MoE or VLM model copied to the output
    folder (replacing none: an existing folder is refused)."""
    from worker_client.tiny_model import SHIPPED_TINY_MODEL
    from worker_client.tiny_moe import SHIPPED_TINY_MOE
    from worker_client.tiny_vlm import SHIPPED_TINY_VLM

    given = [
        flag
        for flag, set_ in (
            ("--seed", args.seed != 0),
            ("--no-imprint", args.no_imprint),
            ("--family", args.family is not None),
            ("--head-dim", args.head_dim is not None),
            ("--moe and --vlm", args.moe and args.vlm),
        )
        if set_
    ]
    if given:
        print(
            f"rollout-relay tiny-model: --shipped copies a shipped model as it is; it takes "
            f"no {', '.join(given)}",
            file=sys.stderr,
        )
        return 2
    source = SHIPPED_TINY_MOE if args.moe else SHIPPED_TINY_VLM if args.vlm else SHIPPED_TINY_MODEL
    if args.out_dir.exists() and any(args.out_dir.iterdir()):
        print(f"rollout-relay tiny-model: {args.out_dir} exists and is not empty", file=sys.stderr)
        return 2
    shutil.copytree(source, args.out_dir, dirs_exist_ok=True)
    print(f"copied the shipped tiny model {source.name} to {args.out_dir}")
    return 0


def ensure_vllm_tiny_model(say: Callable[[str], None] = print) -> Path:
    """The shipped tiny model with heads 32 wide, the narrowest vLLM's CPU attention
    takes (the same function), written once next to ``DEFAULT_TINY_MODEL``."""
    from worker_client.tiny_model import SHIPPED_TINY_MODEL, VLLM_HEAD_DIM, widen_heads

    if not (DEFAULT_VLLM_TINY_MODEL / "model.safetensors").is_file():
        say(
            f"widening the tiny model's heads to {VLLM_HEAD_DIM} for vLLM: {DEFAULT_VLLM_TINY_MODEL}"
        )
        widen_heads(SHIPPED_TINY_MODEL, DEFAULT_VLLM_TINY_MODEL, head_dim=VLLM_HEAD_DIM)
    return DEFAULT_VLLM_TINY_MODEL


def _secured_config(args: argparse.Namespace) -> ProxyConfig | None:
    """The proxy's settings with its credentials; None (after saying why) when it must
    not start: tokens missing without an explicit --no-auth."""
    if args.no_auth:
        _warn_open("--no-auth", args.host)
        return _config(args, None)
    missing = [
        flag
        for flag, value in (
            ("--admin-token", args.admin_token),
            ("--worker-token", args.worker_token),
        )
        if not value
    ]
    if missing:
        print(
            f"rollout-relay proxy: refusing to start without {' and '.join(missing)} "
            "(or RELAY_ADMIN_TOKEN / RELAY_WORKER_TOKEN); pass --no-auth to run open for "
            "local development",
            file=sys.stderr,
        )
        return None
    return _config(args, args.worker_token, args.admin_token)


def _routed_experts_refusal(backend: str, routed_experts: str | None) -> str | None:
    """Why ``--routed-experts`` does not fit ``--backend`` (None: it does)."""
    if routed_experts is None or backend == "openai":
        return None
    if backend == "vllm":
        if routed_experts == "vllm":
            return None
        return "--backend vllm returns routing with --routed-experts vllm (its own engine)"
    if backend == "hf":
        return "--routed-experts is for vllm and openai: the hf backend reports any MoE it loads"
    return f"--backend {backend} reports no routing"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_format = args.log_format or ("json" if args.command in {"proxy", "worker"} else "text")
    configure_logging(args.log_level, log_format)
    try:
        if args.command == "proxy":
            config = _secured_config(args)
            if config is None:
                return 2
            # The proxy drains on a signal itself (see _run_proxy).
            _run_loop(_run_proxy(config), args.event_loop, stop_on_signal=False)
        elif args.command == "worker":
            if args.teacher and args.backend not in _SCORING_BACKENDS:
                print(
                    "rollout-relay worker: --teacher needs a backend that scores "
                    f"({', '.join(_SCORING_BACKENDS)}), not {args.backend}",
                    file=sys.stderr,
                )
                return 2
            if args.backend == "openai" and not args.upstream_url:
                print(
                    "rollout-relay worker: --backend openai needs --upstream-url "
                    "(the vLLM/SGLang server's /v1 URL)",
                    file=sys.stderr,
                )
                return 2
            refusal = _routed_experts_refusal(args.backend, args.routed_experts)
            if refusal is not None:
                print(f"rollout-relay worker: {refusal}", file=sys.stderr)
                return 2
            if args.chat_template is not None and not args.chat_template.is_file():
                print(
                    f"rollout-relay worker: --chat-template {args.chat_template}: no such file",
                    file=sys.stderr,
                )
                return 2
            _run_loop(_run_worker(args))
        elif args.command == "tiny-model":
            from worker_client.families import FamilyError, write_family_model
            from worker_client.tiny_model import write_tiny_model

            heads = {} if args.head_dim is None else {"head_dim": args.head_dim}
            if args.shipped:
                return _copy_shipped_model(args)
            if args.moe:
                from worker_client.tiny_moe import write_tiny_moe

                path = write_tiny_moe(
                    args.out_dir, seed=args.seed, imprint=not args.no_imprint, **heads
                )
            elif args.vlm:
                from worker_client.tiny_vlm import write_tiny_vlm

                path = write_tiny_vlm(args.out_dir, seed=args.seed, **heads)
            elif args.head_dim is not None:
                from worker_client.tiny_model import SHIPPED_TINY_MODEL, widen_heads

                if args.family is not None or args.no_imprint or args.seed != 0:
                    print(
                        "rollout-relay tiny-model: --head-dim widens the shipped text model; "
                        "it takes no --family, --no-imprint or --seed",
                        file=sys.stderr,
                    )
                    return 2
                try:
                    path = widen_heads(SHIPPED_TINY_MODEL, args.out_dir, head_dim=args.head_dim)
                except ValueError as exc:
                    print(f"rollout-relay tiny-model: {exc}", file=sys.stderr)
                    return 2
            elif args.family is not None:
                try:
                    path = write_family_model(args.out_dir, args.family, seed=args.seed)
                except FamilyError as exc:
                    print(f"rollout-relay tiny-model: {exc}", file=sys.stderr)
                    return 2
            else:
                path = write_tiny_model(args.out_dir, seed=args.seed, imprint=not args.no_imprint)
            print(f"wrote tiny model to {path}")
        elif args.command == "up":
            _warn_open("`rollout-relay up`", args.host)
            _run_loop(_up(_config(args, None), ensure_tiny_model(args.model)))
        elif args.command == "deploy":
            return run_deploy(args)
        elif args.command == "task-server":
            return _task_server(args)
        elif args.command == "demo":
            return _demo(args)
        elif args.command == "train":
            return _train(args)
    except KeyboardInterrupt:
        return 130
    except Stopped as stopped:
        return stopped.exit_status
    except ConfigurationError as exc:
        print(f"rollout-relay: {exc.message}", file=sys.stderr)
        return 2
    except StorageError as exc:
        print(f"rollout-relay: {exc.message}", file=sys.stderr)
        return 2
    except ConnectionRefusedByProxy as exc:
        print(f"rollout-relay worker: the proxy refused this worker: {exc}", file=sys.stderr)
        return 2
    except EngineUnavailableError as exc:
        print(f"rollout-relay worker: the engine cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
