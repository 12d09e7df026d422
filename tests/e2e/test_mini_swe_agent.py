"""A real third-party agent, mini-swe-agent (PyPI), runs an episode through the proxy.

mini-swe-agent pins litellm, which pins ``openai<3``, so it lives in its own environment
(``scripts/mswea-env.sh`` → ``.cache/mswea-venv``) and runs here as its real CLI, offline,
against the real proxy, the real ``hf`` worker and the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from sdk.client import ProxyClient
from sdk.fidelity import check_fidelity
from tests.e2e.conftest import TIMEOUT_FACTOR
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / ".cache" / "mswea-venv" / "bin" / "mini"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@pytest.fixture(scope="module")
def mini() -> Path:
    """The ``mini`` CLI from its side environment (made once by ``make setup``)."""
    subprocess.run([str(ROOT / "scripts" / "mswea-env.sh")], check=True, cwd=ROOT)
    assert MINI.is_file()
    return MINI


def _agent_env(home: Path, api_key: str) -> dict[str, str]:
    """Offline and non-interactive: no config wizard, no cost-map download, no cost
    errors for an unknown model."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "MSWEA_"))}
    return env | {
        "HOME": str(home),
        "MSWEA_CONFIGURED": "true",
        "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "OPENAI_API_KEY": api_key,
        "NO_COLOR": "1",
    }


def _responses(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """Every chat completion the agent received, in order: on assistant messages, and on
    the format-error messages it adds when a reply had no usable tool call."""
    return [
        m["extra"]["response"]
        for m in trajectory["messages"]
        if isinstance(m.get("extra", {}).get("response"), dict)
    ]


async def test_mini_swe_agent_episode_is_recorded_token_exact(
    mini: Path, proxy_client: ProxyClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """mini-swe-agent's episode is recorded turn by turn; every turn's sampled ids are
    what the agent received, and teacher forcing reproduces every recorded logprob."""
    trial = await proxy_client.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
    workdir = tmp_path / "repo"
    workdir.mkdir()
    (workdir / "hello.py").write_text("print('hello')\n")
    output = tmp_path / "traj.json"
    process = await asyncio.create_subprocess_exec(
        str(mini),
        "-m",
        "openai/tiny",
        "-t",
        "Make hello.py print 'hello world'.",
        "-y",
        "--exit-immediately",
        "-l",
        "0",
        "-c",
        "mini.yaml",
        "-c",
        f"model.model_kwargs.api_base={trial.base_url}",
        "-c",
        "model.model_kwargs.seed=7",
        "-c",
        "agent.step_limit=4",
        "-c",
        f"environment.cwd={workdir}",
        "-o",
        str(output),
        cwd=tmp_path,
        env=_agent_env(tmp_path, trial.api_key),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    log, _ = await asyncio.wait_for(process.communicate(), timeout=600 * TIMEOUT_FACTOR)
    assert process.returncode == 0, log.decode(errors="replace")[-4000:]
    trajectory = json.loads(output.read_text())
    received = _responses(trajectory)
    # The random tiny model rarely emits a usable tool call, so the episode usually ends
    # on mini-swe-agent's own limits; what matters is that it ran and talked to the proxy.
    assert trajectory["info"]["exit_status"]
    assert trajectory["info"]["model_stats"]["api_calls"] == len(received) >= 2

    await proxy_client.complete(trial.trial_id, reward=0.0)
    export = await proxy_client.trajectories(trial.trial_id)
    turns: dict[int, list[int]] = {}
    for traj in export["trajectories"]:
        for turn in traj["turns"]:
            assert turn["api"] == "openai.chat"
            ids = traj["response_ids"][turn["response_start"] : turn["response_end"]]
            assert turns.setdefault(turn["turn"], ids) == ids
    assert sorted(turns) == list(range(len(received)))

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    stop_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    for index, response in enumerate(received):
        ids = turns[index]
        assert response["usage"]["completion_tokens"] == len(ids)
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert isinstance(text, str)
        message = response["choices"][0]["message"]
        content = message.get("content") or ""
        calls = message.get("tool_calls") or []
        if calls:
            decoded = [json.loads(m) for m in _CALL.findall(text)]
            got = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in calls
            ]
            assert decoded == got
            assert text.startswith(content)
        else:
            assert text == content

    report = check_fidelity(export, HFEngine.load(tiny_model_dir).score)
    assert report.sampled_tokens >= sum(len(ids) for ids in turns.values()) > 0
    assert report.max_abs_error <= 1e-4, report
