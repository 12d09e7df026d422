"""Claude Code and Codex themselves (the npm CLIs, ``scripts/agent-clis.sh``) run reasoning,
tool-using episodes through the proxy on real families' templates.

The worker serves a scripted policy (``tests.scripted_policy``): it reasons, then calls the
agent's own shell tool twice in the family's native markup (only once its prompt shows that
tool), then answers; every token's
logprob is the family's tiny model's. The agents really run the commands, get the
reasoning back in their API's form (Anthropic ``thinking`` blocks, Responses ``reasoning``
items) and send it back with the next request. Each episode must be one chain of
continued turns, the sampled ids verbatim in later prompts, and re-score by teacher
forcing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient, TrialSession
from sdk.fidelity import check_fidelity
from sdk.samples import build_samples
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.e2e.link import Link
from tests.families import FAMILIES, family_model
from tests.scripted_policy import ScriptedEngine, Turn
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel, WorkerClient

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".cache" / "npm" / "bin"
AGENT_FAMILIES = ["qwen3", "gpt_oss"]
TASK = "TASK-7f3: print the two markers, then report them."
ANSWER = "Finished: relayout-1 and relayout-2."
# The command prints a marker that its own text does not contain, so the number of
# commands already run is the number of markers in the prompt's tool outputs.
MARKER = "relayout-"


def command(step: int) -> str:
    return f"printf 'relay%s-%s' out {step}"


@dataclass(frozen=True)
class Agent:
    name: str
    tool: str  # the agent's shell tool
    arguments: str  # the name of that tool's command argument

    def call(self, step: int) -> tuple[str, dict[str, Any]]:
        args: dict[str, Any] = {self.arguments: command(step)}
        if self.name == "claude":
            args["description"] = f"Print marker {step}"
        return self.tool, args


AGENTS = {
    "claude": Agent("claude", "Bash", "command"),
    "codex": Agent("codex", "exec_command", "cmd"),
}
# What a prompt that shows an agent's shell tool contains besides its name: the names of
# the parameters the policy fills in.
DEFINITIONS = {"Bash": ("command", "description"), "exec_command": ("cmd",)}


def policy(agent: Agent) -> Any:
    """Two commands, then the answer; requests that are not the task's (an agent's side
    requests) get a short answer."""

    def reply(prompt: str) -> Turn:
        if TASK not in prompt:
            return Turn("", "OK.")
        done = prompt.count(MARKER)
        if done >= 2:
            return Turn("Both markers are printed.", ANSWER)
        return Turn(f"Step {done + 1}: print marker {done + 1}.", "", (agent.call(done + 1),))

    return reply


@pytest.fixture(scope="module")
def clis() -> Path:
    """The CLIs, installed once under .cache/npm."""
    subprocess.run([str(ROOT / "scripts" / "agent-clis.sh")], check=True, cwd=ROOT)
    return BIN


@pytest.fixture
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent's home and working directory: the same path in every test, emptied before
    each. Claude Code's system prompt names its working directory ahead of its ~20k tokens
    of tool definitions, so with one path the scripted engine's cached prefix serves the
    next test's first request too."""
    path = tmp_path_factory.getbasetemp() / "agent-home"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path


@pytest.fixture(scope="module")
async def agent_stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[RunningProxy, dict[str, ScriptedEngine]]]:
    # Claude Code sends ~77K characters of system prompt and tool schemas.
    config = ProxyConfig(
        port=0,
        max_tokens=4096,
        max_body_bytes=16 * 1024 * 1024,
        cache_dir=tmp_path_factory.mktemp("agent-clis"),
    )
    running = await start_proxy(config)
    engines: dict[str, ScriptedEngine] = {}
    for name in AGENT_FAMILIES:
        directory = family_model(name)
        engine = ScriptedEngine(
            HFEngine.load(directory, name=name),
            AutoTokenizer.from_pretrained(str(directory)),
            write=FAMILIES[name].reply,
            tools=DEFINITIONS,
        )
        engines[name] = engine
        client = WorkerClient(
            running.worker_url, {name: ServedModel(engine, directory)}, worker_id=f"w-{name}"
        )
        running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    await running.wait_for_workers(len(AGENT_FAMILIES), within_seconds=120 * TIMEOUT_FACTOR)
    yield running, engines
    await running.stop()


