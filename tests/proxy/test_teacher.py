"""The refusals of a teacher before any worker is asked: an unknown name, a policy the
proxy cannot compare, another vocabulary, a window too short, images it cannot take."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest

from proxy.exceptions import (
    TeacherImagesError,
    TeacherWindowError,
    TokenizerMismatchError,
    UnknownPolicyError,
    UnknownTeacherError,
)
from proxy.models import ModelRegistry
from proxy.sessions.model import PlacedImage, Session, TrialId, TurnMeta, TurnNode
from proxy.sessions.teacher import ScorePath, plan_scoring
from proxy.teacher import check_plans, check_teacher
from relay import protocol
from worker_client.client import collect_tokenizer_files


def _session(model: str = "tiny") -> Session:
    """One turn of ``model``: three prompt ids, two sampled."""
    s = Session(TrialId("t"), "rr-t.x")
    meta = TurnMeta("openai.chat", model, "gpt-x", "w1", "stop", {}, 0.0, 0.0, 0.0, "new")
    s.add_turn(
        TurnNode(
            index=0,
            parent=None,
            context_ids=array("i", [1, 2, 3]),
            completion_ids=array("i", [4, 5]),
            logprobs=array("f", [-1.0, -1.0]),
            prompt_len=3,
            key=b"k" * 16,
            meta=meta,
        )
    )
    return s


def _swap_two_ids(tokenizer_json: bytes) -> bytes:
    """The tokenizer with two ordinary tokens' ids exchanged: another vocabulary."""
    data = json.loads(tokenizer_json)
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.__getitem__)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    return json.dumps(data).encode()


async def _registry(
    tiny_model_dir: Path, tmp_path: Path, *, window: int = 2048
) -> tuple[ModelRegistry, dict[str, protocol.ModelInfo]]:
    """The policy ``tiny``, the teacher ``big`` of its vocabulary (``window`` tokens), and
    the teacher ``other`` of another vocabulary, as served."""
    registry = ModelRegistry(tmp_path)
    files = collect_tokenizer_files(tiny_model_dir)
    swapped = _swap_two_ids(files["tokenizer.json"])
    infos = [
        protocol.ModelInfo("tiny", 2048, "raw", "hf", files),
        protocol.ModelInfo("big", window, "raw", "hf", files, teacher=True),
        protocol.ModelInfo(
            "other", 2048, "raw", "hf", {**files, "tokenizer.json": swapped}, teacher=True
        ),
    ]
    for info in infos:
        await registry.admit(protocol.Hello(protocol.PROTOCOL_VERSION, "w", "t", [info]))
    return registry, {info.name: info for info in infos}


async def test_each_refusal_names_what_is_wrong(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An unknown name and the policy's own name are not teachers; a teacher of another
    vocabulary names both models; a session sampled by a model the proxy has not seen
    cannot be compared; the right teacher passes."""
    registry, served = await _registry(tiny_model_dir, tmp_path)
    session = _session()
    assert check_teacher(registry, served, session, "big").name == "big"
    for name in ("nobody", "tiny"):
        with pytest.raises(UnknownTeacherError, match="teachers: big, other"):
            check_teacher(registry, served, session, name)
    with pytest.raises(TokenizerMismatchError, match="teacher 'other' and policy 'tiny'"):
        check_teacher(registry, served, session, "other")
    with pytest.raises(UnknownPolicyError, match="model 'gone' sampled this session"):
        check_teacher(registry, served, _session("gone"), "big")
    gone = {name: info for name, info in served.items() if name != "big"}
    with pytest.raises(UnknownTeacherError):
        check_teacher(registry, gone, session, "big")  # its worker left


async def test_a_trajectory_longer_than_the_window_or_with_images_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A forcing longer than the teacher's window is refused, and so is one with images
    for a teacher that takes none."""
    registry, _ = await _registry(tiny_model_dir, tmp_path, window=4)
    session = _session()
    plans = plan_scoring(session, "big")
    with pytest.raises(TeacherWindowError, match="5 tokens does not fit teacher 'big'"):
        check_plans(registry.models["big"], session, plans)
    wide, _ = await _registry(tiny_model_dir, tmp_path / "wide")
    check_plans(wide.models["big"], session, plans)
    image = PlacedImage("ab" * 32, 1, 2)
    with_image = [ScorePath(plans[0].ids, 3, (0,), (image,), 2)]
    with pytest.raises(TeacherImagesError, match="teacher 'big' takes no images"):
        check_plans(wide.models["big"], session, with_image)
