"""RemoteAgentLoop end to end: real proxy, hf worker on the tiny model, a real agent process
(the openai client) run by a task server, samples checked against teacher forcing."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_relay.embedded import RunningProxy
from sdk.agent_loop import AgentLoopConfig, AttemptState, RemoteAgentLoop
from sdk.client import ProxyClient
from sdk.exceptions import ProxyRequestError, RemoteAgentLoopError, SessionNotFoundError
from sdk.fidelity import check_fidelity
from sdk.samples import BranchPolicy
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.sdk.conftest import AGENTS, LocalTaskServer
from worker_client.backends.hf import HFEngine

AGENT = str(AGENTS / "chat_agent.py")
SAMPLING = {"temperature": 1.0, "top_p": 1.0}


def _config(**overrides: object) -> AgentLoopConfig:
    values: dict[str, object] = {
        "agent": AGENT,
        "timeout_seconds": 120 * TIMEOUT_FACTOR,
        "sampling": SAMPLING,
    }
    values.update(overrides)
    return AgentLoopConfig(**values)  # type: ignore[arg-type]


async def _assert_deleted(proxy: ProxyClient, trial_id: str | None) -> None:
    assert trial_id is not None
    with pytest.raises(ProxyRequestError) as info:
        await proxy.get_session(trial_id)
    assert isinstance(info.value, SessionNotFoundError) or "deleted" in info.value.message


async def test_run_gives_faithful_rewarded_samples_and_deletes_the_session(
    proxy_client: ProxyClient,
    local_task_server: LocalTaskServer,
    harbor_task: Path,
    tiny_model_dir: Path,
) -> None:
    """One agent run of two chained calls becomes one rewarded, faithful sample."""
    loop = RemoteAgentLoop(proxy_client, local_task_server, _config())
    result = await loop.run(harbor_task)
    assert result.reward == 1.0
    assert [a.state for a in result.attempts] == [AttemptState.DELETED]
    assert len(result.samples) == 1
    sample = result.samples[0]
    assert sample.trial_id == result.trial_id
    assert sample.num_turns == 2
    assert sample.reward == 1.0
    assert len(sample.response_ids) == len(sample.response_mask) == len(sample.response_logprobs)
    assert sample.sampled_tokens > 0
    assert 0 in sample.response_mask  # the second prompt's new messages are context
    assert not sample.prompt_truncated
    assert not sample.response_truncated
    assert {"agent_run", "collect", "total"} <= set(result.timings)
    spec = local_task_server.submitted[0]
    assert spec.base_url.endswith(f"/{result.trial_id}/v1")
    await _assert_deleted(proxy_client, result.trial_id)
    scorer = HFEngine.load(tiny_model_dir)
    export = {
        "trajectories": [
            {
                "prompt_ids": sample.prompt_ids,
                "response_ids": sample.response_ids,
                "response_mask": sample.response_mask,
                "response_logprobs": sample.response_logprobs,
            }
        ]
    }
    assert check_fidelity(export, scorer.score).ok()
    await scorer.close()


async def test_failed_attempt_retries_on_a_fresh_trial(
    proxy_client: ProxyClient,
    local_task_server: LocalTaskServer,
    harbor_task: Path,
    tmp_path: Path,
) -> None:
    """A run that fails after sampling is retried on a new trial; its turns do not leak."""
    marker = tmp_path / "failed-once"
    loop = RemoteAgentLoop(
        proxy_client,
        local_task_server,
        _config(agent_settings={"AGENT_FAIL_ONCE": str(marker)}),
    )
    result = await loop.run(harbor_task)
    first, second = result.attempts
    assert marker.exists()
    assert first.error is not None
    assert "failed" in first.error
    assert first.state is AttemptState.DELETED
    assert second.state is AttemptState.DELETED
    assert first.trial_id != second.trial_id == result.trial_id
    assert len({s.base_url for s in local_task_server.submitted}) == 2
    # the failed attempt's single turn is not in the samples: only the retry's two turns
    assert [s.num_turns for s in result.samples] == [2]
    assert all(s.trial_id == second.trial_id for s in result.samples)
    await _assert_deleted(proxy_client, first.trial_id)
    await _assert_deleted(proxy_client, second.trial_id)


async def test_every_attempt_failing_raises_and_still_deletes(
    proxy_client: ProxyClient,
    local_task_server: LocalTaskServer,
    harbor_task: Path,
) -> None:
    """When all attempts fail the error lists them and no session is left behind."""
    loop = RemoteAgentLoop(
        proxy_client, local_task_server, _config(agent=str(AGENTS / "missing.py"), max_attempts=2)
    )
    with pytest.raises(RemoteAgentLoopError) as info:
        await loop.run(harbor_task)
    attempts = info.value.attempts
    assert len(attempts) == 2
    assert all(a.state is AttemptState.DELETED for a in attempts)
    assert "agent exited with" in str(info.value)
    for attempt in attempts:
        await _assert_deleted(proxy_client, attempt.trial_id)


async def test_timeout_cancels_the_run_and_deletes_the_session(
    proxy_client: ProxyClient,
    local_task_server: LocalTaskServer,
    harbor_task: Path,
) -> None:
    """A run past its timeout is cancelled on the task server and counts as failed."""
    loop = RemoteAgentLoop(
        proxy_client,
        local_task_server,
        _config(
            agent_settings={"AGENT_HANG": "1"},
            timeout_seconds=15 * TIMEOUT_FACTOR,
            max_attempts=1,
        ),
    )
    with pytest.raises(RemoteAgentLoopError, match="timed_out") as info:
        await loop.run(harbor_task)
    (attempt,) = info.value.attempts
    assert attempt.state is AttemptState.DELETED
    run = local_task_server.runs[attempt.run.run_id]  # type: ignore[union-attr]
    assert run.process is not None
    assert run.process.returncode is not None
    await _assert_deleted(proxy_client, attempt.trial_id)


async def test_length_limits_flag_truncation(
    stack: RunningProxy,
    proxy_client: ProxyClient,
    local_task_server: LocalTaskServer,
    harbor_task: Path,
) -> None:
    """Limits say what they did: a long response is cut at its end; a long prompt is kept
    whole nowhere: with ``overlong_prompt="mask"`` the sample is cut to fit and trains
    nothing, by default the attempt has no sample and says why."""
    loop = RemoteAgentLoop(
        proxy_client,
        local_task_server,
        _config(
            max_prompt_tokens=4,
            max_response_tokens=3,
            branch_policy="longest",
            overlong_prompt="mask",
        ),
    )
    result = await loop.run(harbor_task)
    (sample,) = result.samples
    assert loop.config.branch_policy is BranchPolicy.LONGEST
    assert len(sample.prompt_ids) == 4
    assert sample.prompt_truncated
    assert sample.response_mask == [0, 0, 0]
    assert len(sample.response_ids) == 3
    assert sample.response_truncated
    assert len(sample.response_mask) == len(sample.response_logprobs) == 3

    dropping = RemoteAgentLoop(
        proxy_client, local_task_server, _config(max_prompt_tokens=4, max_attempts=1)
    )
    with pytest.raises(RemoteAgentLoopError) as failed:
        await dropping.run(harbor_task)
    assert "over max_prompt_tokens=4" in str(failed.value)
