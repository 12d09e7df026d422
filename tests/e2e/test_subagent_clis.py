"""Claude Code itself (the pinned npm CLI) delegates a step to a sub-agent through its Agent
tool, through the proxy: the sub-agent's turns are recorded as its own agent, the
sub-agent's first turn names the main turn and the tool call that spawned it, and
``GET /sessions/<trial>/agents`` lists both.

The worker serves a scripted policy on a family's tiny model (``tests.scripted_policy``,
as the agent-CLI tests do): the main agent calls the Agent tool once its prompt shows
it, the sub-agent answers the prompt it was given, and the main agent reports what came
back.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient, TrialSession
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.e2e.test_agent_clis import BIN, ROOT, run_cli
from tests.families import FAMILIES, family_model
from tests.scripted_policy import ScriptedEngine, Turn
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel, WorkerClient

pytestmark = pytest.mark.e2e

FAMILY = "qwen3"
TASK = "TASK-5d2: have a helper agent check the workspace, then report what it said."
SUB_PROMPT = "SUBTASK-5d2: say that the workspace is ready."
SUB_ANSWER = "Helper report: workspace-ready-5d2."
ANSWER = "Finished: the helper said workspace-ready-5d2."
AGENT_TOOL = "Agent"
DEFINITIONS = {AGENT_TOOL: ("description", "prompt", "subagent_type")}


TWO_TASK = "TASK-8e4: have two helper agents check the workspace at once, then report."
TWO_PROMPTS = (
    "SUBTASK-8e4-a: say that part a is ready.",
    "SUBTASK-8e4-b: say that part b is ready.",
)
TWO_ANSWERS = ("Helper report: part-a-ready-8e4.", "Helper report: part-b-ready-8e4.")
TWO_ANSWER = "Finished: both helpers said ready-8e4."


def policy(prompt: str) -> Turn:
    """The main agent delegates once, then reports; the sub-agent answers its prompt;
    anything else (an agent's side requests) gets a short answer."""
    if TASK in prompt:
        if SUB_ANSWER in prompt:  # the sub-agent's answer came back as the tool's result
            return Turn("", ANSWER)
        call = {
            "description": "Check the workspace",
            "prompt": SUB_PROMPT,
            "subagent_type": "general-purpose",
        }
        return Turn("I will ask a helper.", "", ((AGENT_TOOL, call),))
    if SUB_PROMPT in prompt:
        return Turn("", SUB_ANSWER)
    if TWO_TASK in prompt:
        if all(answer in prompt for answer in TWO_ANSWERS):
            return Turn("", TWO_ANSWER)
        calls = tuple(
            (
                AGENT_TOOL,
                {
                    "description": f"Check part {part}",
                    "prompt": sub_prompt,
                    "subagent_type": "general-purpose",
                },
            )
            for part, sub_prompt in zip("ab", TWO_PROMPTS, strict=True)
        )
        return Turn("I will ask two helpers at once.", "", calls)
    for sub_prompt, answer in zip(TWO_PROMPTS, TWO_ANSWERS, strict=True):
        if sub_prompt in prompt:
            return Turn("", answer)
    return Turn("", "OK.")


@pytest.fixture(scope="module")
def clis() -> Path:
    """The CLIs, installed once under .cache/npm."""
    subprocess.run([str(ROOT / "scripts" / "agent-clis.sh")], check=True, cwd=ROOT)
    return BIN


@pytest.fixture(scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[RunningProxy, ScriptedEngine]]:
    config = ProxyConfig(
        port=0,
        max_tokens=4096,
        max_body_bytes=16 * 1024 * 1024,
        cache_dir=tmp_path_factory.mktemp("subagent-clis"),
    )
    running = await start_proxy(config)
    directory = family_model(FAMILY)
    engine = ScriptedEngine(
        HFEngine.load(directory, name=FAMILY),
        AutoTokenizer.from_pretrained(str(directory)),
        policy,
        write=FAMILIES[FAMILY].reply,
        tools=DEFINITIONS,
    )
    client = WorkerClient(running.worker_url, {FAMILY: ServedModel(engine, directory)})
    running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    await running.wait_for_workers(within_seconds=120 * TIMEOUT_FACTOR)
    yield running, engine
    await running.stop()


async def run_claude(clis: Path, trial: TrialSession, task: str, home: Path) -> str:
    """Claude Code on ``task`` against the trial, to its end (a non-zero exit fails the
    test): its output. Gateway hint headers on, so it says each request's class."""
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": trial.anthropic_base_url,
        "ANTHROPIC_API_KEY": trial.api_key,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_GATEWAY_HINT_HEADERS": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    argv = [str(clis / "claude"), "-p", task, "--model", FAMILY, "--output-format", "json"]
    argv += ["--allowedTools", AGENT_TOOL, "--max-turns", "6"]
    _, output = await run_cli(argv, env, home)
    return output


async def test_claude_code_records_its_sub_agent_and_what_spawned_it(
    clis: Path, stack: tuple[RunningProxy, ScriptedEngine], tmp_path: Path
) -> None:
    """Claude Code's sub-agent works through the trial's base URL; every turn is recorded
    with its agent, the sub-agent's first turn names the main agent's turn and the Agent
    call that spawned it (its id as Claude Code received it), and the agents view lists
    the main agent and the sub-agent under it."""
    running, engine = stack
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model=FAMILY)
        out = await run_claude(clis, trial, TASK, tmp_path)
        export = await proxy.trajectories(trial.trial_id)
        agents = await proxy.agents(trial.trial_id)

    assert engine.unseen == []  # the main agent's prompt showed the Agent tool
    assert ANSWER in out
    turns: dict[int, dict[str, Any]] = {
        t["turn"]: t for trajectory in export["trajectories"] for t in trajectory["turns"]
    }
    main_turns = [t for t in turns.values() if t["agent"]["id"] == "main"]
    sub_turns = [t for t in turns.values() if t["agent"]["kind"] == "subagent"]
    assert main_turns
    assert sub_turns
    (sub_id,) = {t["agent"]["id"] for t in sub_turns}
    assert {t["agent"]["parent"] for t in sub_turns} == {"main"}
    first = min(sub_turns, key=lambda t: t["turn"])
    spawned = first["spawned_by"]
    spawner = turns[spawned["turn"]]
    assert spawner["agent"]["id"] == "main"
    assert spawned["tool_call_id"]
    # Named by Claude Code's own header (x-claude-code-agent-id), not guessed from the
    # content (a sub-agent found by its prompt would take the call's id).
    assert sub_id != spawned["tool_call_id"]
    assert all(t.get("spawned_by") is None for t in sub_turns if t is not first)
    by_id = {a["id"]: a for a in agents if a["kind"] in {"main", "subagent"}}
    assert by_id[sub_id]["parent"] == "main"
    assert by_id[sub_id]["spawned_by"] == spawned
    assert sorted(by_id[sub_id]["turns"]) == sorted(t["turn"] for t in sub_turns)
    assert {a["id"] for a in agents} >= {"main", sub_id}
    # The sub-agent's trajectory is its own: none of its turns continues a main turn.
    for trajectory in export["trajectories"]:
        assert len({t["agent"]["id"] for t in trajectory["turns"]}) == 1


