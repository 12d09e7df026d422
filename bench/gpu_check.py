"""The ``hf`` backend on a GPU, end to end: ``python -m bench.gpu_check --device cuda``.

One process runs a real proxy and an ``hf`` worker on ``--device`` (the relay over a
loopback WebSocket, as everywhere), and checks what a trainer relies on there:

1. turns through the agent API are recorded with logprobs that teacher forcing on the
   same device reproduces (fidelity), and the ones a CPU trainer would compute;
2. ``POST /weights`` loads a new checkpoint into the GPU model in place: the next turns
   score as the checkpoint (not as the old weights) and carry the new version;
3. the engine's own sampling rate on that device (tokens per second, one request).

It prints one JSON object (and writes it to ``--out``). Nothing here runs in CI: it is
the check to run where a GPU is lent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from proxy.config import ProxyConfig
from rollout_relay.embedded import start_hf_worker, start_proxy
from sdk.client import ProxyClient
from sdk.fidelity import check_fidelity, check_fidelity_by_version
from worker_client.backends.hf import HFEngine
from worker_client.checkpoints import perturbed_checkpoint
from worker_client.engine import SamplingParams


async def _turns(client: ProxyClient, n: int, seed: int) -> dict[str, Any]:
    trial = await client.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
    headers = {"Authorization": f"Bearer {trial.api_key}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about the sea."}]
    async with aiohttp.ClientSession(headers=headers) as http:
        for i in range(n):
            body = {"model": "m", "messages": messages, "max_tokens": 48, "seed": seed + i}
            async with http.post(f"{trial.base_url}/chat/completions", json=body) as response:
                reply = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"chat failed: {reply}")
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
                {"role": "user", "content": f"And then {i}?"},
            ]
    return await client.trajectories(trial.trial_id)


async def _rate(engine: HFEngine, tokens: int) -> float:
    """Tokens per second of one request sampling ``tokens`` tokens (no stop token)."""
    start = time.perf_counter()
    made = 0
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0)
    async for chunk in engine.generate("rate", [1, 2, 3, 4], params):
        made += len(chunk.token_ids)
    return made / (time.perf_counter() - start)


async def run(model: Path, device: str) -> dict[str, Any]:
    import torch
    import transformers

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    checkpoint = perturbed_checkpoint(model, work / "step-1", seed=1)
    report: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    running = await start_proxy(ProxyConfig(port=0, cache_dir=work / "proxy-cache"))
    try:
        start_hf_worker(running, model, worker_id=f"hf-{device}", device=device)
        await running.wait_for_workers(within_seconds=120)
        here = {0: HFEngine.load(model, device=device), 1: HFEngine.load(checkpoint, device=device)}
        on_cpu = HFEngine.load(model)
        async with ProxyClient(running.url) as client:
            before = await _turns(client, 3, seed=1)
            report["fidelity_v0_same_device"] = check_fidelity(before, here[0].score).max_abs_error
            report["fidelity_v0_cpu_trainer"] = check_fidelity(before, on_cpu.score).max_abs_error
            report["sampled_tokens_v0"] = sum(
                sum(t["response_mask"]) for t in before["trajectories"]
            )
            start = time.perf_counter()
            answer = await client.update_weights(1, str(checkpoint))
            report["update_seconds"] = round(time.perf_counter() - start, 4)
            report["update_answer"] = answer
            after = await _turns(client, 3, seed=11)
            versions = {
                v
                for traj in after["trajectories"]
                for v, m in zip(traj["response_versions"], traj["response_mask"], strict=True)
                if m
            }
            report["versions_after_update"] = sorted(versions)
            report["fidelity_v1"] = check_fidelity_by_version(
                after, {1: here[1].score}
            ).max_abs_error
            report["error_against_old_weights"] = check_fidelity(after, here[0].score).max_abs_error
        report["engine_tokens_per_second"] = round(await _rate(here[0], 256), 1)
    finally:
        await running.stop()
    report["ok"] = (
        report["fidelity_v0_same_device"] <= 1e-4
        and report["fidelity_v1"] <= 1e-4
        and report["versions_after_update"] == [1]
        and report["error_against_old_weights"] > 1e-2
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a causal-LM directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = asyncio.run(run(args.model, args.device))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
