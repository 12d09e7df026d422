"""A teacher's logprobs on recorded sessions, through the real proxy and ``hf`` workers.

Three workers on one proxy: the policy (the shipped tiny model), a teacher of the same
vocabulary and other weights and shape (``--teacher``), and a teacher whose vocabulary
differs by two ids. An agent episode with a rewrite and a resume goes to the policy alone;
the teacher then scores every sampled token, which is checked against transformers' own
teacher forcing in float32; asked again it scores nothing; refused teachers change nothing.
With images: the tiny VLM scored by itself as a teacher, and a text teacher refused.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient
from sdk.demo import Workspace, run_episode
from sdk.exceptions import ProxyRequestError
from sdk.images import VisionScorer
from sdk.samples import build_samples
from tests.e2e.conftest import IN_PROCESS_STREAMS, TIMEOUT_FACTOR
from tests.images import GREEN, RED
from worker_client.backends.hf import HFEngine
from worker_client.engine import ImageSpan
from worker_client.tiny_model import random_model, save_atomically
from worker_client.tiny_vlm import SHIPPED_TINY_VLM

pytestmark = pytest.mark.e2e

POLICY = "tiny-model"  # the shipped tiny model's directory name, as its worker announces it


def _write_teacher(source: Path, out: Path, seed: int) -> Path:
    """A tiny Llama of ``source``'s vocabulary (and template) with other weights and width."""
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    pad = int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    model = random_model(
        vocab_size=len(tokenizer), hidden_size=96, eos_ids=[end, pad], pad_id=pad, seed=seed
    )
    path = save_atomically(out, model, tokenizer)
    shutil.copy(source / "chat_template.jinja", path / "chat_template.jinja")
    return path


