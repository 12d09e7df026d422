"""The run-submission API client against the real embedded task server on loopback."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from sdk.exceptions import TaskDefinitionError, TaskServerError, TaskServerTimeoutError
from sdk.taskserver.base import RunSpec, RunStatus, TaskServer
from sdk.taskserver.runs_api import RunsApiTaskServer
from sdk.taskserver.server import RunningTaskServer, TaskServerConfig, start_task_server
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.sdk.taskserver.conftest import MakeTask

WAIT = 60 * TIMEOUT_FACTOR


def spec_for(task: Path, agent: str = "oracle", **kwargs: object) -> RunSpec:
    base = RunSpec(
        task=task,
        agent=agent,
        model="tiny",
        base_url="http://127.0.0.1:9/trial-x/v1",
        api_key="sk-trial-secret",
        timeout_seconds=120.0 * TIMEOUT_FACTOR,
    )
    return replace(base, **kwargs)  # type: ignore[arg-type]


async def until(predicate: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not predicate():  # type: ignore[operator]
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_client_satisfies_protocol(runs_client: RunsApiTaskServer) -> None:
    """RunsApiTaskServer is usable wherever the TaskServer protocol is expected."""
    server: TaskServer = runs_client
    assert server is runs_client


async def test_oracle_run_reads_reward_from_mapped_verifier_dir(
    runs_client: RunsApiTaskServer, task_server: RunningTaskServer, make_task: MakeTask
) -> None:
    """The oracle runs solution/solve.sh; container paths (/app, /logs/verifier) land in the
    run's directory and the reward written to reward.txt comes back."""
    task = make_task(solve_sh="echo 42 > /app/answer.txt\n")
    handle = await runs_client.submit(spec_for(task))
    result = await runs_client.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.SUCCEEDED, result
    assert result.rewards == {"reward": 1.0}
    assert result.reward == 1.0
    assert result.error is None
    run_dir = task_server.server.runs_dir / handle.run_id
    assert (run_dir / "workspace" / "answer.txt").read_text().strip() == "42"
    assert json.loads((run_dir / "result.json").read_text())["status"] == "succeeded"
    assert result.logs is not None
    assert result.logs.endswith(f"/runs/{handle.run_id}/logs")


async def test_agent_gets_trial_endpoint_and_verifier_does_not(
    runs_client: RunsApiTaskServer, task_server: RunningTaskServer, make_task: MakeTask
) -> None:
    """The agent command sees the trial's base URL and key under the OpenAI, Anthropic and
    OpenHands names; the verifier sees no key; reward.json gives named rewards."""
    task = make_task(
        test_sh='env > /logs/verifier/env.txt\necho \'{"reward": 0.5, "style": 2}\' > /logs/verifier/reward.json\n',
        instruction="say hi\n",
    )
    command = "env > $TASK_AGENT_LOGS/env.txt; cat $TASK_INSTRUCTION_FILE; echo done-$EXTRA"
    handle = await runs_client.submit(
        spec_for(task, agent="custom", agent_settings={"command": command, "env": {"EXTRA": "x"}})
    )
    result = await runs_client.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.SUCCEEDED, result
    assert result.rewards == {"reward": 0.5, "style": 2.0}
    run_dir = task_server.server.runs_dir / handle.run_id
    agent_env = dict(
        line.split("=", 1)
        for line in (run_dir / "logs" / "agent" / "env.txt").read_text().splitlines()
        if "=" in line
    )
    assert agent_env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/trial-x/v1"
    assert agent_env["OPENAI_API_KEY"] == "sk-trial-secret"
    assert agent_env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/trial-x"
    assert agent_env["ANTHROPIC_API_KEY"] == "sk-trial-secret"
    assert agent_env["LLM_BASE_URL"] == "http://127.0.0.1:9/trial-x/v1"
    assert agent_env["TASK_MODEL"] == "tiny"
    assert agent_env["TASK_WORKSPACE"] == str(run_dir / "workspace")
    verifier_env = (run_dir / "logs" / "verifier" / "env.txt").read_text()
    assert "sk-trial-secret" not in verifier_env
    logs = await runs_client.logs(handle, "agent")
    assert "say hi" in logs
    assert "done-x" in logs


