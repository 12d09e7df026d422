"""The session's tree through the real proxy, relay and worker: ``GET /sessions/<trial>/tree``
round-trips to the export for a session that forks, rewrites its history, is cut mid-reply
and retried, and runs a sub-agent (the scripted policy on the tiny model, whose logprobs
are the model's own), and for a vision-language session with images; one forward of the
packed tree scores every recorded token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient, TrialSession
from sdk.samples import build_samples
from sdk.tree import pack_tree
from tests.e2e.conftest import IN_PROCESS_STREAMS, TIMEOUT_FACTOR
from tests.e2e.test_images import PAD, chat_user
from tests.images import GREEN, RED
from tests.scripted_worker import LONG_STORY, PacedScriptedEngine, tiny_reply
from worker_client.tiny_vlm import SHIPPED_TINY_VLM

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a careful agent. Read files before you answer."}


async def _chat(
    http: aiohttp.ClientSession,
    trial: TrialSession,
    messages: list[dict[str, Any]],
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One chat turn; the messages with its reply appended."""
    async with http.post(
        f"{trial.base_url}/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 64},
        headers={"Authorization": f"Bearer {trial.api_key}", **(headers or {})},
    ) as response:
        body = await response.json()
        assert response.status == 200, body
    return [*messages, {"role": "assistant", "content": body["choices"][0]["message"]["content"]}]


async def _cut_then_resent(
    http: aiohttp.ClientSession,
    client: ProxyClient,
    trial: TrialSession,
    messages: list[dict[str, Any]],
) -> None:
    """A streamed request the client leaves after its first event, then, once the cut
    turn is recorded, sends again whole with the same ``x-client-request-id`` (a retry of
    a reply that never arrived: sampled anew)."""
    body = {"model": "m", "messages": messages, "max_tokens": 64, "stream": True}
    headers = {"Authorization": f"Bearer {trial.api_key}", "x-client-request-id": "cut-1"}
    url = f"{trial.base_url}/chat/completions"
    turns = (await client.get_session(trial.trial_id))["turns"]
    async with http.post(url, json=body, headers=headers) as response:
        await response.content.readline()
    await _turns(client, trial.trial_id, turns + 1)
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200
        await response.read()


async def _turns(client: ProxyClient, trial_id: str, turns: int) -> None:
    """Until the trial holds ``turns`` turns (a cut turn is recorded as its handler ends,
    a moment after the client left)."""
    for _ in range(int(100 * TIMEOUT_FACTOR)):
        if (await client.get_session(trial_id))["turns"] >= turns:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the trial never held {turns} turns")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


async def _every_shape(scripted: PacedScriptedEngine, client: ProxyClient) -> str:
    """A trial with a fork, two rewritten roots, a sub-agent, a cut reply and its retry."""
    trial = await client.create_session()
    scripted.script(
        tiny_reply("I read it."),
        tiny_reply("Going on."),
        tiny_reply("Trying another way."),
        tiny_reply("Continuing from the summary."),
        tiny_reply("Three files."),
        LONG_STORY,  # cut by the client
        tiny_reply("Finished."),
    )
    async with aiohttp.ClientSession() as http:
        first = await _chat(http, trial, [SYSTEM, _user("Read the file.")])
        second = await _chat(http, trial, [*first, _user("Go on.")])
        await _chat(http, trial, [*first, _user("Try again differently.")])  # a fork
        await _chat(http, trial, [SYSTEM, _user("Summary: the file was read.")])  # rewritten
        helper = {"x-relay-agent-id": "helper"}
        await _chat(http, trial, [SYSTEM, _user("Count the files.")], helper)
        scripted.delay = 0.02  # the long reply still runs when the client leaves
        await _cut_then_resent(http, client, trial, [*second, _user("Finish.")])
    await _turns(client, trial.trial_id, 7)
    return trial.trial_id


