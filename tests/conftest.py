"""Fixtures shared by every test tier."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import worker_client.tiny_model as tiny_model

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL_SEED = 0


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model, written once and cached under .cache/ by a hash of its generator
    (write_tiny_model replaces the directory atomically, so an aborted run never leaves a
    half-written model behind)."""
    source = Path(tiny_model.__file__).read_bytes()
    digest = hashlib.sha256(source + str(TINY_MODEL_SEED).encode()).hexdigest()[:16]
    root = Path(os.environ.get("RELAY_TEST_CACHE", REPO / ".cache"))
    path = root / f"tiny-model-{digest}"
    if not (path / "model.safetensors").is_file():
        tiny_model.write_tiny_model(path, seed=TINY_MODEL_SEED)
    return path
