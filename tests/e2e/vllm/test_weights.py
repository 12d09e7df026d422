"""``POST /weights`` on the real vLLM engine: after the 200 every sampled logprob is the NEW
checkpoint's teacher forcing (vLLM's CPU build kept the old output head before: 0.94 off),
a checkpoint that cannot load leaves the old weights serving, and ``mode: "abort"``
continues a running reply on the new weights."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from sdk.client import ProxyClient, TrialSession
from sdk.exceptions import ProxyRequestError
from sdk.fidelity import FidelityReport, check_fidelity, check_fidelity_by_version
from tests.e2e.vllm.conftest import MODELS, Served, within
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-4
HI = [{"role": "user", "content": "Hi there, which tools can you use?"}]


@pytest.fixture
async def proxy(served: Served) -> Any:
    async with ProxyClient(served.proxy.url) as client:
        yield client


async def _turns(proxy: ProxyClient, count: int = 3) -> dict[str, Any]:
    """``count`` one-turn trials at temperature 1; their trajectories in one export."""
    trajectories: list[Any] = []
    for _ in range(count):
        trial = await proxy.create_session(sampling={"temperature": 1.0})
        client = openai.AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
        await client.chat.completions.create(model="tiny", messages=HI, max_tokens=24)  # type: ignore[arg-type]
        trajectories += (await proxy.trajectories(trial.trial_id))["trajectories"]
    return {"trajectories": trajectories}


def _report(export: dict[str, Any], teacher: HFEngine) -> FidelityReport:
    report = check_fidelity(export, teacher.score)
    assert report.sampled_tokens > 0
    return report


async def test_after_an_update_the_logprobs_are_the_new_checkpoints(
    proxy: ProxyClient, text_model: Path, other_checkpoint: Path
) -> None:
    """After POST /weights answers 200, what vLLM samples is the new checkpoint's within
    1e-4 and far from the old one's; a checkpoint of other shapes is refused and the
    new weights keep serving, at their version."""
    old, new = HFEngine.load(text_model), HFEngine.load(other_checkpoint)
    assert within(_report(await _turns(proxy), old), TOLERANCE)
    report = await proxy.update_weights(1, str(other_checkpoint))
    assert report["version"] == 1
    export = await _turns(proxy)
    assert within(_report(export, new), TOLERANCE)
    assert _report(export, old).max_abs_error > 1e-2

    from worker_client.tiny_model import SHIPPED_TINY_MODEL, widen_heads

    wider = MODELS / "text-hd64"
    if not (wider / "model.safetensors").is_file():
        widen_heads(SHIPPED_TINY_MODEL, wider, head_dim=64)
    with pytest.raises(ProxyRequestError) as caught:
        await proxy.update_weights(2, str(wider))
    assert "the served model's F32 [64, 64]" in str(caught.value)
    assert (await proxy.weights())["version"] == 1
    assert within(_report(await _turns(proxy), new), TOLERANCE)


async def test_an_abort_update_continues_a_running_reply_on_the_new_weights(
    served: Served, proxy: ProxyClient, text_model: Path, other_checkpoint: Path
) -> None:
    """mode "abort" mid-stream: the reply goes on after the update, its tokens sampled by
    each version at that version's teacher forcing."""
    before = (await proxy.weights())["version"]
    trial: TrialSession = await proxy.create_session(sampling={"temperature": 2.0})
    body = {"model": "tiny", "messages": HI, "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{trial.base_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {trial.api_key}"},
        ) as r:
            assert r.status == 200
            await r.content.readline()
            update = asyncio.create_task(
                proxy.update_weights(before + 1, str(text_model), mode="abort")
            )
            async for _ in r.content:
                pass
        await update
    export = await proxy.trajectories(trial.trial_id)
    scorers = {
        before: HFEngine.load(other_checkpoint).score,
        before + 1: HFEngine.load(text_model).score,
    }
    report = check_fidelity_by_version(export, scorers)
    assert within(report, TOLERANCE), report
