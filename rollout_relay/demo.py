"""``rollout-relay demo``: the proxy and an ``hf`` worker on the tiny model in this process,
one agent episode through them (``sdk.demo``), and what a trainer gets, told as a short
story. Logs go to a file unless ``-v``; with ``--keep`` the proxy stays up so the episode
can be read in the viewer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from proxy.config import ProxyConfig
from proxy.logs import LogFormat, RequestContextFilter, make_formatter
from rollout_relay.embedded import start_hf_worker, start_proxy

Say = Callable[[str], None]

_WHAT_AGENTS_DO = {
    "history_rewritten": "replaced its history with a summary (the session forks: a new root)",
    "resumed_older_point": "went back to an earlier point and asked again (another branch)",
}


def log_to_file(path: Path) -> None:
    """Every log line to ``path``; the console keeps errors only (the story is printed)."""
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setLevel(logging.ERROR)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(make_formatter(LogFormat.TEXT))
    file_handler.addFilter(RequestContextFilter())
    root.addHandler(file_handler)
    try:  # transformers' per-load progress bars are noise here
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


async def run_demo(
    config: ProxyConfig,
    model_dir: Path,
    *,
    turns: int,
    seed: int,
    keep: bool = False,
    say: Say = print,
) -> int:
    """Run the episode; 0 when its trajectories re-score within tolerance."""
    from sdk.client import ProxyClient
    from sdk.demo import Workspace, describe, run_episode
    from sdk.fidelity import check_fidelity
    from sdk.samples import build_samples
    from worker_client.backends.hf import HFEngine

    running = await start_proxy(config)
    try:
        start_hf_worker(running, model_dir, worker_id="demo-hf")
        await running.wait_for_workers()
        say(f"[2/5] proxy up at {running.url} (no authentication: a local demo on loopback);")
        say("      a worker (hf backend, the tiny model on CPU) dialed out to it and joined")
        async with ProxyClient(running.url) as proxy:
            trial = await proxy.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
            say(f"[3/5] a trainer registered trial {trial.trial_id}; its agent is told only")
            say(f"      the base URL {trial.base_url}")
            with tempfile.TemporaryDirectory() as tmp:
                log = await run_episode(trial, Workspace(Path(tmp)), turns=turns, seed=seed)
            say(
                f"[4/5] the agent (the official openai client) made {len(log.received)} model "
                f"calls and ran {log.tool_runs} tools"
            )
            for branch in log.branches_made:
                say(f"      on purpose, it {_WHAT_AGENTS_DO.get(branch, branch)}")
            await proxy.complete(trial.trial_id, reward=1.0 if log.tool_runs else 0.0)
            export = await proxy.trajectories(trial.trial_id)
            say("[5/5] what the trainer gets:")
            say(describe(export))
            samples = build_samples(export)
            trained = sum(s.sampled_tokens for s in samples)
            say(
                f"  {len(samples)} training samples, {trained} sampled tokens trained once each "
                "(a turn shared by branches trains in one of them)"
            )
            engine = HFEngine.load(model_dir)
            report = check_fidelity(export, engine.score)
            await engine.close()
            verdict = "PASS" if report.ok() else "FAIL"
            say(
                f"  fidelity {verdict}: the {report.sampled_tokens} sampled tokens re-scored by "
                f"teacher forcing match their recorded logprobs within "
                f"{report.max_abs_error:.1e}"
            )
            if not report.ok():
                # What a failure is diagnosed from: the episode as the trainer got it.
                kept = Path(tempfile.gettempdir()) / "rollout-relay-demo-export.json"
                kept.write_text(json.dumps(export))
                say(
                    f"  the largest gap is at (trajectory, response index) "
                    f"{report.worst_position}; the export is kept in {kept}"
                )
            viewer = f"{running.url}/ui/#{trial.trial_id}"
            if keep:
                say(f"viewer: {viewer}  (the proxy stays up: Ctrl-C to stop)")
                await asyncio.Event().wait()  # until a signal cancels it
            else:
                say(f"viewer: {viewer}  (run `rollout-relay demo --keep` to keep it up)")
                await proxy.delete(trial.trial_id)
            return 0 if report.ok() else 1
    finally:
        await running.stop()
