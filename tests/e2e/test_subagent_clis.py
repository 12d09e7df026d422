"""Claude Code itself (the pinned npm CLI) delegates a step to a sub-agent through its Agent
tool, through the proxy: the sub-agent's turns are recorded as its own agent, the
sub-agent's first turn names the main turn and the tool call that spawned it, and
``GET /sessions/<trial>/agents`` lists both. Both pinned versions (2.1.197, and 2.1.332 with
its gateway hint headers) also ask for a session title (2.1.197 only) and compact the
conversation on ``/compact``: each turn is recorded with the kind of request it is (the
main agent's own work, a sub-agent's, a compaction, or an auxiliary request such as the
title), and the samples a trainer builds train the main agent's chain that ends in its
answer.

The worker serves a scripted policy on a family's tiny model (``tests.scripted_policy``,
as the agent-CLI tests do): the main agent calls the Agent tool once its prompt shows
it, the sub-agent answers the prompt it was given, and the main agent reports what came
back.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient, TrialSession
from sdk.samples import TRAINED_KINDS, BranchPolicy, Sample, build_samples, main_sample
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
DEFINITIONS = {
    AGENT_TOOL: ("description", "prompt", "subagent_type"),
    "Bash": ("command", "description"),
}

# Claude Code 2.1.197's title request (no tools; the task inside <session> tags), as its
# system prompt begins, and what the policy answers it.
TITLE_PROMPT = "Generate a concise, sentence-case title (3-7 words)"
TITLE = '{"title": "Workspace check title-5d2"}'
# Both versions' /compact request: the conversation so far, then this instruction.
COMPACT_PROMPT = "Your task is to create a detailed summary of the conversation so far"
SUMMARY_MARKER = "SUMMARY-6b8"
SUMMARY = f"<analysis>Two markers.</analysis>\n<summary>{SUMMARY_MARKER}: both printed.</summary>"
COMPACT_TASK = "TASK-6b8: print the two markers, then report them."
COMPACT_ANSWER = "Finished: compout-1 and compout-2."
# The command prints a marker its own text does not contain (see test_agent_clis).
COMPACT_MARKER = "compout-"
NEXT_TASK = "TASK-6b8-next: say which markers were printed."
NEXT_ANSWER = "Final: the markers were compout-1 and compout-2."


TWO_TASK = "TASK-8e4: have two helper agents check the workspace at once, then report."
TWO_PROMPTS = (
    "SUBTASK-8e4-a: say that part a is ready.",
    "SUBTASK-8e4-b: say that part b is ready.",
)
TWO_ANSWERS = ("Helper report: part-a-ready-8e4.", "Helper report: part-b-ready-8e4.")
TWO_ANSWER = "Finished: both helpers said ready-8e4."


def policy(prompt: str) -> Turn:
    """The main agent delegates once, then reports; the sub-agent answers its prompt; a
    title request gets a title and a compaction request a summary; the compaction episode
    runs two commands, then reports; anything else (an agent's side requests) gets a short
    answer."""
    if TITLE_PROMPT in prompt:
        return Turn("", TITLE)
    if COMPACT_PROMPT in prompt:  # the whole conversation so far, to be summarised
        return Turn("", SUMMARY)
    if NEXT_TASK in prompt:  # after the compaction: the summary and the next task
        return Turn("", NEXT_ANSWER)
    if COMPACT_TASK in prompt:
        done = prompt.count(COMPACT_MARKER)
        if done >= 2:
            return Turn("Both markers are printed.", COMPACT_ANSWER)
        step = done + 1
        call: dict[str, Any] = {
            "command": f"printf 'comp%s-%s' out {step}",
            "description": f"Marker {step}",
        }
        return Turn(f"Step {step}: print marker {step}.", "", (("Bash", call),))
    if TASK in prompt:
        if SUB_ANSWER in prompt:  # the sub-agent's answer came back as the tool's result
            return Turn("", ANSWER)
        # In the foreground: 2.1.332 runs an Agent call in the background by default, its
        # answer coming back later as a notification rather than as the call's result.
        call = {
            "description": "Check the workspace",
            "prompt": SUB_PROMPT,
            "subagent_type": "general-purpose",
            "run_in_background": False,
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


async def claude_print(
    bin_dir: Path, trial: TrialSession, home: Path, args: Sequence[str], env: dict[str, str]
) -> str:
    """``claude -p <args>`` against the trial with ``env``, in ``home``, to its end (a
    non-zero exit fails the test): its output."""
    base = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": trial.anthropic_base_url,
        "ANTHROPIC_API_KEY": trial.api_key,
        "DISABLE_AUTOUPDATER": "1",
    }
    argv = [str(bin_dir / "claude"), "-p", *args, "--model", FAMILY, "--output-format", "json"]
    _, output = await run_cli(argv, base | env, home)
    return output


async def run_claude(clis: Path, trial: TrialSession, task: str, home: Path) -> str:
    """Claude Code on ``task`` against the trial, to its end (a non-zero exit fails the
    test): its output. Gateway hint headers on, so it says each request's class."""
    env = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "CLAUDE_CODE_GATEWAY_HINT_HEADERS": "1"}
    args = [task, "--allowedTools", AGENT_TOOL, "--max-turns", "6"]
    return await claude_print(clis, trial, home, args, env)


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


