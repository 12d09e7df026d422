"""RemoteAgentLoop end to end: real proxy, hf worker on the tiny model, a real agent process
(the openai client) run by a task server, samples checked against teacher forcing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from rollout_relay.embedded import RunningProxy
from sdk.agent_loop import AgentLoopConfig, AttemptState, RemoteAgentLoop, retry_delay
from sdk.client import ProxyClient
from sdk.exceptions import ProxyRequestError, RemoteAgentLoopError, SessionNotFoundError
from sdk.fidelity import check_fidelity
from sdk.samples import BranchPolicy
from sdk.taskserver.base import RunSpec
from sdk.taskserver.inprocess import InProcessTaskServer
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.sdk.conftest import AGENTS, LocalTaskServer
from tests.sdk.faults import Fault, FaultyFront, route_of
from tests.sdk.inprocess_agents import VersionBumpAgent, one_call, one_call_server, trial_of
from worker_client.backends.hf import HFEngine

AGENT = str(AGENTS / "chat_agent.py")
SAMPLING = {"temperature": 1.0, "top_p": 1.0}
CREATE = route_of("POST", "/sessions")
COMPLETE = route_of("POST", "/sessions/x/complete")


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
            timeout_seconds=5 * TIMEOUT_FACTOR,
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


async def _front(stack: RunningProxy, fault: Fault, route: str, times: int) -> FaultyFront:
    front = FaultyFront(stack.url, fault, route, times)
    await front.start()
    return front


def _fast_retries(**overrides: object) -> AgentLoopConfig:
    values: dict[str, object] = {
        "agent": "one-call",
        "max_attempts": 2,
        "timeout_seconds": 60 * TIMEOUT_FACTOR,
        "retry_backoff_seconds": 0.01,
    }
    values.update(overrides)
    return AgentLoopConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("fault", list(Fault))
async def test_a_proxy_fault_mid_run_is_retried_on_a_fresh_trial(
    stack: RunningProxy, harbor_task: Path, fault: Fault
) -> None:
    """The proxy's connection drops (or an HTML error page, or a timeout) when the run's
    reward is posted: the attempt fails, the loop tries once more on a new trial and
    succeeds; exactly two trials were created and both are deleted."""
    front = await _front(stack, fault, COMPLETE, times=1)
    try:
        async with ProxyClient(front.url, timeout_seconds=3 * TIMEOUT_FACTOR) as proxy:
            loop = RemoteAgentLoop(proxy, one_call_server(), _fast_retries())
            result = await loop.run(harbor_task)
            first, second = result.attempts
            assert first.error is not None
            assert {"ProxyConnectionError", "ProxyRequestError"} & {first.error.split(":")[0]}
            assert second.error is None
            assert [a.state for a in result.attempts] == [AttemptState.DELETED] * 2
            assert first.trial_id != second.trial_id == result.trial_id
            assert [s.num_turns for s in result.samples] == [1]
            assert front.seen[CREATE] == 2
            assert front.seen[COMPLETE] == 2
            assert front.faulted == 1
            for attempt in result.attempts:
                await _assert_deleted(proxy, attempt.trial_id)
    finally:
        await front.stop()


async def test_an_exhausted_budget_raises_the_loops_error_not_the_networks(
    stack: RunningProxy, harbor_task: Path
) -> None:
    """Every attempt meets a dropped connection: exactly ``max_attempts`` trials, then
    ``RemoteAgentLoopError`` listing them (no aiohttp exception escapes)."""
    front = await _front(stack, Fault.RESET, COMPLETE, times=100)
    try:
        async with ProxyClient(front.url) as proxy:
            loop = RemoteAgentLoop(proxy, one_call_server(), _fast_retries(max_attempts=3))
            with pytest.raises(RemoteAgentLoopError, match="all 3 attempts failed") as info:
                await loop.run(harbor_task)
            assert len(info.value.attempts) == 3
            assert all("ProxyConnectionError" in str(a.error) for a in info.value.attempts)
            assert front.seen[CREATE] == 3
            assert front.faulted == 3
    finally:
        await front.stop()


def test_the_retry_delay_doubles_up_to_its_cap() -> None:
    """0.5 s, 1 s, 2 s ... at most the cap, scaled by the jitter; nothing before a first
    failure."""
    assert [retry_delay(n, 0.5, 8.0, 1.0) for n in range(7)] == [0, 0.5, 1, 2, 4, 8, 8]
    assert retry_delay(3, 0.5, 8.0, 0.5) == 1.0


async def test_the_loop_waits_before_a_retry(
    stack: RunningProxy, proxy_client: ProxyClient, harbor_task: Path
) -> None:
    """A retry starts no sooner than half the backoff after the failed attempt ended."""

    async def fails_once(spec: Any) -> Mapping[str, float]:
        if not failed:
            failed.append(spec)
            raise RuntimeError("the sandbox broke")
        return await one_call(spec)

    failed: list[Any] = []
    loop = RemoteAgentLoop(
        proxy_client, InProcessTaskServer(fails_once), _fast_retries(retry_backoff_seconds=0.4)
    )
    result = await loop.run(harbor_task)
    first, second = result.attempts
    assert second.started_at - (first.started_at + first.seconds) >= 0.2


async def test_tokens_older_than_the_staleness_limit_are_masked(
    own_stack: RunningProxy, harbor_task: Path, tiny_model_dir: Path
) -> None:
    """The weights move from version 0 to 2 between the agent's two calls: by default
    (at most 1 version old) the first call's tokens are masked and counted stale, the
    second's train; without a limit both train."""
    async with ProxyClient(own_stack.url) as proxy:
        agent = VersionBumpAgent(own_stack.url, None, 2, str(tiny_model_dir))
        config = _fast_retries(agent="bump", max_attempts=1)
        result = await RemoteAgentLoop(proxy, InProcessTaskServer(agent), config).run(harbor_task)
        assert result.current_version == 2
        (sample,) = result.samples
        old, new = sample.turns
        first, second = agent.calls[result.trial_id]
        assert sample.response_mask[old["response_start"] : old["response_end"]] == [0] * first
        assert sample.response_mask[new["response_start"] : new["response_end"]] == [1] * second
        assert sample.stale_tokens == first
        assert (sample.min_version, sample.max_version) == (2, 2)

        agent.to_version = 4
        unlimited = _fast_retries(agent="bump", max_attempts=1, max_staleness=None)
        loop = RemoteAgentLoop(proxy, InProcessTaskServer(agent), unlimited)
        result = await loop.run(harbor_task)
        assert result.current_version is None
        (sample,) = result.samples
        assert sample.stale_tokens == 0
        assert sample.sampled_tokens == sum(agent.calls[result.trial_id])
        assert (sample.min_version, sample.max_version) == (2, 4)


