"""An agent run submitted through the embedded task server: a real agent process using the
official ``openai`` client against a trial of the real proxy (hf worker, tiny model)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient
from sdk.samples import build_samples
from sdk.taskserver.base import RunSpec, RunStatus
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
    task = write_task(tmp_path / "tasks", "answer", test_sh=TEST_SH, instruction="Say hello.\n")
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
    task = write_task(tmp_path / "tasks", "answer", test_sh=TEST_SH, instruction="Say hello.\n")
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
