"""``rollout-relay train``: the proxy and a worker on the tiny model, and TRL's
GRPOTrainer training that same model through them (``sdk.train``).

The worker is an ``hf`` one in this process (``backend="hf"``), or a ``vllm`` one in a
process of its own started from vLLM's side environment (``backend="vllm"``,
``rollout_relay.worker_process``): vLLM pins its own torch and transformers, the trainer
needs TRL's. Given ``proxy_url``, neither is started: the run trains through a proxy that
is already up, its workers serving ``model_dir`` as version 0.

The proxy and the worker run on a background event loop (``sdk.trl.BackgroundLoop``):
TRL calls its rollout synchronously from inside ``trainer.train()`` on the main thread,
and the proxy, the worker and the agents must keep running between those calls. The
worker is a real one that dialed out to the proxy over its WebSocket with the worker token,
and loads each checkpoint the trainer writes when the proxy tells it to (``POST /weights``
with the admin token), exactly as a remote one would; only the loopback is local.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from rollout_relay.worker_process import (
    DEFAULT_VLLM_PYTHON,
    WorkerProcess,
    vllm_worker_command,
    vllm_worker_env,
)

if TYPE_CHECKING:
    from sdk.trl import BackgroundLoop

Say = Callable[[str], None]

# Steps averaged at each end of the run to say how far the reward moved.
_ENDS = 5
# How long vLLM may take to start and its worker to join (20 s on an idle core; minutes
# on two loaded ones).
VLLM_JOIN_SECONDS = 900.0


@dataclass(frozen=True, slots=True)
class Serving:
    """Where the trainer sends its episodes and weights."""

    url: str
    admin_token: str | None


async def _start(config: ProxyConfig, model_dir: Path) -> RunningProxy:
    running = await start_proxy(config)
    try:
        start_hf_worker(running, model_dir, worker_id="train-hf", token=config.worker_token or "")
        await running.wait_for_workers()
    except BaseException:
        await running.stop()
        raise
    return running


@contextlib.contextmanager
def _serve_hf(loop: BackgroundLoop, model_dir: Path, say: Say) -> Iterator[Serving]:
    config = _config()
    running = loop.run(_start(config, model_dir))
    try:
        say(f"[2/3] proxy up at {running.url}; a worker (hf backend, the model on CPU) joined")
        yield Serving(running.url, config.admin_token)
    finally:
        loop.run(running.stop())


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM ends this process through its ``finally`` blocks (exit status 143), as
    Ctrl-C does, instead of at once: the worker process runs in a session of its own and
    would outlive a trainer that never stopped it. A second SIGTERM does not cut those
    blocks short (it would interrupt stopping the worker); it is only acknowledged on
    stderr. A third raises again: ``WorkerProcess.stop`` still kills the worker's group."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = 0

    def exit_now(signum: int, frame: object) -> None:
        nonlocal received
        received += 1
        if received == 2:
            print(
                "rollout-relay train: SIGTERM again: still stopping the worker and the "
                "proxy; a third SIGTERM cuts that short",
                file=sys.stderr,
                flush=True,
            )
            return
        if received > 2:
            print(
                "rollout-relay train: SIGTERM a third time: cutting the cleanup short "
                "(the worker's processes are killed)",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _serve_vllm(
    loop: BackgroundLoop, model_dir: Path, out_dir: Path, vllm_python: Path, say: Say
) -> Iterator[Serving]:
    config = _config()
    running = loop.run(start_proxy(config))
    worker: WorkerProcess | None = None
    try:
        log_path = out_dir / "vllm-worker.log"
        worker = WorkerProcess.start(
            vllm_worker_command(vllm_python, running.worker_url, model_dir, name=model_dir.name),
            vllm_worker_env(vllm_python, config.worker_token or ""),
            log_path,
        )
        say(
            f"[2/3] proxy up at {running.url}; starting a vllm worker (vLLM's CPU build, "
            f"float32, eager) in its own process from {vllm_python} (log: {log_path})"
        )
        joined = loop.run(worker.joined(running, VLLM_JOIN_SECONDS))
        say(f"      the vllm worker dialed out to the proxy and joined after {joined:.0f}s")
        yield Serving(running.url, config.admin_token)
    finally:
        try:
            if worker is not None:
                exited = worker.exit_status()
                clean = worker.stop()
                if exited is not None:
                    say(f"the vllm worker had exited (status {exited}); see its log")
                elif clean:
                    say("the vllm worker stopped (SIGTERM; vLLM's engine core closed)")
                else:
                    say(
                        "the vllm worker did not stop on SIGTERM in time: its processes were killed"
                    )
        finally:
            loop.run(running.stop())


@contextlib.contextmanager
def _serve_external(url: str, admin_token: str | None, say: Say) -> Iterator[Serving]:
    say(f"[2/3] training through the proxy at {url} and the workers it has")
    yield Serving(url, admin_token)


def _config() -> ProxyConfig:
    return ProxyConfig(
        host="127.0.0.1",
        port=0,
        admin_token=secrets.token_urlsafe(24),
        worker_token=secrets.token_urlsafe(24),
    )


def run_train(
    model_dir: Path,
    out_dir: Path,
    *,
    steps: int,
    seed: int,
    learning_rate: float,
    generations: int,
    prompts_per_step: int,
    torch_threads: int = 1,
    routed_experts: bool = False,
    backend: str = "hf",
    vllm_python: Path = DEFAULT_VLLM_PYTHON,
    proxy_url: str | None = None,
    admin_token: str | None = None,
    say: Say = print,
) -> int:
    """Train; 0 when every step was on-policy (gap and versions), 1 otherwise.

    ``backend``: the worker started for the run, ``hf`` (in this process) or ``vllm`` (a
    process from the Python of vLLM's side environment, ``vllm_python``). ``proxy_url``
    (with ``admin_token``): start neither, train through that proxy's workers."""
    import torch

    from sdk.train import GAP_LIMIT, REWARDED_TOOL, TrainSettings, train
    from sdk.trl import BackgroundLoop

    # The tiny model's matrices are too small to gain from parallel kernels, and the
    # worker's and the trainer's torch work share one process: with several intra-op
    # threads on shared cores, OpenMP's spin-waits made sampling 10-30x slower.
    torch.set_num_threads(torch_threads)
    # TRL 1.16 still calls transformers' gradient_checkpointing names, each call a warning.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")

    settings = TrainSettings(
        steps=steps,
        seed=seed,
        learning_rate=learning_rate,
        generations=generations,
        prompts_per_step=prompts_per_step,
        routed_experts=routed_experts,
        backend=None if proxy_url is not None else backend,
    )
    started = time.monotonic()
    with BackgroundLoop("relay-train") as loop:
        serving: contextlib.AbstractContextManager[Serving]
        if proxy_url is not None:
            serving = _serve_external(proxy_url, admin_token, say)
        elif backend == "vllm":
            out_dir.mkdir(parents=True, exist_ok=True)
            serving = _serve_vllm(loop, model_dir, out_dir, vllm_python, say)
        else:
            serving = _serve_hf(loop, model_dir, say)
        with _sigterm_exits(), serving as served:
            say(
                f"[3/3] GRPO (TRL {_trl_version()}): {steps} steps of {prompts_per_step} prompts x "
                f"{generations} agent episodes; reward 1 when the agent calls {REWARDED_TOOL}"
            )
            report = train(
                served.url,
                model_dir,
                out_dir,
                loop=loop,
                admin_token=served.admin_token,
                settings=settings,
                say=say,
            )
    rewards = [s.mean_reward for s in report.steps]
    ends = min(_ENDS, max(1, len(rewards) // 2))
    say(
        f"reward: {statistics.fmean(rewards[:ends]):.2f} over the first {ends} steps -> "
        f"{statistics.fmean(rewards[-ends:]):.2f} over the last {ends}"
    )
    off = sum(s.off_step_tokens for s in report.steps)
    tokens = sum(s.sampled_tokens for s in report.steps)
    replayed = " with the routing replayed" if routed_experts else ""
    say(
        f"on-policy: largest gap{replayed} {report.max_gap:.1e} (limit {GAP_LIMIT:.0e}); "
        f"{tokens - off} of {tokens} sampled tokens carry the version of their step"
    )
    if routed_experts:
        own = max(s.gap for s in report.steps)
        mean = statistics.fmean(s.gap_mean for s in report.steps)
        mean_r3 = statistics.fmean(s.gap_r3_mean for s in report.steps)
        say(
            f"routing replay: mean gap {mean_r3:.1e} replayed, {mean:.1e} with the trainer's "
            f"own routing (largest {own:.1e})"
        )
    say(
        f"training {report.seconds:.0f}s, all {time.monotonic() - started:.0f}s; "
        f"plot {out_dir / 'train.png'}, figures {out_dir / 'train.json'}"
    )
    return 0 if report.on_policy else 1


def _trl_version() -> str:
    import trl

    return str(trl.__version__)