@dataclass(frozen=True)
class Claude:
    """A pinned Claude Code: where it is installed, what it runs with, and whether it asks
    for a session title in ``-p`` mode (2.1.332 does not)."""

    bin_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    sends_title: bool = False


# Only the traffic that reaches other hosts is off: CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC
# would also turn off 2.1.197's title request.
QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"}
CLAUDES = {
    "2.1.197": Claude(BIN, QUIET, sends_title=True),
    "2.1.332": Claude(
        ROOT / ".cache" / "npm-claude-next" / "bin",
        QUIET | {"CLAUDE_CODE_GATEWAY_HINT_HEADERS": "1"},
    ),
}
MAIN = {"id": "main", "parent": None, "kind": "main"}


def replies(export: dict[str, Any], tokenizer: Any) -> dict[int, str]:
    """Each recorded turn's sampled text, by turn index."""
    texts: dict[int, str] = {}
    for trajectory in export["trajectories"]:
        ids = trajectory["response_ids"]
        for turn in trajectory["turns"]:
            span = ids[turn["response_start"] : turn["response_end"]]
            texts[turn["turn"]] = str(tokenizer.decode(span))
    return texts


def agent_calls(home: Path, session_id: str) -> list[tuple[str, str]]:
    """Claude Code's own record (its transcript) of the session's Agent calls: each call's
    id as Claude Code received it, and the agent id it gave the sub-agent (the one its
    ``x-claude-code-agent-id`` header carries)."""
    (transcript,) = home.glob(f".claude/projects/*/{session_id}.jsonl")
    calls = []
    for line in transcript.read_text().splitlines():
        entry = json.loads(line)
        result = entry.get("toolUseResult")
        if isinstance(result, dict) and "agentId" in result:
            for block in entry["message"]["content"]:
                if block.get("type") == "tool_result":
                    calls.append((block["tool_use_id"], result["agentId"]))
    return calls


def trained_turns(samples: Sequence[Sample]) -> set[int]:
    """The turns some sample trains whole: every sampled token of the turn masked 1."""
    trained = set()
    for sample in samples:
        for turn in sample.turns:
            mask = sample.response_mask[turn["response_start"] : turn["response_end"]]
            if len(mask) == turn["completion_tokens"] and all(mask):
                trained.add(turn["turn"])
    return trained


