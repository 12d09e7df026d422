"""Token fidelity of a whole agent episode: what the trainer gets is what the policy sampled."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from sdk.client import ProxyClient
from sdk.demo import Workspace, run_episode
from sdk.fidelity import check_fidelity
from worker_client.backends.hf import HFEngine

pytestmark = pytest.mark.e2e

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _sampled_segments(export: dict[str, Any]) -> dict[int, list[int]]:
    """Sampled ids of every turn, by turn index (turns shared by branches agree)."""
    out: dict[int, list[int]] = {}
    for traj in export["trajectories"]:
        for turn in traj["turns"]:
            ids = traj["response_ids"][turn["response_start"] : turn["response_end"]]
            assert all(traj["response_mask"][turn["response_start"] : turn["response_end"]])
            assert out.setdefault(turn["turn"], ids) == ids
    return out


async def test_episode_with_rewrite_and_resume_is_token_exact(
    proxy_client: ProxyClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A 6-turn tool-using episode that rewrites its history once and resumes from an older
    point once exports one trajectory per branch; every recorded logprob matches teacher
    forcing within 1e-4 at temperature 1, and the sampled ids decode to what the agent got."""
    trial = await proxy_client.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
    log = await run_episode(trial, Workspace(tmp_path), turns=6, seed=11, max_tokens=48)
    await proxy_client.complete(trial.trial_id, reward=1.0)
    export = await proxy_client.trajectories(trial.trial_id)

    assert log.branches_made == ["history_rewritten", "resumed_older_point"]
    reasons = [t["branch_reason"] for traj in export["trajectories"] for t in traj["turns"]]
    assert "new_branch" in reasons  # the rewritten history started a new root
    assert len(export["trajectories"]) == 3  # original line, rewritten line, resumed line
    resumed_parents = {
        t["parent"] for traj in export["trajectories"] for t in traj["turns"] if t["turn"] == 4
    }
    assert resumed_parents == {0}  # resumed from the first reply, not the latest turn
    assert export["reward"] == 1.0

    engine = HFEngine.load(tiny_model_dir)
    report = check_fidelity(export, engine.score)
    assert report.sampled_tokens > 50
    assert report.max_abs_error <= 1e-4, report

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    stop_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    segments = _sampled_segments(export)
    assert sorted(segments) == list(range(len(log.received)))
    for index, received in enumerate(log.received):
        ids = segments[index]
        if ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if received.tool_calls:
            decoded_calls = [json.loads(m) for m in _CALL.findall(text)]
            got = [{"name": n, "arguments": json.loads(a)} for n, a in received.tool_calls]
            assert decoded_calls == got
            assert text.startswith(received.content)
        else:
            assert text == received.content


async def test_episode_calls_tools(proxy_client: ProxyClient, tmp_path: Path) -> None:
    """The imprinted tiny model really calls tools, so tool-call turns are exercised."""
    trial = await proxy_client.create_session(sampling={"temperature": 1.0})
    log = await run_episode(trial, Workspace(tmp_path), turns=6, seed=11, max_tokens=48)
    assert log.tool_runs >= 1