def _claude(
    bin_dir: Path, trial: TrialSession, family: str, home: Path
) -> tuple[list[str], dict[str, str]]:
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": trial.anthropic_base_url,
        "ANTHROPIC_API_KEY": trial.api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    argv = [
        str(bin_dir / "claude"),
        "-p",
        TASK,
        "--model",
        family,
        "--output-format",
        "json",
        "--allowedTools",
        "Bash",
        "--max-turns",
        "6",
    ]
    return argv, env


def _codex(
    bin_dir: Path, trial: TrialSession, family: str, home: Path
) -> tuple[list[str], dict[str, str]]:
    codex_home = home / "codex"
    codex_home.mkdir()
    # A provider on the trial's base URL; nothing else leaves loopback.
    (codex_home / "config.toml").write_text(
        f'model = "{family}"\n'
        'model_provider = "relay"\n'
        "[model_providers.relay]\n"
        'name = "relay"\n'
        f'base_url = "{trial.base_url}"\n'
        'env_key = "RELAY_TRIAL_KEY"\n'
        'wire_api = "responses"\n'
        "[features]\nplugins = false\nremote_plugin = false\napps = false\n"
        "[analytics]\nenabled = false\n"
        '[otel]\nmetrics_exporter = "none"\n'
    )
    env = {"HOME": str(home), "CODEX_HOME": str(codex_home), "RELAY_TRIAL_KEY": trial.api_key}
    argv = [
        str(bin_dir / "codex"),
        "exec",
        "--json",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "-C",
        str(home),
        TASK,
    ]
    return argv, env


async def run_agent(
    bin_dir: Path, agent: str, trial: TrialSession, family: str, home: Path, *, check: bool = True
) -> tuple[int, str]:
    """Run the agent CLI to its end: its exit code and its output (with ``check``, a
    non-zero exit fails the test)."""
    make = _claude if agent == "claude" else _codex
    argv, extra = make(bin_dir, trial, family, home)
    return await run_cli(argv, extra, home, check=check)


async def run_cli(
    argv: list[str], extra: dict[str, str], home: Path, *, check: bool = True
) -> tuple[int, str]:
    """Run an agent CLI in ``home`` with ``extra`` over a bare environment, at most 300 s
    (scaled): its exit code and its output (with ``check``, a non-zero exit fails the
    test)."""
    keep = {"PATH", "LANG", "TMPDIR"}
    env = {k: v for k, v in os.environ.items() if k in keep} | extra
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=home,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 300 * TIMEOUT_FACTOR)
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
    if check:
        assert process.returncode == 0, (out.decode()[-2000:], err.decode()[-2000:])
    return process.returncode or 0, out.decode() + err.decode()[-2000:]


@pytest.mark.parametrize("family", AGENT_FAMILIES)
@pytest.mark.parametrize("agent", sorted(AGENTS))
async def test_agent_cli_runs_a_reasoning_episode_as_one_chain(
    clis: Path,
    agent_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
    agent: str,
    family: str,
    home: Path,
) -> None:
    """The agent runs both commands and reports them; the session is one trajectory of
    continued turns, each later request sends the earlier turns' reasoning back, the
    sampled ids are verbatim in the next prompt, and fidelity holds."""
    running, engines = agent_stack
    engine = engines[family]
    engine.prompts.clear()
    engine.sampled.clear()
    engine.unseen.clear()
    engine.policy = policy(AGENTS[agent])
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model=family)
        _, output = await run_agent(clis, agent, trial, family, home)
        export = await proxy.trajectories(trial.trial_id)

    assert engine.unseen == []  # the policy saw the tool it called
    assert ANSWER in output
    (trajectory,) = export["trajectories"]
    turns = trajectory["turns"]
    assert [t["branch_reason"] for t in turns] == ["new_session", "continued", "continued"]
    assert [t["tool_calls"] for t in turns] == [1, 1, 0]
    # Each request carried back the reasoning of every earlier turn, in the API's form.
    assert [t["reasoning_returned"] for t in turns] == [0, 1, 2]
    prompts, sampled = engine.prompts, engine.sampled
    assert len(prompts) == 3
    for a in range(2):
        assert prompts[a + 1][: len(prompts[a]) + len(sampled[a])] == prompts[a] + sampled[a]
    report = check_fidelity(export, engine.scorer.score)
    assert report.ok(), report


