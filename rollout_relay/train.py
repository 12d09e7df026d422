"""``rollout-relay train``: the proxy and an ``hf`` worker on the tiny model in this
process, and TRL's GRPOTrainer training that same model through them (``sdk.train``).

The proxy and the worker run on a background event loop (``sdk.trl.BackgroundLoop``):
TRL calls its rollout synchronously from inside ``trainer.train()`` on the main thread,
and the proxy, the worker and the agents must keep running between those calls. The
worker is a real one that dialed out to the proxy over its WebSocket with the worker token,
and loads each checkpoint the trainer writes when the proxy tells it to (``POST /weights``
with the admin token), exactly as a remote one would; only the loopback is local.
"""

from __future__ import annotations

import secrets
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy

Say = Callable[[str], None]

# Steps averaged at each end of the run to say how far the reward moved.
_ENDS = 5


async def _start(config: ProxyConfig, model_dir: Path) -> RunningProxy:
    running = await start_proxy(config)
    try:
        start_hf_worker(running, model_dir, worker_id="train-hf", token=config.worker_token or "")
        await running.wait_for_workers()
    except BaseException:
        await running.stop()
        raise
    return running


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
    say: Say = print,
) -> int:
    """Train; 0 when every step was on-policy (gap and versions), 1 otherwise."""
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
    )
    config = ProxyConfig(
        host="127.0.0.1",
        port=0,
        admin_token=secrets.token_urlsafe(24),
        worker_token=secrets.token_urlsafe(24),
    )
    started = time.monotonic()
    with BackgroundLoop("relay-train") as loop:
        running = loop.run(_start(config, model_dir))
        try:
            say(f"[2/3] proxy up at {running.url}; a worker (hf backend, the model on CPU) joined")
            say(
                f"[3/3] GRPO (TRL {_trl_version()}): {steps} steps of {prompts_per_step} prompts x "
                f"{generations} agent episodes; reward 1 when the agent calls {REWARDED_TOOL}"
            )
            report = train(
                running.url,
                model_dir,
                out_dir,
                loop=loop,
                admin_token=config.admin_token,
                settings=settings,
                say=say,
            )
        finally:
            loop.run(running.stop())
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