@pytest.mark.parametrize("version", sorted(CLAUDES))
async def test_claude_code_title_main_and_sub_agent_turns_have_their_kinds(
    clis: Path, stack: tuple[RunningProxy, ScriptedEngine], version: str, tmp_path: Path
) -> None:
    """Title: auxiliary; main turns: main; sub-agent: its id, its spawn; main_sample: the answer."""
    running, engine = stack
    claude = CLAUDES[version]
    engine.unseen.clear()
    session_id = str(uuid.uuid4())
    args = [TASK, "--session-id", session_id, "--allowedTools", AGENT_TOOL, "--max-turns", "6"]
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model=FAMILY)
        out = await claude_print(claude.bin_dir, trial, tmp_path, args, claude.env)
        export = await proxy.trajectories(trial.trial_id)

    assert engine.unseen == []
    assert ANSWER in out
    turns = {t["turn"]: t for tr in export["trajectories"] for t in tr["turns"]}
    texts = replies(export, engine.tokenizer)
    titles = [i for i, text in texts.items() if TITLE in text]
    subs = sorted(i for i, text in texts.items() if SUB_ANSWER in text)
    mains = sorted(set(turns) - set(titles) - set(subs))
    assert len(titles) == int(claude.sends_title)
    assert subs
    ((call_id, sub_id),) = agent_calls(tmp_path, session_id)
    (spawner,) = [i for i in mains if SUB_PROMPT in texts[i]]  # the reply with the call
    observed = {i: turns[i]["agent"] for i in sorted(turns)}
    assert {i: observed[i] for i in titles} == {i: MAIN | {"kind": "auxiliary"} for i in titles}
    assert {i: observed[i] for i in mains} == dict.fromkeys(mains, MAIN)
    sub_agent = {"id": sub_id, "parent": "main", "kind": "subagent"}
    assert {i: observed[i] for i in subs} == dict.fromkeys(subs, sub_agent)
    assert turns[subs[0]]["spawned_by"] == {"turn": spawner, "tool_call_id": call_id}

    samples = build_samples(export, kinds=TRAINED_KINDS)
    assert set(mains) <= trained_turns(samples)
    assert not {t["turn"] for s in samples for t in s.turns} & set(titles)
    chosen = main_sample(samples)
    assert chosen.agent_id == "main"
    assert ANSWER in texts[chosen.turns[-1]["turn"]]


@pytest.mark.parametrize("version", sorted(CLAUDES))
async def test_claude_code_compact_is_the_main_agents_compaction_turn(
    clis: Path, stack: tuple[RunningProxy, ScriptedEngine], version: str, tmp_path: Path
) -> None:
    """/compact: the main agent's compaction turn; main turns all train; main_sample: the answer."""
    running, engine = stack
    claude = CLAUDES[version]
    engine.unseen.clear()
    session_id = str(uuid.uuid4())
    bash = ["--tools", "Bash", "--allowedTools", "Bash", "--max-turns", "6"]
    async with ProxyClient(running.url) as proxy:
        trial = await proxy.create_session(model=FAMILY)
        runs = (
            [COMPACT_TASK, "--session-id", session_id, *bash],
            ["/compact", "--resume", session_id, "--tools", "Bash"],
            [NEXT_TASK, "--resume", session_id, *bash],
        )
        outs = [await claude_print(claude.bin_dir, trial, tmp_path, a, claude.env) for a in runs]
        export = await proxy.trajectories(trial.trial_id)

    assert engine.unseen == []
    assert COMPACT_ANSWER in outs[0]
    assert NEXT_ANSWER in outs[2]
    turns = {t["turn"]: t for tr in export["trajectories"] for t in tr["turns"]}
    texts = replies(export, engine.tokenizer)
    titles = [i for i, text in texts.items() if TITLE in text]
    (compaction,) = [i for i, text in texts.items() if SUMMARY_MARKER in text]
    mains = sorted(set(turns) - set(titles) - {compaction})
    assert len(titles) == int(claude.sends_title)
    assert len(mains) == 4  # two commands, the report, then the next task's answer
    (final,) = [i for i in mains if NEXT_ANSWER in texts[i]]
    assert compaction < final
    assert turns[final]["parent"] is None  # after the compaction: a new root
    observed = {i: turns[i]["agent"] for i in sorted(turns)}
    assert observed[compaction] == MAIN | {"kind": "compaction"}
    assert {i: observed[i] for i in mains} == dict.fromkeys(mains, MAIN)

    samples = build_samples(export, policy=BranchPolicy.LAST)
    assert set(mains) <= trained_turns(samples)
    chosen = main_sample(samples)
    assert chosen.agent_id == "main"
    assert chosen.turns[-1]["turn"] == final
    assert compaction not in {t["turn"] for t in chosen.turns}