async def test_configured_agent_by_name(
    runs_client: RunsApiTaskServer, make_task: MakeTask
) -> None:
    """An agent configured on the server (``--agent NAME=COMMAND``) is chosen by name."""
    handle = await runs_client.submit(spec_for(make_task(), agent="echo-agent"))
    result = await runs_client.wait(handle, timeout_seconds=WAIT)
    assert (result.status, result.reward) == (RunStatus.SUCCEEDED, 1.0)
    assert "agent says tiny" in await runs_client.logs(handle, "agent")


async def test_failing_verifier_gives_zero_reward(
    runs_client: RunsApiTaskServer, make_task: MakeTask
) -> None:
    """A solution that does not solve the task is verified to reward 0, not an error."""
    handle = await runs_client.submit(spec_for(make_task(solve_sh="echo 41 > /app/answer.txt\n")))
    result = await runs_client.wait(handle, timeout_seconds=WAIT)
    assert (result.status, result.rewards) == (RunStatus.SUCCEEDED, {"reward": 0.0})


async def test_verifier_without_reward_fails_the_run(
    runs_client: RunsApiTaskServer, make_task: MakeTask
) -> None:
    """test.sh that exits non-zero without writing a reward: FAILED, and the error says so."""
    task = make_task(test_sh="echo broken; exit 3\n", solve_sh="true\n")
    result = await runs_client.wait(await runs_client.submit(spec_for(task)), timeout_seconds=WAIT)
    assert result.status is RunStatus.FAILED
    assert result.rewards == {}
    assert result.error is not None
    assert "no reward" in result.error
    assert "code 3" in result.error


async def test_malformed_reward_fails_the_run(
    runs_client: RunsApiTaskServer, make_task: MakeTask
) -> None:
    """A reward.txt that is not a number fails the run with a clear error."""
    task = make_task(test_sh="echo great > /logs/verifier/reward.txt\n", solve_sh="true\n")
    result = await runs_client.wait(await runs_client.submit(spec_for(task)), timeout_seconds=WAIT)
    assert result.status is RunStatus.FAILED
    assert result.error is not None
    assert "reward.txt is not a number" in result.error


async def test_run_timeout_kills_the_agent(
    runs_client: RunsApiTaskServer, task_server: RunningTaskServer, make_task: MakeTask
) -> None:
    """A run past its timeout_seconds is TIMED_OUT, no reward, and its processes are gone
    (including a child the agent left running)."""
    task = make_task()
    command = "sleep 600 & echo $! > child.pid; wait"
    handle = await runs_client.submit(
        spec_for(task, agent="x", timeout_seconds=1.0, agent_settings={"command": command})
    )
    result = await runs_client.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.TIMED_OUT
    assert result.rewards == {}
    assert result.error is not None
    assert "did not finish within 1s" in result.error
    pid = int((task_server.server.runs_dir / handle.run_id / "workspace" / "child.pid").read_text())
    await until(lambda: not _alive(pid), "the agent's child to be killed")


async def test_task_agent_timeout_still_verifies(
    runs_client: RunsApiTaskServer, make_task: MakeTask
) -> None:
    """The task's own [agent] timeout_sec ends the agent; as in Harbor, the verifier still
    scores what it left, and the run reports TIMED_OUT with that reward."""
    task = make_task(agent_timeout=1.0)
    command = "echo 42 > answer.txt; sleep 600"
    result = await runs_client.wait(
        await runs_client.submit(spec_for(task, agent="x", agent_settings={"command": command})),
        timeout_seconds=WAIT,
    )
    assert result.status is RunStatus.TIMED_OUT
    assert result.rewards == {"reward": 1.0}
    assert result.error is not None
    assert "agent timed out" in result.error