LONG_ANSWER = "Finished: relayout-1. " + " ".join(f"detail{i}" for i in range(120))


def capped_policy(agent: Agent) -> Any:
    """One command, then an answer far longer than the session's cap."""

    def reply(prompt: str) -> Turn:
        if TASK not in prompt:
            return Turn("", "OK.")
        if prompt.count(MARKER) == 0:
            return Turn("", "", (agent.call(1),))
        return Turn("", LONG_ANSWER)

    return reply


@pytest.mark.parametrize("cap_finish", ["length", "stop"])
@pytest.mark.parametrize("agent", sorted(AGENTS))
async def test_a_reply_cut_by_the_trainers_cap(
    clis: Path,
    agent_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
    agent: str,
    cap_finish: str,
    home: Path,
) -> None:
    """The session caps replies at 96 tokens; the final answer is longer. With
    ``cap_finish: "length"`` the agent is told its own limit was hit and fails the run;
    with ``"stop"`` it takes the cut answer as the end of the turn and finishes. The record
    says the turn was cut either way."""
    running, engines = agent_stack
    engine = engines["qwen3"]
    engine.prompts.clear()
    engine.sampled.clear()
    engine.policy = capped_policy(AGENTS[agent])
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(
            model="qwen3", sampling={"max_tokens": 96}, cap_finish=cap_finish
        )
        code, output = await run_agent(clis, agent, trial, "qwen3", home, check=False)
        export = await proxy.trajectories(trial.trial_id)
        summary = await proxy.get_session(trial.trial_id)

    assert summary["cap_finish"] == cap_finish
    turns = [t for traj in export["trajectories"] for t in traj["turns"]]
    last = max(turns, key=lambda t: t["turn"])
    assert (last["finish_reason"], last["capped"], last["completion_tokens"]) == (
        "length",
        True,
        96,
    )
    first = min(turns, key=lambda t: t["turn"])
    assert first["capped"] is False
    if cap_finish == "stop":
        assert code == 0, output
        assert "Finished: relayout-1." in output
    else:
        failed = code != 0 or (agent == "claude" and json.loads(output).get("is_error"))
        assert failed, output


async def test_codex_resends_a_lost_stream_and_gets_the_recorded_reply(
    clis: Path,
    agent_stack: tuple[RunningProxy, dict[str, ScriptedEngine]],
    home: Path,
) -> None:
    """Codex's first stream is lost on the wire after the proxy wrote all of it: Codex
    sends the whole request again (its ``x-client-request-id`` unchanged) and gets the
    recorded reply, nothing is sampled twice, and the episode trains each turn once."""
    running, engines = agent_stack
    engine = engines["qwen3"]
    engine.prompts.clear()
    engine.policy = policy(AGENTS["codex"])
    link = Link(int(running.url.rsplit(":", 1)[1]))
    await link.start()
    link.plans = ["after"]
    try:
        async with ProxyClient(running.url) as proxy:
            trial = await proxy.create_session(model="qwen3")
            through = dataclasses.replace(trial, base_url=link.url(trial.base_url))
            _, output = await run_agent(clis, "codex", through, "qwen3", home)
            export = await proxy.trajectories(trial.trial_id)
    finally:
        await link.stop()
    assert ANSWER in output
    (trajectory,) = export["trajectories"]
    turns = trajectory["turns"]
    assert [t["replays"] for t in turns] == [1, 0, 0]
    assert all(t["delivered"] for t in turns)
    assert len(engine.prompts) == 3  # three generations for four requests
    (sample,) = build_samples(export)
    assert sample.sampled_tokens == sum(t["completion_tokens"] for t in turns)
