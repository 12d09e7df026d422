"""The TRL rollout against a real proxy and hf worker on the tiny model: what it returns to
GRPOTrainer, and when it pushes the trainer's weights (a stand-in trainer object holding
a real model, so that the step can be moved by hand)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from openai import AsyncOpenAI

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.agent_loop import AgentLoopConfig, RemoteAgentLoop
from sdk.client import ProxyClient
from sdk.exceptions import RemoteAgentLoopError
from sdk.samples import BranchPolicy
from sdk.taskserver.base import RunSpec
from sdk.taskserver.inprocess import AgentFn, InProcessTaskServer
from sdk.trl import (
    BackgroundLoop,
    RelayRollout,
    needs_push,
    on_policy_gap,
    relay_reward,
)
from tests.e2e.conftest import TIMEOUT_FACTOR

ADMIN = "admin-secret"
KEYS = {"prompt_ids", "completion_ids", "logprobs", "env_mask"}
KEYS |= {"relay_reward", "relay_versions", "relay_trial_id"}


@dataclass(slots=True)
class Stack:
    loop: BackgroundLoop
    running: RunningProxy
    proxy: ProxyClient


@pytest.fixture
def relay(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    """A proxy (admin token set) and an hf worker on a background loop, as a trainer runs."""
    config = ProxyConfig(
        port=0, admin_token=ADMIN, max_tokens=24, cache_dir=tmp_path / "proxy-cache"
    )

    async def start() -> RunningProxy:
        running = await start_proxy(config)
        start_hf_worker(running, tiny_model_dir, worker_id="trl-hf")
        await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        return running

    with BackgroundLoop() as loop:
        running = loop.run(start())
        proxy = ProxyClient(running.url, admin_token=ADMIN)
        try:
            yield Stack(loop, running, proxy)
        finally:
            loop.run(proxy.aclose())
            loop.run(running.stop())


@dataclass(slots=True)
class Episode:
    task: str
    reward: float
    sampled: int  # completion tokens the agent was told it got, over its calls


@dataclass(slots=True)
class TwoCallAgent:
    """Two chat calls with the reply and a user message between them (context, mask 0);
    the reward is a function of what the first reply was (its token count)."""

    episodes: dict[str, Episode] = field(default_factory=dict)

    async def __call__(self, spec: RunSpec) -> Mapping[str, float]:
        trial_id = spec.base_url.rstrip("/").split("/")[-2]
        client = AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Work on {spec.task}."}]
        sampled = 0
        reward = 0.0
        try:
            for call in range(2):
                response = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=16,
                )
                assert response.usage is not None
                sampled += response.usage.completion_tokens
                if call == 0:
                    reward = response.usage.completion_tokens / 100
                message = response.choices[0].message
                messages.append({"role": "assistant", "content": message.content or ""})
                messages.append({"role": "user", "content": "Go on."})
        finally:
            await client.close()
        self.episodes[trial_id] = Episode(str(spec.task), reward, sampled)
        return {"reward": reward}


def _rollout(stack: Stack, agent: AgentFn, checkpoints: Path, **kwargs: Any) -> RelayRollout:
    loop = RemoteAgentLoop(
        stack.proxy,
        InProcessTaskServer(agent),
        AgentLoopConfig(
            agent="two-calls",
            max_attempts=1,
            branch_policy=BranchPolicy.LONGEST,
            sampling={"temperature": 1.0, "top_p": 1.0},
            timeout_seconds=120 * TIMEOUT_FACTOR,
        ),
    )
    return RelayRollout(stack.loop, stack.proxy, loop, checkpoints, **kwargs)


def _trainer(model_dir: Path) -> Any:
    """What the rollout reads of a GRPOTrainer: its step, model, tokenizer, accelerator."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return SimpleNamespace(
        state=SimpleNamespace(global_step=0),
        model=model,
        processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
    )


