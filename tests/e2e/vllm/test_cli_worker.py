"""``rollout-relay worker --backend vllm`` as its own process, on the tiny mixture-of-experts
model: it generates at teacher forcing's logprobs, reports its settings, refuses routing on
CPU naming why, and SIGTERM leaves none of its processes (vLLM's engine core included)."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
import pytest

from proxy.appkeys import POOL
from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from sdk.fidelity import check_fidelity
from tests.e2e.vllm.conftest import TIMEOUT_FACTOR, within
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e

HI = [{"role": "user", "content": "Hi there, which tools can you use?"}]


@pytest.fixture(scope="module")
async def moe_worker(
    moe_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[RunningProxy, asyncio.subprocess.Process, Path]]:
    """The proxy, the worker process, and the file its stderr goes to."""
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=30 * TIMEOUT_FACTOR,
        max_tokens=256,
        cache_dir=tmp_path_factory.mktemp("vllm-moe-cache"),
    )
    running = await start_proxy(config)
    command = [
        *(sys.executable, "-m", "rollout_relay.cli", "--log-level", "WARNING", "worker"),
        *("--proxy", running.worker_url, "--model", str(moe_model), "--name", "moe"),
        *("--backend", "vllm", "--enforce-eager", "--max-model-len", "2048"),
        *("--engine-arg", "max_num_seqs=4"),
    ]
    stderr = tmp_path_factory.mktemp("vllm-moe-worker") / "stderr.log"
    with stderr.open("wb") as sink:
        process = await asyncio.create_subprocess_exec(*command, stderr=sink)
    try:
        deadline = asyncio.get_running_loop().time() + 300 * TIMEOUT_FACTOR
        while not running.app[POOL].workers:
            assert process.returncode is None, "the worker process exited"
            assert asyncio.get_running_loop().time() < deadline, "the worker did not join"
            await asyncio.sleep(0.2)
        yield running, process, stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await running.stop()


@pytest.fixture
async def proxy(moe_worker: tuple[RunningProxy, Any, Path]) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(moe_worker[0].url) as client:
        yield client


async def test_the_moe_generates_at_teacher_forcings_logprobs(
    proxy: ProxyClient, moe_model: Path
) -> None:
    """The tiny MoE's turns on vLLM re-score by transformers' teacher forcing within 1e-4."""
    trial = await proxy.create_session(sampling={"temperature": 1.0})
    client = openai.AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
    await client.chat.completions.create(model="moe", messages=HI, max_tokens=24)  # type: ignore[arg-type]
    report = check_fidelity(
        await proxy.trajectories(trial.trial_id), HFEngine.load(moe_model).score
    )
    assert within(report), report


async def test_its_flags_reach_v1_models(proxy: ProxyClient) -> None:
    """--enforce-eager, --max-model-len and --engine-arg are what /v1/models reports, with
    the float32 the checkpoint is stored in."""
    trial = await proxy.create_session()
    async with aiohttp.ClientSession() as http, http.get(f"{trial.base_url}/models") as r:
        (model,) = (await r.json())["data"]
    (engine,) = model["engines"]
    assert engine == {
        "backend": "vllm",
        "logprobs_mode": "raw",
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 2048,
        "max_num_seqs": 4,
    }


async def test_routing_is_refused_naming_why(proxy: ProxyClient) -> None:
    """A session asking for routed experts is refused with routing_unsupported, saying that
    vLLM's CPU build cannot return them."""
    from sdk.exceptions import ProxyRequestError

    with pytest.raises(ProxyRequestError) as caught:
        await proxy.create_session(routed_experts=True)
    assert caught.value.code == "routing_unsupported"
    assert "Triton" in str(caught.value)
    assert "needs a GPU" in str(caught.value)


async def test_sigterm_leaves_no_process_of_the_worker(
    moe_worker: tuple[RunningProxy, asyncio.subprocess.Process, Path],
) -> None:
    """SIGTERM closes the engine: the worker exits, none of the processes it started
    (vLLM's engine core and its worker) is left, and it prints no traceback on its way
    out (vLLM's engine shut down twice printed one at every exit)."""
    _, process, stderr = moe_worker
    children = psutil.Process(process.pid).children(recursive=True)
    assert children, "vLLM's engine core runs in a process of its own"
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.wait(), 60 * TIMEOUT_FACTOR)
    _, alive = psutil.wait_procs(children, timeout=10 * TIMEOUT_FACTOR)
    assert alive == []
    printed = stderr.read_text(errors="replace")
    assert "Traceback" not in printed, printed[-3000:]