async def test_wait_timeout_then_cancel(
    runs_client: RunsApiTaskServer, task_server: RunningTaskServer, make_task: MakeTask
) -> None:
    """wait() raises TaskServerTimeoutError and leaves the run running; cancel() stops it,
    kills its process and is idempotent."""
    command = "echo $$ > agent.pid; exec sleep 600"
    handle = await runs_client.submit(
        spec_for(make_task(), agent="x", agent_settings={"command": command})
    )
    with pytest.raises(TaskServerTimeoutError):
        await runs_client.wait(handle, timeout_seconds=0.3)
    pid_file = task_server.server.runs_dir / handle.run_id / "workspace" / "agent.pid"
    await until(pid_file.exists, "the agent to start")
    assert (await runs_client.status(handle)).status is RunStatus.RUNNING
    await runs_client.cancel(handle)
    result = await runs_client.wait(handle, timeout_seconds=WAIT)
    assert result.status is RunStatus.CANCELLED
    await until(lambda: not _alive(int(pid_file.read_text())), "the agent to be killed")
    await runs_client.cancel(handle)
    assert (await runs_client.status(handle)).status is RunStatus.CANCELLED


async def test_concurrency_limit_queues_and_cancel_while_queued(
    tmp_path: Path, make_task: MakeTask
) -> None:
    """With one slot a second run stays QUEUED until the first finishes; a queued run can be
    cancelled and never starts."""
    running = await start_task_server(
        TaskServerConfig(port=0, runs_dir=tmp_path / "one", max_concurrent_runs=1)
    )
    try:
        async with RunsApiTaskServer(running.url) as client:
            gate = tmp_path / "go"
            hold = f"while [ ! -f {gate} ]; do sleep 0.02; done; echo 42 > answer.txt"
            first = await client.submit(
                spec_for(make_task(), agent="x", agent_settings={"command": hold})
            )
            second = await client.submit(spec_for(make_task(solve_sh="echo 42 > /app/answer.txt")))
            third = await client.submit(spec_for(make_task(solve_sh="echo 42 > /app/answer.txt")))
            await until(
                lambda: running.server.runs[first.run_id].status is RunStatus.RUNNING, "first"
            )
            assert (await client.status(second)).status is RunStatus.QUEUED
            await client.cancel(third)
            gate.touch()
            assert (await client.wait(first, timeout_seconds=WAIT)).reward == 1.0
            assert (await client.wait(second, timeout_seconds=WAIT)).reward == 1.0
            cancelled = await client.wait(third, timeout_seconds=WAIT)
            assert cancelled.status is RunStatus.CANCELLED
            assert running.server.runs[third.run_id].started_at is None
    finally:
        await running.stop()


async def test_missing_test_script_is_refused(
    runs_client: RunsApiTaskServer, task_server: RunningTaskServer, make_task: MakeTask
) -> None:
    """A task without tests/test.sh is refused with a clear error, client side and server
    side (a raw archive), and no run is created."""
    task = make_task()
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(TaskDefinitionError, match=r"tests/test\.sh is missing"):
        await runs_client.submit(spec_for(task))
    status, body = await _post_raw(
        task_server.url, _tar({"task.toml": b"", "instruction.md": b"x"})
    )
    assert status == 400
    assert body["error"]["code"] == "invalid_task"
    assert "tests/test.sh is missing" in body["error"]["message"]
    assert task_server.server.runs == {}
    assert list(task_server.server.runs_dir.iterdir()) == []


