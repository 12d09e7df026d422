"""The TRL rollout against a real proxy and hf worker on the tiny model: what it returns to
GRPOTrainer, and when it pushes the trainer's weights (a stand-in trainer object holding
a real model, so that the step can be moved by hand)."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from openai import AsyncOpenAI

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.agent_loop import AgentLoopConfig, RemoteAgentLoop, RolloutResult
from sdk.client import ProxyClient
from sdk.exceptions import RemoteAgentLoopError
from sdk.samples import BranchPolicy, Sample
from sdk.taskserver.base import RunSpec
from sdk.taskserver.inprocess import AgentFn, InProcessTaskServer
from sdk.trl import (
    BackgroundLoop,
    RelayRollout,
    RolloutBatch,
    needs_push,
    on_policy_gap,
    relay_reward,
    rollout_output,
)
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.sdk.inprocess_agents import VersionBumpAgent, chat_calls, one_call

ADMIN = "admin-secret"
KEYS = {"prompt_ids", "completion_ids", "logprobs", "env_mask"}
KEYS |= {"relay_reward", "relay_versions", "relay_trial_id", "relay_agent", "relay_agent_kind"}


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


def _trainer(model_dir: Path, accelerator: Any = None) -> Any:
    """What the rollout reads of a GRPOTrainer: its step, model, tokenizer and accelerate's
    ``Accelerator`` (a real one, single process on CPU, unless given)."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return SimpleNamespace(
        state=SimpleNamespace(global_step=0),
        model=model,
        processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
        accelerator=accelerator or Accelerator(cpu=True),
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
    assert len(rollout.history) == 0


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
    assert len(rollout.history) == 0
    trainer.state.global_step = 2
    rollout(["task-a", "task-a"], trainer)
    assert rollout.history[-1].push is None
    assert rollout.history[-1].versions == [2]


def _live(cls: type) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is cls)


def test_many_steps_keep_only_the_last_batch(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """After 40 steps the rollout holds one batch (its results and samples), not 40: a
    long run stays flat in memory."""
    rollout = _rollout(relay, one_call, tmp_path / "checkpoints")
    trainer = _trainer(tiny_model_dir)
    before = (_live(RolloutBatch), _live(RolloutResult), _live(Sample))
    for _ in range(40):
        rollout(["task-a", "task-b"], trainer)
    assert len(rollout.history) == 1
    assert _live(RolloutBatch) - before[0] == 1
    assert _live(RolloutResult) - before[1] == 2
    assert _live(Sample) - before[2] == 2


def test_tokens_older_than_the_staleness_limit_leave_env_mask(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An episode whose weights moved from the trainer's version 2 to 4 between its two
    calls: the first call's tokens (two versions old) get env_mask 0 and version -1."""
    relay.loop.run(relay.proxy.update_weights(2, path=str(tiny_model_dir)))
    agent = VersionBumpAgent(relay.running.url, ADMIN, 4, str(tiny_model_dir))
    rollout = _rollout(relay, agent, tmp_path / "checkpoints")
    trainer = _trainer(tiny_model_dir)
    trainer.state.global_step = 2
    out = rollout(["task-a"], trainer)
    first, second = agent.calls[out["relay_trial_id"][0]]
    mask = out["env_mask"][0]
    assert sum(mask) == second
    assert mask[:first] == [0] * first
    assert out["relay_versions"][0] == [4 if m else -1 for m in mask]
    (result,) = rollout.history[-1].results
    assert result.current_version == 4
    assert result.samples[0].stale_tokens == first


class _Process:
    """accelerate's side of one of several processes, as TRL's trainer holds it: the
    processes meet at ``wait_for_everyone`` (a barrier here, across threads, where
    accelerate uses torch.distributed) and all take part in ``get_state_dict``."""

    def __init__(self, index: int, barrier: threading.Barrier) -> None:
        self.process_index = index
        self.is_main_process = index == 0
        self.barrier = barrier
        self.gathered = 0

    def wait_for_everyone(self) -> None:
        self.barrier.wait()

    def get_state_dict(self, model: Any) -> dict[str, Any]:
        self.gathered += 1
        return dict(model.state_dict())

    def unwrap_model(self, model: Any) -> Any:
        return model


def _two_processes(
    relay: Stack, tiny_model_dir: Path, checkpoints: Path, agent: AgentFn
) -> tuple[list[RelayRollout], list[Any]]:
    barrier = threading.Barrier(2, timeout=120 * TIMEOUT_FACTOR)
    trainers = [_trainer(tiny_model_dir, _Process(i, barrier)) for i in range(2)]
    return [_rollout(relay, agent, checkpoints) for _ in trainers], trainers


def test_several_processes_push_once_and_sample_after_the_push(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two processes at step 1: both gather the weights, only the main one saves and
    pushes them, the other waits for the push and samples with version 1 too."""
    rollouts, trainers = _two_processes(relay, tiny_model_dir, tmp_path / "ckpt", one_call)
    pushed: list[int] = []
    real_update = relay.proxy.update_weights

    async def counted(version: int, path: str | None = None, mode: str = "wait") -> Any:
        pushed.append(version)
        return await real_update(version, path=path, mode=mode)

    relay.proxy.update_weights = counted  # type: ignore[method-assign]
    for trainer in trainers:
        _perturb(trainer.model, seed=1)
        trainer.state.global_step = 1
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda i: rollouts[i](["task-a"], trainers[i]), range(2)))
    assert pushed == [1]
    assert [t.accelerator.gathered for t in trainers] == [1, 1]
    assert rollouts[0].history[-1].push is not None
    assert rollouts[1].history[-1].push is None
    assert [r.served_version for r in rollouts] == [1, 1]
    for out in outs:
        assert out["relay_versions"][0] == [1 if m else -1 for m in out["env_mask"][0]]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-1"]


def test_a_main_process_that_fails_to_push_fails_the_others_too(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The main process cannot write the checkpoint: it raises, and the other process,
    released from the barrier, finds the step not served and raises instead of sampling
    with the old weights or waiting for ever."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    rollouts, trainers = _two_processes(relay, tiny_model_dir, blocked, one_call)
    for trainer in trainers:
        trainer.state.global_step = 1
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(rollouts[i], ["task-a"], trainers[i]) for i in range(2)]
        with pytest.raises(OSError, match="not-a-directory"):
            futures[0].result()
        with pytest.raises(RuntimeError, match="did not push step 1"):
            futures[1].result()
    assert relay.loop.run(relay.proxy.weights())["version"] == 0


def test_a_trainer_with_trls_own_tools_is_refused(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A GRPOTrainer with tools would run its own tool loop and ignore env_mask: the
    rollout refuses it before running any episode."""
    agent = TwoCallAgent()
    rollout = _rollout(relay, agent, tmp_path / "checkpoints")

    def read_file(path: str) -> str:
        """Read a file.

        Args:
            path: the file.
        """
        return path

    trainer = _grpo_trainer(tiny_model_dir, tmp_path, rollout)
    # What GRPOTrainer(tools=[read_file]) sets; TRL 1.16 refuses tools= outright for the
    # tiny model's chat template (it knows no response schema for it).
    trainer.tools = [read_file]
    with pytest.raises(ValueError, match="ignore env_mask"):
        trainer._generate_and_score_completions([{"prompt": "task-a"}, {"prompt": "task-a"}])
    assert agent.episodes == {}


def _grpo_trainer(model_dir: Path, out: Path, rollout: Any, **kwargs: Any) -> Any:
    """TRL's GRPOTrainer on CPU in float32, two episodes per group."""
    import os

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        beta=0.0,
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
        reward_funcs=relay_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["task-a", "task-a"]}),
        processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
        rollout_func=rollout,
        **kwargs,
    )