async def test_two_sub_agents_at_once_keep_their_own_chains(
    clis: Path, stack: tuple[RunningProxy, ScriptedEngine], tmp_path: Path
) -> None:
    """Two Agent calls in one reply run as two sub-agents at once: each is its own agent
    with its own turns, spawned by the same main turn through its own call, and no
    trajectory mixes the turns of two agents."""
    running, engine = stack
    engine.unseen.clear()
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model=FAMILY)
        out = await run_claude(clis, trial, TWO_TASK, tmp_path)
        export = await proxy.trajectories(trial.trial_id)
        agents = await proxy.agents(trial.trial_id)

    assert engine.unseen == []
    assert TWO_ANSWER in out
    subs = [a for a in agents if a["kind"] == "subagent"]
    assert len(subs) == 2
    assert len({a["id"] for a in subs}) == 2
    assert {a["parent"] for a in subs} == {"main"}
    spawns = [a["spawned_by"] for a in subs]
    assert len({s["turn"] for s in spawns}) == 1  # the same main turn made both calls
    assert len({s["tool_call_id"] for s in spawns}) == 2
    turns = {t["turn"]: t for tr in export["trajectories"] for t in tr["turns"]}
    assert turns[spawns[0]["turn"]]["agent"]["id"] == "main"
    for trajectory in export["trajectories"]:
        assert len({t["agent"]["id"] for t in trajectory["turns"]}) == 1
