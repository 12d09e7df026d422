"""The verl adapter against the real ``verl`` package: verl's own registry, hydra
instantiation and dataset; a Ray worker actor (hf on the tiny model, local CPU cluster)
behind a real proxy; an agent run submitted through the embedded task server
(run-submission API); verl ``AgentLoopOutput``s that pass the fidelity check and carry the
policy version set by a pause/resume of the worker group between two steps."""

from __future__ import annotations

import importlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl.experimental.agent_loop.agent_loop")

import hydra
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop import agent_loop as verl_agent_loop
from verl.utils.dataset.rl_dataset import RLHFDataset

import sdk.verl
from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.fidelity import check_fidelity
from sdk.harbor_dataset import write_verl_dataset
from sdk.taskserver.server import TaskServerConfig, start_task_server
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.ray_cluster import ray_cluster, start_tiny_group
from tests.sdk.conftest import AGENTS
from tests.sdk.faults import Fault, FaultyFront, route_of
from tests.sdk.inprocess_agents import CALL_TOKENS
from tests.sdk.taskserver.conftest import write_task
from worker_client.backends.hf import HFEngine
from worker_client.ray_actors import WorkerActorGroup

__all__ = ["ray_cluster"]

PROMPT_LENGTH = 512
RESPONSE_LENGTH = 256


def _trainer_config(tmp_path: Path) -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": PROMPT_LENGTH,
                    "response_length": RESPONSE_LENGTH,
                    "agent": {"default_agent_loop": "remote_agent"},
                }
            },
            "data": {"max_prompt_length": PROMPT_LENGTH, "cache_dir": str(tmp_path / "cache")},
            # settings verl's YAML entry does not give are read from this section
            "remote_agent": {"timeout_seconds": 180 * TIMEOUT_FACTOR, "max_attempts": 1},
        }
    )


def _instantiate(entry: Any, config: Any, tokenizer: Any) -> Any:
    """Exactly the call verl's AgentLoopWorker._run_agent_loop makes."""
    return hydra.utils.instantiate(
        config=entry,
        trainer_config=verl_agent_loop.DictConfigWrap(config=config),
        server_manager=None,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=verl_agent_loop.DictConfigWrap(config.data),
        tools=verl_agent_loop.ToolListWrap([]),
    )


@pytest.fixture
async def policy_stack(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path
) -> AsyncIterator[tuple[RunningProxy, WorkerActorGroup]]:
    """The proxy and a Ray worker actor (hf on the tiny model) whose weights version the
    trainer bumps with pause/resume across the group."""
    proxy = await start_proxy(
        ProxyConfig(
            port=0, worker_wait_seconds=120 * TIMEOUT_FACTOR, max_tokens=32, cache_dir=tmp_path
        )
    )
    group = await start_tiny_group(proxy.worker_url, tiny_model_dir)
    try:
        await proxy.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
        yield proxy, group
    finally:
        await group.stop()
        await proxy.stop()