@dataclass(slots=True)
class RankedAgent:
    """Two chat calls (context between them: env_mask 0); the first episode to finish
    gets reward 1, the next 0, so a group of two has advantages of both signs."""

    finished: int = 0

    async def __call__(self, spec: RunSpec) -> Mapping[str, float]:
        await chat_calls(spec, 2)
        self.finished += 1
        return {"reward": 1.0 if self.finished == 1 else 0.0}


def _logit_grads(trainer: Any, batch: dict[str, Any]) -> Any:
    """TRL's own loss on ``batch``, backpropagated: per completion token, the loss's
    gradient at the final hidden state that scored it (TRL 1.16 fuses the LM head into
    the logprob computation, so the hidden state feeds that token's logprob alone)."""
    model = trainer.model
    seen: list[Any] = []

    def keep(_module: Any, _args: Any, output: Any) -> None:
        output.retain_grad()
        seen.append(output)

    handle = model.model.norm.register_forward_hook(keep)
    try:
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
    finally:
        handle.remove()
    (hidden,) = seen
    width = batch["completion_ids"].size(1)
    grads = hidden.grad[:, -width - 1 : -1, :]
    return grads.norm(dim=-1), grads


def test_the_mask_and_the_reward_reach_trls_loss(
    relay: Stack, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Through TRL's real GRPO batch and loss: a token with env_mask 0 gets no gradient and
    every token with env_mask 1 gets some; swapping the two episodes' rewards turns every
    gradient around (the advantages change sign)."""
    import torch

    rollout = _rollout(relay, RankedAgent(), tmp_path / "checkpoints")
    trainer = _grpo_trainer(tiny_model_dir, tmp_path, rollout)
    prompts = [{"prompt": "task-a"}, {"prompt": "task-a"}]
    batch = trainer._generate_and_score_completions(prompts)
    samples = rollout.history[-1].samples
    assert sorted(s.reward for s in samples) == [0.0, 1.0]
    env_mask = torch.zeros_like(batch["completion_mask"])
    for row, sample in enumerate(samples):
        env_mask[row, : len(sample.response_mask)] = torch.tensor(sample.response_mask)
    assert "tool_mask" in batch  # TRL took env_mask
    assert torch.equal(batch["tool_mask"] * batch["completion_mask"], env_mask)
    assert 0 in env_mask[:, : min(len(s.response_mask) for s in samples)]
    norms, grads = _logit_grads(trainer, batch)
    assert torch.all(norms[env_mask == 0] == 0)
    assert torch.all(norms[env_mask == 1] > 0)

    swapped = [replace(s, reward=1.0 - (s.reward or 0.0)) for s in samples]
    trainer.rollout_func = lambda prompts, trainer: rollout_output(swapped)
    batch = trainer._generate_and_score_completions(prompts)
    assert torch.equal(batch["completion_ids"][:, : grads.size(1)], batch["completion_ids"])
    _, flipped = _logit_grads(trainer, batch)
    assert torch.allclose(flipped, -grads, atol=1e-6)
    assert not torch.allclose(flipped, grads, atol=1e-6)
