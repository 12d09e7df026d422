"""Fixtures shared by every test tier."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import worker_client.tiny_model as tiny_model

REPO = Path(__file__).resolve().parent.parent
# The seed of a generated tiny model (RELAY_TEST_TINY_MODEL=generate): another seed gives
# other weights, as training on another processor does (and another tokenizer as well).
TINY_MODEL_SEED = int(os.environ.get("RELAY_TEST_TINY_MODEL_SEED", "0"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model the project ships, the same weights on every machine.

    With ``RELAY_TEST_TINY_MODEL=generate`` the suite runs on one generated here instead,
    written once and cached under ``$RELAY_TEST_CACHE`` by a hash of its generator
    (write_tiny_model replaces the directory atomically, so an aborted run never leaves a
    half-written model behind): no test may depend on which weights it gets."""
    if os.environ.get("RELAY_TEST_TINY_MODEL", "shipped") != "generate":
        return tiny_model.SHIPPED_TINY_MODEL
    source = Path(tiny_model.__file__).read_bytes()
    digest = hashlib.sha256(source + str(TINY_MODEL_SEED).encode()).hexdigest()[:16]
    root = Path(os.environ.get("RELAY_TEST_CACHE", REPO / ".cache"))
    path = root / f"tiny-model-{digest}"
    if not (path / "model.safetensors").is_file():
        tiny_model.write_tiny_model(path, seed=TINY_MODEL_SEED)
    return path


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread for the test: on the two shared cores two threads run the
    tiny models several times slower (OpenMP spin-waits), and a trainer and a worker in one
    process share the threads (as `rollout-relay train` does)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_moe() -> Any:
    """The shipped tiny mixture-of-experts model, loaded (``tests.moe``)."""
    from tests.moe import load_moe

    return load_moe()


@pytest.fixture(scope="session")
def tiny_moe_prompt() -> Any:
    """A chat prompt for the tiny MoE model, as a ``[1, length]`` tensor."""
    from tests.moe import chat_prompt

    return chat_prompt()
