"""The model registry: a worker's models are loaded once, and the proxy process is told
when a model was added (it freezes what is alive then)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.models import ModelRegistry
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