async def test_remote_agent_returns_faithful_verl_outputs(
    policy_stack: tuple[RunningProxy, WorkerActorGroup],
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """verl's registry, hydra and dataset drive RemoteAgentLoop to real AgentLoopOutputs."""
    proxy, workers = policy_stack
    # A Harbor task in the container layout; the embedded task server maps /app and /logs.
    write_task(
        tmp_path / "tasks",
        "hello",
        instruction="Say hello.",
        test_sh=(
            "if [ -s /app/answer.txt ]; then echo 1 > /logs/verifier/reward.txt;"
            " else echo 0 > /logs/verifier/reward.txt; fi\n"
        ),
    )
    task_server = await start_task_server(
        TaskServerConfig(
            port=0,
            runs_dir=tmp_path / "runs",
            agents={"chat-agent": f"{sys.executable} {AGENTS / 'chat_agent.py'}"},
            kill_grace_seconds=1.0,
        )
    )
    dataset_file = tmp_path / "train.parquet"
    write_verl_dataset(tmp_path / "tasks", dataset_file)

    # The agent-loop YAML, loaded the way verl's AgentLoopWorker loads it.
    yaml = tmp_path / "agent_loops.yaml"
    yaml.write_text(
        OmegaConf.to_yaml(
            [
                {
                    "name": "remote_agent",
                    "_target_": "sdk.verl.RemoteAgentLoop",
                    "proxy_url": proxy.url,
                    "agent": "chat-agent",
                    "task_server": {
                        "factory": "sdk.taskserver.runs_api:RunsApiTaskServer",
                        "url": task_server.url,
                    },
                }
            ]
        )
    )
    for entry in OmegaConf.load(yaml):
        verl_agent_loop._agent_loop_registry[entry.name] = entry
    importlib.reload(sdk.verl)  # importing the module must not drop the YAML's settings
    entry = verl_agent_loop._agent_loop_registry["remote_agent"]
    assert entry.proxy_url == proxy.url

    config = _trainer_config(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    dataset = RLHFDataset(str(dataset_file), tokenizer, config.data)
    row = dataset[0]
    assert row["agent_name"] == "remote_agent"
    row.pop("agent_name")
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    scorer = HFEngine.load(tiny_model_dir)
    try:
        outputs = []
        for version in (None, 3):
            if version is not None:  # a weight update between two steps
                await workers.pause()
                await workers.resume(version)
            loop = _instantiate(entry, config, tokenizer)
            assert isinstance(loop, sdk.verl.RemoteAgentLoop)
            outputs.append(await loop.run(dict(sampling), **row))
        for output, version in zip(outputs, (0, 3), strict=True):
            assert isinstance(output, verl_agent_loop.AgentLoopOutput)
            assert output.reward_score == 1.0
            assert output.num_turns == 2
            assert len(output.response_ids) == len(output.response_mask)
            assert output.response_logprobs is not None
            assert len(output.response_logprobs) == len(output.response_ids)
            assert len(output.prompt_ids) <= PROMPT_LENGTH
            assert len(output.response_ids) <= RESPONSE_LENGTH
            assert output.extra_fields["min_global_steps"] == version
            assert output.extra_fields["max_global_steps"] == version
            assert output.extra_fields["policy_versions"] == [version, version]
            assert output.extra_fields["response_truncated"] is False
            assert output.metrics.generate_sequences > 0
            export = {"trajectories": [output.model_dump()]}
            assert check_fidelity(export, scorer.score).ok()
            tensors = output.as_dict()  # verl's own conversion to training tensors
            assert float(tensors["rm_scores"][-1]) == 1.0
            assert tensors["rollout_log_probs"].shape == tensors["responses"].shape
        assert outputs[0].extra_fields["trial_id"] != outputs[1].extra_fields["trial_id"]

        # A prompt over rollout.prompt_length: cut to fit, and nothing of it trains (its
        # logprobs were computed on the whole prompt).
        short = _trainer_config(tmp_path)
        short.actor_rollout_ref.rollout.prompt_length = 8
        output = await _instantiate(entry, short, tokenizer).run(dict(sampling), **row)
        assert len(output.prompt_ids) == 8
        assert output.extra_fields["prompt_truncated"] is True
        assert sum(output.response_mask) == 0
        assert output.reward_score == 1.0
    finally:
        await scorer.close()
        await sdk.verl.close_shared()
        await task_server.stop()


def test_settings_are_checked(tmp_path: Path) -> None:
    """Missing or contradictory settings fail with a message naming the setting."""
    with pytest.raises(ValueError, match="proxy_url"):
        sdk.verl.RemoteAgentSettings.from_sources({"agent": "a"}, None)
    base = {"proxy_url": "http://p", "agent": "a", "task_server": {"factory": "m:f"}}
    with pytest.raises(ValueError, match="one trajectory per sample"):
        sdk.verl.RemoteAgentSettings.from_sources({**base, "branch_policy": "all"}, None)
    with pytest.raises(ValueError, match="unknown settings"):
        sdk.verl.RemoteAgentSettings.from_sources({**base, "proxy": "x"}, None)
    section = OmegaConf.create({"agent": "from-section", "max_attempts": 5})
    settings = sdk.verl.RemoteAgentSettings.from_sources(
        {"proxy_url": "http://p", "task_server": {"factory": "m:f"}}, section
    )
    assert (settings.agent, settings.max_attempts) == ("from-section", 5)
    # Replies the agent never received are trained only when asked for.
    assert settings.keep_undelivered is False
    kept = sdk.verl.RemoteAgentSettings.from_sources({**base, "keep_undelivered": True}, None)
    assert kept.keep_undelivered is True


def _entry(proxy_url: str, task_server: dict[str, Any], **settings: Any) -> Any:
    return OmegaConf.create(
        {
            "name": "remote_agent",
            "_target_": "sdk.verl.RemoteAgentLoop",
            "proxy_url": proxy_url,
            "agent": "in-process",
            "task_server": task_server,
            **settings,
        }
    )


async def test_tokens_older_than_the_staleness_limit_are_masked_in_verls_output(
    own_stack: RunningProxy, harbor_task: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The weights move from version 0 to 2 between the agent's two calls: the output
    verl trains on masks the first call's tokens (two versions old) and trains the
    second's, and says how many were stale against which version."""
    entry = _entry(
        own_stack.url,
        {
            "factory": "tests.sdk.inprocess_agents:version_bump_server",
            "proxy_url": own_stack.url,
            "to_version": 2,
            "model_dir": str(tiny_model_dir),
        },
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    loop = _instantiate(entry, _trainer_config(tmp_path), tokenizer)
    try:
        output = await loop.run({"temperature": 1.0}, extra_info={"task_path": str(harbor_task)})
    finally:
        await sdk.verl.close_shared()
    first, second = CALL_TOKENS[output.extra_fields["trial_id"]]
    assert output.extra_fields["current_version"] == 2
    assert output.extra_fields["stale_tokens"] == first
    assert output.extra_fields["policy_versions"] == [0, 2]
    assert output.response_mask[:first] == [0] * first
    assert sum(output.response_mask) == second
    assert output.response_mask[-second:] == [1] * second
    assert (output.extra_fields["min_global_steps"], output.extra_fields["max_global_steps"]) == (
        2,
        2,
    )


async def test_a_network_fault_on_every_attempt_gives_the_empty_output(
    stack: RunningProxy, harbor_task: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With ``on_failure: empty``, a proxy whose connection drops at every attempt ends in
    the documented failure path (a masked output marked failed), after exactly
    ``max_attempts`` trials, never in aiohttp's exception."""
    front = FaultyFront(stack.url, Fault.RESET, route_of("POST", "/sessions/x/complete"), 100)
    await front.start()
    entry = _entry(
        front.url,
        {"factory": "tests.sdk.inprocess_agents:one_call_server"},
        on_failure="empty",
        max_attempts=3,
        retry_backoff_seconds=0.01,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    loop = _instantiate(entry, _trainer_config(tmp_path), tokenizer)
    try:
        output = await loop.run({"temperature": 1.0}, extra_info={"task_path": str(harbor_task)})
    finally:
        await sdk.verl.close_shared()
        await front.stop()
    assert output.extra_fields["remote_agent_failed"] is True
    assert "all 3 attempts failed" in output.extra_fields["error"]
    assert "ProxyConnectionError" in output.extra_fields["error"]
    assert sum(output.response_mask) == 0
    assert front.seen[route_of("POST", "/sessions")] == 3
