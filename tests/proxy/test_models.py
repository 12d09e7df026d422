"""The model registry: a worker's models are loaded once, and the proxy process is told
when a model was added (it freezes what is alive then)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.exceptions import NotFoundError
from proxy.models import ModelRegistry, vocabulary_digest
from relay import protocol
from relay.endpoint import AdmissionRefused
from worker_client.client import collect_tokenizer_files


def _hello(*models: protocol.ModelInfo) -> protocol.Hello:
    return protocol.Hello(protocol.PROTOCOL_VERSION, "w", "t", list(models))


async def test_the_hook_runs_once_per_admission_that_added_a_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry = ModelRegistry(tmp_path)
    calls: list[int] = []
    registry.on_added = lambda: calls.append(len(registry.models))
    files = collect_tokenizer_files(tiny_model_dir)
    tiny = protocol.ModelInfo("tiny", 2048, "raw", "hf", files)
    await registry.admit(_hello(tiny))
    await registry.admit(_hello(tiny))  # a second worker with the same model: nothing new
    assert calls == [1]
    # A hello whose second model is refused still added its first: the hook runs.
    other = protocol.ModelInfo("other", 2048, "raw", "hf", files)
    clash = protocol.ModelInfo("tiny", 2048, "raw", "hf", {**files, "extra.txt": b"x"})
    with pytest.raises(AdmissionRefused):
        await registry.admit(_hello(other, clash))
    assert calls == [1, 2]
    assert set(registry.models) == {"tiny", "other"}


async def _policy_and_teacher(tiny_model_dir: Path, tmp_path: Path) -> ModelRegistry:
    registry = ModelRegistry(tmp_path)
    files = collect_tokenizer_files(tiny_model_dir)
    tiny = protocol.ModelInfo("tiny", 2048, "raw", "hf", files)
    teacher = protocol.ModelInfo("teacher", 2048, "raw", "hf", files, teacher=True)
    await registry.admit(_hello(tiny))
    await registry.admit(_hello(teacher))
    return registry


async def test_a_teacher_is_reached_only_by_its_exact_name(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With a teacher served beside the policy, a request naming no model, another model
    or the session's gets the policy as before; only the teacher's exact name reaches it."""
    registry = await _policy_and_teacher(tiny_model_dir, tmp_path)
    served = {"tiny", "teacher"}
    assert registry.models["teacher"].teacher
    assert not registry.models["tiny"].teacher
    assert registry.resolve("", None, served).name == "tiny"
    assert registry.resolve("gpt-4o", None, served).name == "tiny"
    assert registry.resolve("claude-x", "tiny", served).name == "tiny"
    assert registry.resolve("teacher", None, served).name == "teacher"
    assert registry.resolve("Teacher", None, served).name == "tiny"


async def test_with_only_a_teacher_served_an_unnamed_request_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A teacher is never the fallback: with no policy connected, a request that does not
    name it is refused, naming the teacher it could have named."""
    registry = await _policy_and_teacher(tiny_model_dir, tmp_path)
    with pytest.raises(NotFoundError, match=r"no model is being served but teachers.*teacher"):
        registry.resolve("gpt-4o", None, {"teacher"})


async def test_a_model_is_a_teacher_for_every_worker_or_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A second worker announcing a teacher's name as a policy (or the other way round) is
    refused; a worker of an older protocol cannot announce a teacher."""
    registry = await _policy_and_teacher(tiny_model_dir, tmp_path)
    files = collect_tokenizer_files(tiny_model_dir)
    with pytest.raises(AdmissionRefused, match="already served as a teacher"):
        await registry.admit(_hello(protocol.ModelInfo("teacher", 2048, "raw", "hf", files)))
    with pytest.raises(AdmissionRefused, match="already served as a policy"):
        await registry.admit(
            _hello(protocol.ModelInfo("tiny", 2048, "raw", "hf", files, teacher=True))
        )
    old = protocol.ModelInfo("older", 2048, "raw", "hf", files, teacher=True)
    await registry.admit(protocol.Hello(protocol.SCORING_VERSION - 1, "w", "t", [old]))
    assert not registry.models["older"].teacher


async def test_the_vocabulary_digest_ignores_configuration_and_template(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two models with one vocabulary and other configurations and chat templates have
    other tokenizer digests but one vocabulary digest; another vocabulary differs."""
    registry = ModelRegistry(tmp_path)
    files = collect_tokenizer_files(tiny_model_dir)
    template = files["chat_template.jinja"] + b"{# another template #}"
    config = {**json.loads(files["config.json"]), "hidden_size": 96}
    other = {**files, "config.json": json.dumps(config).encode(), "chat_template.jinja": template}
    await registry.admit(_hello(protocol.ModelInfo("a", 2048, "raw", "hf", files)))
    await registry.admit(_hello(protocol.ModelInfo("b", 2048, "raw", "hf", other)))
    a, b = registry.models["a"], registry.models["b"]
    assert a.digest != b.digest
    assert a.vocabulary == b.vocabulary != ""

    class Swapped:
        def get_vocab(self) -> dict[str, int]:
            vocab = dict(a.renderer.tokenizer.get_vocab())
            first, second = sorted(vocab, key=vocab.__getitem__)[:2]
            vocab[first], vocab[second] = vocab[second], vocab[first]
            return vocab

    assert vocabulary_digest(Swapped()) != a.vocabulary