def _perturb(model: Any, seed: int) -> None:
    """What an optimizer step does to the weights, as far as sampling can tell."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.05
            parameter.add_(noise.to(parameter.dtype))


def test_needs_push_only_when_the_step_moved() -> None:
    """The weights go out when the step differs from the served version, never backwards."""
    assert not needs_push(0, 0)
    assert needs_push(0, 1)
    assert needs_push(2, 5)
    assert not needs_push(5, 5)
    with pytest.raises(ValueError, match="only increase"):
        needs_push(5, 4)


def test_relay_reward_returns_the_forwarded_rewards() -> None:
    """The reward function gives back, per completion, the reward the rollout forwarded."""
    assert relay_reward(["a", "b", "c"], [1.0, None, 0]) == [1.0, None, 0.0]
    with pytest.raises(ValueError, match="2 rewards for 3 completions"):
        relay_reward(["a", "b", "c"], [1.0, 0.0])


def test_one_completion_per_prompt_is_required(relay: Stack, tmp_path: Path) -> None:
    """A branch policy that yields several samples per episode is refused up front."""
    loop = RemoteAgentLoop(
        relay.proxy, InProcessTaskServer(TwoCallAgent()), AgentLoopConfig(agent="x")
    )
    with pytest.raises(ValueError, match="one completion per prompt"):
        RelayRollout(relay.loop, relay.proxy, loop, tmp_path)


def test_output_is_one_aligned_rewarded_completion_per_prompt(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every prompt gets its own episode's ids, logprobs, env_mask, versions and reward."""
    agent = TwoCallAgent()
    rollout = _rollout(relay, agent, tmp_path / "checkpoints")
    prompts = ["task-a", "task-a", "task-b", "task-b", "task-c"]
    out = rollout(prompts, _trainer(tiny_model_dir))
    assert set(out) == KEYS
    assert all(len(values) == len(prompts) for values in out.values())
    assert len(set(out["relay_trial_id"])) == len(prompts)
    for i, prompt in enumerate(prompts):
        episode = agent.episodes[out["relay_trial_id"][i]]
        assert episode.task == prompt
        assert out["relay_reward"][i] == episode.reward
        width = len(out["completion_ids"][i])
        assert width == len(out["logprobs"][i]) == len(out["env_mask"][i])
        assert width == len(out["relay_versions"][i])
        mask = out["env_mask"][i]
        assert set(mask) == {0, 1}  # the context between the two calls is not trained
        assert sum(mask) == episode.sampled
        assert out["relay_versions"][i] == [0 if m else -1 for m in mask]
        assert out["prompt_ids"][i]
        assert all(lp <= 0.0 for lp, m in zip(out["logprobs"][i], mask, strict=True) if m)
    batch = rollout.history[-1]
    assert batch.step == 0
    assert batch.push is None
    assert batch.rewards == out["relay_reward"]


def test_weights_are_pushed_once_per_step_before_sampling(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A moved step saves the trainer's model and serves it before the batch is sampled:
    the batch then matches the new weights, not the old ones; an unmoved step pushes
    nothing; old checkpoints are pruned."""
    checkpoints = tmp_path / "checkpoints"
    rollout = _rollout(relay, TwoCallAgent(), checkpoints, keep_checkpoints=1, measure_gap=True)
    trainer = _trainer(tiny_model_dir)
    original = _trainer(tiny_model_dir).model
    prompts = ["task-a"] * 3

    rollout(prompts, trainer)
    assert rollout.history[-1].push is None
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert relay.loop.run(relay.proxy.weights())["version"] == 0

    _perturb(trainer.model, seed=1)
    trainer.state.global_step = 1
    rollout(prompts, trainer)
    batch = rollout.history[-1]
    assert batch.push is not None
    assert batch.push.version == 1
    assert batch.push.path == checkpoints / "step-1"
    assert (batch.push.path / "config.json").is_file()
    served = relay.loop.run(relay.proxy.weights())
    assert served["version"] == 1
    assert {w["version"] for w in served["workers"]} == {1}
    assert batch.step == 1
    assert batch.versions == [1]
    assert batch.off_step_tokens == 0
    assert batch.gap is not None
    assert batch.gap <= 1e-4  # sampled with the trainer's new weights...
    assert on_policy_gap(original, batch.samples) > 1e-3  # ...which are not the old ones

    rollout(prompts, trainer)  # same step: nothing to push
    assert rollout.history[-1].push is None
    assert rollout.history[-1].versions == [1]

    _perturb(trainer.model, seed=2)
    trainer.state.global_step = 3
    rollout(prompts, trainer)
    assert rollout.history[-1].versions == [3]
    assert rollout.history[-1].gap is not None
    assert rollout.history[-1].gap <= 1e-4
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-3"]

    trainer.state.global_step = 2
    with pytest.raises(ValueError, match="only increase"):
        rollout(prompts, trainer)


def test_a_failed_episode_fails_the_batch_and_stops_the_others(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A task that fails every attempt raises the agent loop's error to the trainer, and
    the episodes still running are cancelled rather than left behind."""
    cancelled: list[str] = []

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        if spec.task.name == "bad":
            raise RuntimeError("the sandbox broke")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(spec.task.name)
            raise
        return {"reward": 1.0}

    rollout = _rollout(relay, agent, tmp_path / "checkpoints")
    with pytest.raises(RemoteAgentLoopError, match="the sandbox broke"):
        rollout(["slow-1", "bad", "slow-2"], _trainer(tiny_model_dir))
    assert sorted(cancelled) == ["slow-1", "slow-2"]
    assert rollout.history == []


def test_a_proxy_ahead_of_the_trainer_is_refused_not_sampled(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The first call asks the proxy its version: a trainer behind it gets an error before
    anything is sampled; a trainer at that step samples with it without pushing."""
    relay.loop.run(relay.proxy.update_weights(2, path=str(tiny_model_dir)))
    rollout = _rollout(relay, TwoCallAgent(), tmp_path / "checkpoints")
    trainer = _trainer(tiny_model_dir)
    with pytest.raises(ValueError, match="only increase"):
        rollout(["task-a"], trainer)
    assert rollout.history == []
    trainer.state.global_step = 2
    rollout(["task-a", "task-a"], trainer)
    assert rollout.history[-1].push is None
    assert rollout.history[-1].versions == [2]