@dataclass(slots=True)
class ForkingAgent:
    """A forked trial: a first call, a second that continues it, then a third that
    continues the first again with another question (a new branch after turn 0) and
    samples one token, so the dropped branch has at least as many sampled tokens."""

    calls: dict[str, list[int]] = field(default_factory=dict)

    async def __call__(self, spec: RunSpec) -> Mapping[str, float]:
        client = AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
        tokens: list[int] = []
        try:
            start: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
            first = await client.chat.completions.create(
                model="tiny",
                messages=start,
                max_tokens=8,  # type: ignore[arg-type]
            )
            reply = {"role": "assistant", "content": first.choices[0].message.content}
            for question, limit in (("Go on.", 16), ("Something else.", 1)):
                messages = [*start, reply, {"role": "user", "content": question}]
                answer = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=limit,  # type: ignore[arg-type]
                )
                assert answer.usage is not None
                tokens.append(answer.usage.completion_tokens)
            assert first.usage is not None
            self.calls[trial_of(spec)] = [first.usage.completion_tokens, *tokens]
        finally:
            await client.close()
        return {"reward": 1.0}


async def test_branch_policy_last_trains_the_turns_it_shares_with_the_dropped_branch(
    proxy_client: ProxyClient, harbor_task: Path
) -> None:
    """A forked trial through the real proxy and model: ``last`` keeps the branch of the
    newest turn, and the first turn it shares with the dropped (longer) branch is trained
    in it: every sampled token of the kept trajectory is trained."""
    agent = ForkingAgent()
    config = _fast_retries(agent="fork", max_attempts=1, branch_policy=BranchPolicy.LAST)
    result = await RemoteAgentLoop(proxy_client, InProcessTaskServer(agent), config).run(
        harbor_task
    )
    first, _, forked = agent.calls[result.trial_id]
    (sample,) = result.samples
    assert [t["turn"] for t in sample.turns] == [0, 2]
    shared = sample.turns[0]
    assert sample.response_mask[shared["response_start"] : shared["response_end"]] == [1] * first
    assert sample.sampled_tokens == first + forked
