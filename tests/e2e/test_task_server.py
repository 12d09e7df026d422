"""An agent run submitted through the embedded task server: a real agent process using the
official ``openai`` client against a trial of the real proxy (hf worker, tiny model)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.agent_loop import AgentLoopConfig, RemoteAgentLoop
from sdk.client import ProxyClient
from sdk.exceptions import RemoteAgentLoopError
from sdk.samples import build_samples
from sdk.taskserver.base import Fault, RunSpec, RunStatus
from sdk.taskserver.harbor import HarborLauncherTaskServer
from sdk.taskserver.runs_api import RunsApiTaskServer
from sdk.taskserver.server import RunningTaskServer, TaskServerConfig, start_task_server
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.sdk.taskserver.conftest import write_task

pytestmark = pytest.mark.e2e

AGENT = Path(__file__).parent / "agents" / "two_turn_agent.py"

# Harbor-style verifier: scores what the agent left in the container's WORKDIR (/app).
TEST_SH = """
if [ -s /app/answer.txt ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


# Grades only an answer the agent left: no reward at all without one.
ANSWER_OR_NOTHING = """
if [ -s /app/answer.txt ]; then echo 1 > /logs/verifier/reward.txt; fi
"""


def _task(tmp_path: Path, test_sh: str = ANSWER_OR_NOTHING, **settings: Any) -> Path:
    """The task every test here runs: say hello, graded by ``test_sh``."""
    return write_task(
        tmp_path / "tasks", "answer", test_sh=test_sh, instruction="Say hello.\n", **settings
    )


def _loop_config(agent: str, **settings: Any) -> AgentLoopConfig:
    """The loop on the tiny model with short replies, ``settings`` on top."""
    values: dict[str, Any] = {
        "agent": agent,
        "model": "tiny",
        "timeout_seconds": 300 * TIMEOUT_FACTOR,
        "sampling": {"temperature": 1.0, "max_tokens": 16},
        "max_staleness": None,
    }
    return AgentLoopConfig(**(values | settings))


@pytest.fixture
async def task_server(tmp_path: Path) -> AsyncIterator[RunningTaskServer]:
    running = await start_task_server(
        TaskServerConfig(
            port=0,
            runs_dir=tmp_path / "runs",
            agents={"two-turn": f"{sys.executable} {AGENT}"},
        )
    )
    yield running
    await running.stop()


async def test_agent_run_through_task_server_is_recorded(
    stack: RunningProxy,
    proxy_client: ProxyClient,
    task_server: RunningTaskServer,
    tmp_path: Path,
) -> None:
    """register a trial → submit the run with the trial's base URL and key → the agent's two
    turns are recorded on the trial as one trajectory, and the verifier's reward comes back
    and is stored with the session."""
    task = _task(tmp_path, TEST_SH)
    trial = await proxy_client.create_session(sampling={"temperature": 1.0, "max_tokens": 16})
    async with RunsApiTaskServer(task_server.url) as runs:
        handle = await runs.submit(
            RunSpec(
                task=task,
                agent="two-turn",
                model="tiny",
                base_url=trial.base_url,
                api_key=trial.api_key,
                timeout_seconds=300 * TIMEOUT_FACTOR,
            )
        )
        result = await runs.wait(handle, timeout_seconds=300 * TIMEOUT_FACTOR)
        agent_log = await runs.logs(handle, "agent")
    assert result.status is RunStatus.SUCCEEDED, (result, agent_log)
    assert result.reward == 1.0
    assert "turn 0:" in agent_log
    assert "turn 1:" in agent_log

    await proxy_client.complete(trial.trial_id, reward=result.reward)
    export = await proxy_client.trajectories(trial.trial_id)
    assert export["reward"] == 1.0
    assert len(export["trajectories"]) == 1
    trajectory = export["trajectories"][0]
    assert [turn["turn"] for turn in trajectory["turns"]] == [0, 1]
    samples = build_samples(export)
    assert len(samples) == 1
    assert sum(samples[0].response_mask) > 0
    workspace = task_server.server.runs_dir / handle.run_id / "workspace"
    assert (workspace / "answer.txt").read_text()
    await proxy_client.delete(trial.trial_id)


@pytest.fixture
async def typed_task_server(tmp_path: Path) -> AsyncIterator[RunningTaskServer]:
    """Agents that end each way a run can end: the two-turn agent, then hanging past the
    task's time (``slow``), or failing by itself without leaving an answer (``crash``)."""
    two_turns = f"{sys.executable} {AGENT}"
    running = await start_task_server(
        TaskServerConfig(
            port=0,
            runs_dir=tmp_path / "runs",
            agents={
                "two-turn": two_turns,
                "slow": f"{two_turns} && sleep 600",
                "crash": f"{two_turns} && rm answer.txt && exit 3",
            },
        )
    )
    yield running
    await running.stop()


@pytest.mark.parametrize(
    ("agent", "outcome", "reward"),
    [("slow", "timeout", 1.0), ("crash", "agent_error", -1.0)],
)
async def test_a_run_the_policy_ended_trains_with_its_outcome(
    stack: RunningProxy,
    proxy_client: ProxyClient,
    typed_task_server: RunningTaskServer,
    tmp_path: Path,
    agent: str,
    outcome: str,
    reward: float,
) -> None:
    """An agent past the task's time, or failing by itself, is the policy's outcome: one
    attempt, its trial completed as ``timeout`` / ``agent_error``, its two turns trained
    with the verifier's grade of what the agent left (the answer the slow agent wrote)
    or, with no grade, ``failure_reward``."""
    task = _task(tmp_path, agent_timeout=8 * TIMEOUT_FACTOR)
    config = _loop_config(agent, failure_reward=-1.0)
    async with RunsApiTaskServer(typed_task_server.url) as runs:
        result = await RemoteAgentLoop(proxy_client, runs, config).run(task)
    (attempt,) = result.attempts
    assert attempt.outcome == result.outcome == outcome
    assert result.reward == reward
    (sample,) = result.samples
    assert (sample.outcome, sample.reward, sample.num_turns) == (outcome, reward, 2)
    assert sum(sample.response_mask) > 0


async def test_a_run_the_infrastructure_ended_is_retried_never_graded(
    stack: RunningProxy,
    proxy_client: ProxyClient,
    typed_task_server: RunningTaskServer,
    tmp_path: Path,
) -> None:
    """A verifier that grades nothing after an agent that finished is the task's fault,
    not the policy's: every attempt is retried on a fresh trial, none is trained, even with
    a ``failure_reward`` that would have graded a policy failure."""
    broken = "echo 'no reward file today'\n"
    task = _task(tmp_path, broken)
    config = _loop_config(
        "two-turn", failure_reward=-1.0, max_attempts=2, retry_backoff_seconds=0.0
    )
    async with RunsApiTaskServer(typed_task_server.url) as runs:
        with pytest.raises(RemoteAgentLoopError, match="not the policy's doing") as info:
            await RemoteAgentLoop(proxy_client, runs, config).run(task)
    attempts = info.value.attempts
    assert [a.outcome for a in attempts] == ["infra_error", "infra_error"]
    assert [a.result.fault for a in attempts if a.result] == [Fault.INFRA, Fault.INFRA]
    assert len({a.trial_id for a in attempts}) == 2


async def test_an_agent_that_failed_for_want_of_the_model_is_not_the_policys_doing(
    typed_task_server: RunningTaskServer, tmp_path: Path
) -> None:
    """A proxy with no worker answers the agent's first call 503; the agent then fails, a
    failure the task server lays on the agent. The trial counts the server error, so the
    loop takes the run as the infrastructure's: retried, never trained as a failure."""
    task = _task(tmp_path)
    config = _loop_config("two-turn", failure_reward=-1.0, max_attempts=1)
    empty = await start_proxy(
        ProxyConfig(port=0, worker_wait_seconds=0.2, cache_dir=tmp_path / "cache")
    )
    try:
        async with (
            ProxyClient(empty.url) as proxy,
            RunsApiTaskServer(typed_task_server.url) as runs,
        ):
            with pytest.raises(RemoteAgentLoopError, match="with a server error") as info:
                await RemoteAgentLoop(proxy, runs, config).run(task)
    finally:
        await empty.stop()
    (attempt,) = info.value.attempts
    assert attempt.result is not None
    assert attempt.result.fault is Fault.AGENT  # what the task server saw
    assert attempt.outcome == "infra_error"


@pytest.fixture(scope="module")
def harbor_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.sdk.taskserver.test_harbor import HARBOR, launch_harbor_view

    if not (HARBOR / "harbor").exists():
        pytest.skip("Harbor's side environment is missing: run scripts/harbor-env.sh")
    with launch_harbor_view(tmp_path_factory.mktemp("harbor-e2e")) as url:
        yield url


async def test_agent_run_through_harbor_is_recorded(
    proxy_client: ProxyClient, harbor_launcher: str, tmp_path: Path
) -> None:
    """The same agent, submitted as a real Harbor trial through the launcher (an agent and
    an environment of local processes loaded by import_path, standing in for containers):
    Harbor hands it the trial's endpoint, the proxy records its two turns, and the
    verifier's reward comes back through Harbor's TrialResult."""
    task = _task(tmp_path, TEST_SH)
    trial = await proxy_client.create_session(sampling={"temperature": 1.0, "max_tokens": 16})
    async with HarborLauncherTaskServer(harbor_launcher) as harbor:
        handle = await harbor.submit(
            RunSpec(
                task=task,
                agent="harbor_command_agent:CommandAgent",
                model="tiny",
                base_url=trial.base_url,
                api_key=trial.api_key,
                timeout_seconds=300 * TIMEOUT_FACTOR,
                agent_settings={
                    "kwargs": {"command": f"{sys.executable} {AGENT}"},
                    "environment": {"import_path": "harbor_local_env:LocalEnvironment"},
                },
            )
        )
        result = await harbor.wait(handle, timeout_seconds=300 * TIMEOUT_FACTOR)
    assert result.status is RunStatus.SUCCEEDED, result
    assert result.reward == 1.0
    export = await proxy_client.trajectories(trial.trial_id)
    assert len(export["trajectories"]) == 1
    assert [turn["turn"] for turn in export["trajectories"][0]["turns"]] == [0, 1]
    await proxy_client.delete(trial.trial_id)


async def test_an_agent_past_its_time_through_harbor_trains_as_a_timeout(
    proxy_client: ProxyClient, harbor_launcher: str, tmp_path: Path
) -> None:
    """A real Harbor trial whose agent answers, then outlives its time: Harbor's
    AgentTimeoutError, then its verifier grades what the agent left, and the loop trains
    the episode as a ``timeout`` with that grade, in one attempt."""
    task = _task(tmp_path)
    config = _loop_config(
        "harbor_command_agent:CommandAgent",
        agent_settings={
            "kwargs": {"command": f"{sys.executable} {AGENT} && sleep 600"},
            "environment": {"import_path": "harbor_local_env:LocalEnvironment"},
            "override_timeout_sec": 10 * TIMEOUT_FACTOR,
        },
    )
    async with HarborLauncherTaskServer(harbor_launcher) as harbor:
        result = await RemoteAgentLoop(proxy_client, harbor, config).run(task)
    (attempt,) = result.attempts
    assert attempt.result is not None
    assert attempt.result.error is not None
    assert attempt.result.error.startswith("AgentTimeoutError")
    assert (result.outcome, result.reward) == ("timeout", 1.0)
    (sample,) = result.samples
    assert (sample.outcome, sample.num_turns) == ("timeout", 2)