def _swap_two_ids(model_dir: Path) -> None:
    """Give two ordinary tokens each other's id: the same files but for one vocabulary."""
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.__getitem__)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def teacher_dirs(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """(a teacher of the policy's vocabulary, one whose vocabulary differs)."""
    root = tmp_path_factory.mktemp("teachers")
    teacher = _write_teacher(tiny_model_dir, root / "teacher", seed=5)
    stranger = Path(shutil.copytree(teacher, root / "stranger"))
    _swap_two_ids(stranger)
    return teacher, stranger


@pytest.fixture(scope="module")
async def teacher_stack(
    tiny_model_dir: Path,
    teacher_dirs: tuple[Path, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=64,
        cache_dir=tmp_path_factory.mktemp("teacher-proxy-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
    )
    running = await start_proxy(config)
    teacher, stranger = teacher_dirs
    start_hf_worker(running, tiny_model_dir, worker_id="policy")
    start_hf_worker(running, teacher, name="teacher", worker_id="teacher", teacher=True)
    start_hf_worker(running, stranger, name="stranger", worker_id="stranger", teacher=True)
    await running.wait_for_workers(3, within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


def forced(model: Any, trajectory: dict[str, Any]) -> list[float]:
    """transformers' teacher forcing in float32: the logprob of every response id given
    everything before it, from one forward of the whole trajectory."""
    ids = trajectory["prompt_ids"] + trajectory["response_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    n = len(trajectory["prompt_ids"])
    return [float(logprobs[n + i - 1, ids[n + i]]) for i in range(len(trajectory["response_ids"]))]


def sampled_tokens(export: dict[str, Any]) -> int:
    """The session's sampled tokens, each once (a turn shared by paths counts once)."""
    turns = {
        t["turn"]: t["completion_tokens"] for tr in export["trajectories"] for t in tr["turns"]
    }
    return sum(turns.values())


async def test_a_teacher_scores_every_sampled_token_once(
    teacher_stack: RunningProxy, teacher_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """An episode with a rewrite and a resume is sampled by the policy alone; the teacher
    scores each of its sampled tokens once, within 1e-4 of transformers' teacher forcing
    (0.0 where the mask is 0); asked again it scores nothing and the export is unchanged;
    the samples carry the teacher's logprobs."""
    async with ProxyClient(teacher_stack.url) as client:
        trial = await client.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
        log = await run_episode(trial, Workspace(tmp_path), turns=6, seed=11, max_tokens=48)
        result = await client.score_with_teacher(trial.trial_id, "teacher")
        export = await client.trajectories(trial.trial_id)
        again = await client.score_with_teacher(trial.trial_id, "teacher")
        unchanged = await client.trajectories(trial.trial_id)
    assert log.branches_made == ["history_rewritten", "resumed_older_point"]
    assert {t["model"] for tr in export["trajectories"] for t in tr["turns"]} == {POLICY}
    assert result["model"] == "teacher"
    assert result["done"] is True
    assert result["scored_tokens"] == sampled_tokens(export) > 50
    assert again["scored_tokens"] == 0
    assert unchanged == export
    model = AutoModelForCausalLM.from_pretrained(str(teacher_dirs[0]), dtype=torch.float32)
    worst = 0.0
    for trajectory in export["trajectories"]:
        assert trajectory["teacher_model"] == "teacher"
        pairs = zip(
            trajectory["teacher_logprobs"],
            forced(model, trajectory),
            trajectory["response_mask"],
            strict=True,
        )
        for teacher, expected, mask in pairs:
            if mask:
                worst = max(worst, abs(teacher - expected))
            else:
                assert teacher == 0.0
    assert worst <= 1e-4
    first = export["trajectories"][0]  # another model than the policy: other logprobs
    assert any(
        abs(t - r) > 1e-2
        for t, r in zip(first["teacher_logprobs"], first["response_logprobs"], strict=True)
    )
    samples = build_samples(export)
    assert samples
    assert all(s.teacher_model == "teacher" for s in samples)
    assert all(len(s.teacher_logprobs or ()) == len(s.response_ids) for s in samples)


async def test_refused_teachers_change_nothing(teacher_stack: RunningProxy, tmp_path: Path) -> None:
    """A teacher of another vocabulary is refused naming both models, and so are a name no
    worker serves and the policy's own name (not a teacher); the export has no teacher."""
    async with ProxyClient(teacher_stack.url) as client:
        trial = await client.create_session(sampling={"temperature": 1.0})
        await run_episode(trial, Workspace(tmp_path), turns=2, seed=3, max_tokens=16)
        before = await client.trajectories(trial.trial_id)
        refusals: dict[str, ProxyRequestError] = {}
        for name in ("stranger", "nobody", POLICY):
            with pytest.raises(ProxyRequestError) as caught:
                await client.score_with_teacher(trial.trial_id, name)
            refusals[name] = caught.value
        after = await client.trajectories(trial.trial_id)
    mismatch = refusals["stranger"]
    assert (mismatch.status, mismatch.code) == (400, "teacher_tokenizer_mismatch")
    assert "'stranger'" in mismatch.message
    assert f"'{POLICY}'" in mismatch.message
    for name in ("nobody", POLICY):
        assert (refusals[name].status, refusals[name].code) == (400, "teacher_not_found")
    assert "teachers: stranger, teacher" in refusals["nobody"].message
    assert after == before
    assert all("teacher_logprobs" not in tr for tr in after["trajectories"])


# ------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
async def vlm_teacher_stack(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[RunningProxy]:
    """The tiny VLM as the policy and as a teacher of itself, and a text teacher of its
    vocabulary."""
    text = _write_teacher(SHIPPED_TINY_VLM, tmp_path_factory.mktemp("text") / "text", seed=6)
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=5 * TIMEOUT_FACTOR,
        max_tokens=8,
        cache_dir=tmp_path_factory.mktemp("vlm-teacher-proxy-cache"),
        stream_coalesce=IN_PROCESS_STREAMS,
    )
    running = await start_proxy(config)
    start_hf_worker(running, SHIPPED_TINY_VLM, worker_id="vlm-policy")
    start_hf_worker(
        running, SHIPPED_TINY_VLM, name="vlm-teacher", worker_id="vlm-teacher", teacher=True
    )
    start_hf_worker(running, text, name="text-teacher", worker_id="text-teacher", teacher=True)
    await running.wait_for_workers(3, within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


def _user(text: str, image: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


async def test_a_teacher_scores_with_the_images_the_policy_saw(
    vlm_teacher_stack: RunningProxy,
) -> None:
    """Two turns with an image each: the VLM teacher scores every sampled token within 1e-4
    of transformers' teacher forcing with the same pixels at the same places; a text
    teacher of the same vocabulary is refused and changes nothing."""
    async with ProxyClient(vlm_teacher_stack.url) as client:
        trial = await client.create_session(sampling={"temperature": 1.0, "seed": 7})
        async with AsyncOpenAI(
            base_url=trial.base_url, api_key=trial.api_key, max_retries=0
        ) as agent:
            history: list[dict[str, Any]] = [_user("What is this?", RED)]
            reply = await agent.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
            history += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                _user("And this?", GREEN),
            ]
            await agent.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
        with pytest.raises(ProxyRequestError) as caught:
            await client.score_with_teacher(trial.trial_id, "text-teacher")
        untouched = await client.trajectories(trial.trial_id)
        result = await client.score_with_teacher(trial.trial_id, "vlm-teacher")
        (trajectory,) = (await client.trajectories(trial.trial_id))["trajectories"]
    assert (caught.value.status, caught.value.code) == (400, "teacher_images_unsupported")
    assert all("teacher_logprobs" not in tr for tr in untouched["trajectories"])
    assert result["scored_tokens"] == sum(trajectory["response_mask"]) > 0
    pixels = {hashlib.sha256(i).hexdigest(): i for i in (RED, GREEN)}
    spans = [
        ImageSpan(i["sha256"], pixels[i["sha256"]], i["span"][0], i["span"][1])
        for i in trajectory["multi_modal_data"]["images"]
    ]
    assert len(spans) == 2
    engine = HFEngine.load(SHIPPED_TINY_VLM)
    scorer = VisionScorer(engine.model, engine.image_processor)
    expected = scorer.score(trajectory["prompt_ids"], trajectory["response_ids"], spans)
    pairs = zip(trajectory["teacher_logprobs"], expected, trajectory["response_mask"], strict=True)
    assert max(abs(t - e) for t, e, m in pairs if m) <= 1e-4
