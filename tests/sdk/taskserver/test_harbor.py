"""The Harbor launcher client against a real ``harbor view`` (Harbor 0.24.0, its own Python
3.12 environment from scripts/harbor-env.sh) on loopback.

No container runtime exists here, so a trial of a Docker environment cannot execute: the
tests assert that this is reported, not hidden. Environments loaded through Harbor's
``import_path`` stand in for the runtime: harbor_hold_env.py holds a job running (status,
cancel) and harbor_local_env.py runs a whole trial as local processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from sdk.agent_loop import run_outcome
from sdk.exceptions import TaskServerError
from sdk.taskserver.base import Fault, RunId, RunSpec, RunStatus
from sdk.taskserver.harbor import HarborLauncherTaskServer, job_config, result_from_trial
from tests.conftest import REPO
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.sdk.taskserver.conftest import MakeTask

HARBOR = Path(os.environ.get("RELAY_HARBOR_VENV", REPO / ".cache" / "harbor-venv")) / "bin"
WAIT = 120 * TIMEOUT_FACTOR

needs_harbor = pytest.mark.skipif(
    not (HARBOR / "harbor").exists(),
    reason="Harbor's side environment is missing: run scripts/harbor-env.sh",
)


def spec_for(task: Path, agent: str = "oracle", **settings: object) -> RunSpec:
    return RunSpec(
        task=task,
        agent=agent,
        model="openai/tiny",
        base_url="http://127.0.0.1:9/trial-h/v1",
        api_key="sk-h",
        timeout_seconds=60.0,
        agent_settings=settings,
    )


def test_job_config_points_the_agent_at_the_trial(tmp_path: Path) -> None:
    """The JobConfig names the agent (or its import path), the model, the trial's endpoint
    under the agents' variable names, and the task path."""
    spec = spec_for(tmp_path, env={"EXTRA": "1"}, kwargs={"max_turns": 3})
    config = job_config(spec, "job-1", {"type": "docker"})
    agent = config["agents"][0]
    assert agent["name"] == "oracle"
    assert agent["model_name"] == "openai/tiny"
    assert agent["env"]["OPENAI_BASE_URL"] == "http://127.0.0.1:9/trial-h/v1"
    assert agent["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/trial-h"
    assert agent["env"]["OPENAI_API_KEY"] == "sk-h"
    assert agent["env"]["EXTRA"] == "1"
    assert agent["kwargs"] == {"max_turns": 3}
    assert config["tasks"] == [{"path": str(tmp_path)}]
    assert config["environment"] == {"type": "docker"}
    custom = job_config(spec_for(tmp_path, agent="my.agents:Agent"), "job-2", {})
    assert custom["agents"][0]["import_path"] == "my.agents:Agent"
    assert "name" not in custom["agents"][0]


def test_result_from_trial_reads_rewards_and_exceptions() -> None:
    """A TrialResult's verifier rewards make SUCCEEDED; a timeout exception TIMED_OUT; an
    exception without reward FAILED with Harbor's message."""
    run = RunId("j")
    ok = result_from_trial(run, {"verifier_result": {"rewards": {"reward": 1}}}, None)
    assert (ok.status, ok.rewards, ok.error) == (RunStatus.SUCCEEDED, {"reward": 1.0}, None)
    timed_out = result_from_trial(
        run,
        {
            "verifier_result": None,
            "exception_info": {"exception_type": "AgentTimeoutError", "exception_message": "x"},
        },
        None,
    )
    assert timed_out.status is RunStatus.TIMED_OUT
    failed = result_from_trial(
        run,
        {"exception_info": {"exception_type": "RuntimeError", "exception_message": "boom"}},
        None,
    )
    assert failed.status is RunStatus.FAILED
    assert failed.error == "RuntimeError: boom"


@pytest.mark.parametrize(
    ("kind", "rewards", "status", "fault"),
    [
        ("AgentTimeoutError", {"reward": 0.5}, RunStatus.TIMED_OUT, None),
        ("VerifierTimeoutError", {}, RunStatus.TIMED_OUT, None),
        ("NonZeroAgentExitCodeError", {}, RunStatus.FAILED, Fault.AGENT),
        ("ContextWindowExceededError", {}, RunStatus.FAILED, Fault.AGENT),
        ("NonZeroAgentExitCodeError", {"reward": 0.0}, RunStatus.FAILED, Fault.AGENT),
        # Not the policy's doing, graded or not: the model API, the set-up, the sandbox.
        ("ApiInternalServerError", {"reward": 0.0}, RunStatus.FAILED, Fault.INFRA),
        ("ApiConnectionClosedError", {}, RunStatus.FAILED, Fault.INFRA),
        ("AgentSetupTimeoutError", {}, RunStatus.FAILED, Fault.INFRA),
        ("EnvironmentStartTimeoutError", {}, RunStatus.FAILED, Fault.INFRA),
        ("RewardFileNotFoundError", {}, RunStatus.FAILED, Fault.INFRA),
        ("SomethingNewError", {"reward": 1.0}, RunStatus.FAILED, Fault.INFRA),
    ],
)
def test_harbor_exceptions_say_whose_doing_a_run_ended_in(
    kind: str, rewards: dict[str, float], status: RunStatus, fault: Fault | None
) -> None:
    """Harbor's exception types sort a run into the policy's outcomes (its timeouts, an
    agent that failed by itself) and the infrastructure's, whose runs are retried and never
    graded, even where the verifier still gave a reward."""
    trial = {
        "verifier_result": {"rewards": rewards} if rewards else None,
        "exception_info": {"exception_type": kind, "exception_message": "x"},
    }
    result = result_from_trial(RunId("j"), trial, None)
    assert (result.status, result.fault) == (status, fault)
    assert result.error == f"{kind}: x"


def test_an_agent_failure_the_verifier_graded_is_an_agent_error_with_its_reward() -> None:
    """A trial whose agent exited non-zero but whose verifier still gave a reward is the
    agent's failure (``agent_error``) carrying that reward, not a completed run."""
    trial = {
        "verifier_result": {"rewards": {"reward": 0.25}},
        "exception_info": {"exception_type": "NonZeroAgentExitCodeError", "exception_message": "x"},
    }
    result = result_from_trial(RunId("j"), trial, None)
    assert (result.status, result.fault) == (RunStatus.FAILED, Fault.AGENT)
    assert (run_outcome(result), result.reward) == ("agent_error", 0.25)
    assert result.error == "NonZeroAgentExitCodeError: x"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def launch_harbor_view(jobs: Path) -> Iterator[str]:
    """A real ``harbor view`` launcher on a free loopback port, stopped afterwards. The
    stand-in environments and agent of this folder are importable by Harbor."""
    port = _free_port()
    env = {
        **os.environ,
        "HARBOR_TELEMETRY": "0",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "PYTHONPATH": str(Path(__file__).parent),
    }
    log = (jobs / "view.log").open("wb")
    process = subprocess.Popen(
        [
            str(HARBOR / "harbor"),
            "view",
            str(jobs),
            "--jobs",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-build",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_up(url, process))
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10 * TIMEOUT_FACTOR)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10 * TIMEOUT_FACTOR)
        log.close()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not (HARBOR / "harbor").exists():
        pytest.skip("Harbor's side environment is missing: run scripts/harbor-env.sh")
    with launch_harbor_view(tmp_path_factory.mktemp("harbor-jobs")) as url:
        yield url


async def _wait_up(url: str, process: subprocess.Popen[bytes]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    async with aiohttp.ClientSession() as http:
        while loop.time() < deadline:
            if process.poll() is not None:
                pytest.fail(f"harbor view exited with {process.returncode}")
            try:
                async with http.get(f"{url}/api/run/options") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    pytest.fail("harbor view did not come up")


@pytest.fixture
async def harbor(launcher: str) -> AsyncIterator[HarborLauncherTaskServer]:
    async with HarborLauncherTaskServer(launcher) as client:
        yield client


@needs_harbor
async def test_docker_trial_without_runtime_is_reported(
    harbor: HarborLauncherTaskServer, make_task: MakeTask
) -> None:
    """A real Harbor job (oracle agent, Docker environment) cannot run without a container
    runtime: the run is FAILED and the error carries Harbor's own reason."""
    task = make_task(solve_sh="echo 42 > /app/answer.txt\n")
    handle = await harbor.submit(spec_for(task))
    result = await harbor.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.FAILED
    assert result.rewards == {}
    assert result.error is not None
    assert "Docker" in result.error


@needs_harbor
async def test_invalid_job_config_is_refused(
    harbor: HarborLauncherTaskServer, make_task: MakeTask
) -> None:
    """A JobConfig Harbor rejects (unknown environment type) is a TaskServerError with
    Harbor's validation message; a task path Harbor cannot find fails the run, and the
    error carries Harbor's log (here Harbor stops first at the missing Docker daemon)."""
    with pytest.raises(TaskServerError, match="Invalid run configuration"):
        await harbor.submit(spec_for(make_task(), environment={"type": "no-such-runtime"}))
    handle = await harbor.submit(spec_for(Path("/nonexistent/task")))
    result = await harbor.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.FAILED
    assert result.error is not None
    assert result.error.startswith("harbor run exited with code 1")


@needs_harbor
async def test_running_job_is_reported_and_cancelled(
    harbor: HarborLauncherTaskServer, make_task: MakeTask
) -> None:
    """While ``harbor run`` is alive the run is RUNNING; cancel stops it (DELETE) and the
    run is CANCELLED; cancelling again is harmless."""
    task = make_task(solve_sh="true\n")
    handle = await harbor.submit(
        spec_for(task, environment={"import_path": "harbor_hold_env:HoldEnvironment"})
    )
    assert (await harbor.status(handle)).status is RunStatus.RUNNING
    await harbor.cancel(handle)
    result = await harbor.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.CANCELLED
    await harbor.cancel(handle)


@needs_harbor
async def test_unknown_job_is_an_error(harbor: HarborLauncherTaskServer) -> None:
    """Asking for a job the launcher never started is a TaskServerError."""
    from sdk.taskserver.base import RunHandle

    with pytest.raises(TaskServerError, match="does not know"):
        await harbor.status(RunHandle(RunId("rr-never"), harbor.url))


@needs_harbor
async def test_oracle_trial_runs_in_a_local_environment(
    harbor: HarborLauncherTaskServer, make_task: MakeTask
) -> None:
    """A whole Harbor trial (environment, oracle agent, verifier) runs here through an
    environment of local processes loaded by import_path; the reward test.sh wrote comes
    back through the launcher's TrialResult (1.0 solved, 0.0 not)."""
    task = make_task(solve_sh="echo 42 > /app/answer.txt\n")
    handle = await harbor.submit(
        spec_for(task, environment={"import_path": "harbor_local_env:LocalEnvironment"})
    )
    result = await harbor.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.SUCCEEDED, result
    assert result.rewards == {"reward": 1.0}
    wrong = make_task(solve_sh="echo 41 > /app/answer.txt\n")
    handle = await harbor.submit(
        spec_for(wrong, environment={"import_path": "harbor_local_env:LocalEnvironment"})
    )
    result = await harbor.wait(handle, timeout_seconds=WAIT)
    assert (result.status, result.rewards) == (RunStatus.SUCCEEDED, {"reward": 0.0})