def _check_round_trip(tree: dict[str, Any], export: dict[str, Any]) -> None:
    """Each trajectory is its path of nodes concatenated; every node is on some path."""
    nodes = {n["id"]: n for n in tree["nodes"]}
    on_paths = set()
    for traj in export["trajectories"]:
        path, prompt = traj["nodes"], traj["prompt_ids"]
        on_paths.update(path)
        keys = ("ids", "mask", "logprobs", "versions", "images", "turns")
        joined = {key: [v for n in path for v in nodes[n][key]] for key in keys}
        assert joined["ids"] == prompt + traj["response_ids"]
        assert joined["mask"] == [0] * len(prompt) + traj["response_mask"]
        assert joined["logprobs"] == [0.0] * len(prompt) + traj["response_logprobs"]
        assert joined["versions"] == [-1] * len(prompt) + traj["response_versions"]
        assert joined["images"] == traj.get("multi_modal_data", {}).get("images", [])
        assert joined["turns"] == [t["turn"] for t in traj["turns"]]
    assert on_paths == set(nodes)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.set_attn_implementation("eager")
    return model.eval()


async def test_the_tree_of_every_session_shape_round_trips_and_packs(
    scripted: PacedScriptedEngine, scripted_client: ProxyClient, tiny_model: Any
) -> None:
    """Forks, rewritten roots, a sub-agent, a cut reply and its retry: the tree holds each
    turn once and rebuilds every trajectory; packed (shared system prompts once), one
    forward scores each trajectory's tokens as its own forward does (1e-5) and the
    recorded logprobs (1e-4); the samples' weights train what they train."""
    trial_id = await _every_shape(scripted, scripted_client)
    tree = await scripted_client.tree(trial_id)
    export = await scripted_client.trajectories(trial_id)
    assert tree["trial_id"] == trial_id
    nodes = tree["nodes"]
    assert len(nodes) == 7
    assert [n["parent"] for n in nodes].count(None) == 3  # main, its rewrite, the helper
    assert [n["parent"] for n in nodes].count(0) == 2  # the fork
    assert {n["agent"]["id"] for n in nodes} == {"main", "helper"}
    assert [(n["delivered"], n["retry_of"]) for n in nodes][5:] == [(False, None), (True, 5)]
    _check_round_trip(tree, export)

    packed = pack_tree(tree)
    assert packed.tree_tokens < sum(len(n["ids"]) for n in nodes)  # the system prompt once
    with torch.no_grad():
        scores = packed.token_logprobs(tiny_model(**packed.model_inputs(), use_cache=False).logits)
        for tokens, traj in zip(packed.paths, export["trajectories"], strict=True):
            ids = torch.tensor([traj["prompt_ids"] + traj["response_ids"]])
            alone = tiny_model(input_ids=ids, use_cache=False).logits[0].log_softmax(-1)
            expected = alone[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            assert torch.allclose(scores[tokens[1:]], expected, atol=1e-5, rtol=0)
    recorded = torch.tensor(packed.logprobs)
    sampled = torch.tensor(packed.mask, dtype=torch.bool)
    assert torch.allclose(scores[sampled], recorded[sampled], atol=1e-4, rtol=0)

    samples = build_samples(export)
    weighted = pack_tree(tree, samples)
    assert sum(weighted.loss_weights) == sum(s.sampled_tokens for s in samples)
    assert not any(5 in members for members in weighted.segment_nodes)  # the cut attempt


@pytest.fixture(scope="module")
async def vlm(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=8,
        cache_dir=tmp_path_factory.mktemp("tree-vlm-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
    )
    running = await start_proxy(config)
    start_hf_worker(running, SHIPPED_TINY_VLM, worker_id="tree-vlm")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


async def test_a_session_with_images_round_trips_with_each_image_once(vlm: RunningProxy) -> None:
    """A vision-language session that branches with another image: each node names the
    images of its own context, a trajectory's images are its nodes', and the packed
    sequence holds each occurrence once, at placeholder tokens."""
    async with ProxyClient(vlm.url) as client:
        trial = await client.create_session(sampling={"seed": 7})
        first = [chat_user("What is in this picture?", RED)]
        async with aiohttp.ClientSession() as http:
            answered = await _chat(http, trial, first)
            await _chat(http, trial, [*answered, chat_user(GREEN, "and this one?")])
            await _chat(http, trial, [*answered, chat_user(RED, "and this again?")])
        tree = await client.tree(trial.trial_id)
        export = await client.trajectories(trial.trial_id)
    _check_round_trip(tree, export)
    assert [len(n["images"]) for n in tree["nodes"]] == [1, 1, 1]
    packed = pack_tree(tree)
    assert len(packed.images) == 3
    assert all(set(packed.input_ids[i.start : i.end]) == {PAD} for i in packed.images)
    assert sum(i.end - i.start for i in packed.images) == packed.input_ids.count(PAD)