async def test_unsafe_archive_is_refused(task_server: RunningTaskServer) -> None:
    """An archive with a path leaving its directory is refused and nothing is written."""
    status, body = await _post_raw(task_server.url, _tar({"../escape.txt": b"boo"}))
    assert status == 400
    assert body["error"]["code"] == "invalid_task"
    assert not (task_server.server.runs_dir.parent / "escape.txt").exists()
    status, body = await _post_raw(task_server.url, b"not a tarball")
    assert status == 400
    assert "not a readable tar" in body["error"]["message"]


async def test_bad_spec_and_unknown_agent_are_refused(
    runs_client: RunsApiTaskServer, task_server: RunningTaskServer, make_task: MakeTask
) -> None:
    """Invalid spec fields, an unknown agent, or an oracle without a solution are 400s."""
    task = make_task()
    with pytest.raises(TaskDefinitionError, match="unknown agent 'nobody'"):
        await runs_client.submit(spec_for(task, agent="nobody"))
    with pytest.raises(TaskDefinitionError, match=r"oracle agent needs solution/solve\.sh"):
        await runs_client.submit(spec_for(task))
    with pytest.raises(TaskServerError, match="timeout_seconds"):
        await runs_client.submit(spec_for(make_task(solve_sh="true"), timeout_seconds=-1.0))
    status, body = await _post_raw(task_server.url, _tar({}), spec=b"{not json")
    assert status == 400
    assert body["error"]["code"] == "invalid_spec"
    assert task_server.server.runs == {}


async def test_unknown_run_and_unreachable_server(runs_client: RunsApiTaskServer) -> None:
    """An unknown run id is a TaskServerError (404); a server that is down too."""
    from sdk.taskserver.base import RunHandle, RunId

    with pytest.raises(TaskServerError, match="run_not_found"):
        await runs_client.wait(RunHandle(RunId("nope"), "x"), timeout_seconds=1)
    async with RunsApiTaskServer("http://127.0.0.1:9") as down:
        with pytest.raises(TaskServerError, match="unreachable"):
            await down.status(RunHandle(RunId("nope"), "x"))


async def test_token_is_required_when_configured(tmp_path: Path, make_task: MakeTask) -> None:
    """With a token, requests without it get 401 and nothing runs; with it they work."""
    running = await start_task_server(
        TaskServerConfig(port=0, runs_dir=tmp_path / "auth", token="s3cret")
    )
    try:
        task = make_task(solve_sh="echo 42 > /app/answer.txt")
        async with RunsApiTaskServer(running.url) as anonymous:
            with pytest.raises(TaskServerError, match="401"):
                await anonymous.submit(spec_for(task))
        assert running.server.runs == {}
        async with RunsApiTaskServer(running.url, token="s3cret") as client:
            result = await client.wait(await client.submit(spec_for(task)), timeout_seconds=WAIT)
            assert result.reward == 1.0
    finally:
        await running.stop()


async def test_forget_deletes_the_run_directory(
    runs_client: RunsApiTaskServer, task_server: RunningTaskServer, make_task: MakeTask
) -> None:
    """DELETE forgets a run and removes its directory."""
    handle = await runs_client.submit(spec_for(make_task(solve_sh="echo 42 > /app/answer.txt")))
    await runs_client.wait(handle, timeout_seconds=WAIT)
    run_dir = task_server.server.runs_dir / handle.run_id
    assert run_dir.is_dir()
    await runs_client.forget(handle)
    assert not run_dir.exists()
    with pytest.raises(TaskServerError, match="404"):
        await runs_client.status(handle)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def _post_raw(
    url: str, archive: bytes, spec: bytes | None = None
) -> tuple[int, dict[str, object]]:
    body = (
        spec
        or json.dumps(
            {"agent": "oracle", "model": "m", "base_url": "http://x/v1", "api_key": "k"}
        ).encode()
    )
    form = aiohttp.FormData()
    form.add_field("spec", body.decode(), content_type="application/json")
    form.add_field("task", archive, filename="t.tar.gz", content_type="application/gzip")
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/api/v1/runs", data=form) as response,
    ):
        return response.status, await response.json()
