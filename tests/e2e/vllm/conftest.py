"""The real vLLM engine (its CPU build) behind the real proxy, for ``make test-vllm``.

One engine per model serves every test of a session: starting one costs 20-80 s on two
cores. The tiny models get heads 32 wide, the narrowest vLLM's CPU attention takes
(``rollout-relay tiny-model --head-dim 32``), written once into ``.cache/``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

# Run from vLLM's side environment (`make test-vllm`); the main suite's .venv has no vLLM,
# and collects nothing here.
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]

REPO = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("RELAY_TEST_CACHE", REPO / ".cache"))
# Before vLLM is imported: a small KV cache, and compile caches kept between runs.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(CACHE / "vllm-compile"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "vllm-compile" / "inductor"))

import pytest  # noqa: E402

from proxy.config import ProxyConfig  # noqa: E402
from rollout_relay.embedded import RunningProxy, start_proxy  # noqa: E402
from worker_client.backends.vllm import VLLMEngine  # noqa: E402
from worker_client.client import ServedModel, WorkerClient  # noqa: E402

# Scale every wait on slow machines: RELAY_TEST_TIMEOUT_FACTOR=3.
TIMEOUT_FACTOR = float(os.environ.get("RELAY_TEST_TIMEOUT_FACTOR", "1"))
MODELS = CACHE / "vllm-models"


def _written(path: Path, write: object) -> Path:
    if not (path / "model.safetensors").is_file():
        write()  # type: ignore[operator]
    return path


@pytest.fixture(scope="session")
def text_model() -> Path:
    """The shipped tiny model with heads 32 wide (the same function)."""
    from worker_client.tiny_model import SHIPPED_TINY_MODEL, widen_heads

    path = MODELS / "text-hd32"
    return _written(path, lambda: widen_heads(SHIPPED_TINY_MODEL, path))


@pytest.fixture(scope="session")
def moe_model() -> Path:
    from worker_client.tiny_moe import write_tiny_moe

    path = MODELS / "moe-hd32"
    return _written(path, lambda: write_tiny_moe(path, head_dim=32, imprint=False))


@pytest.fixture(scope="session")
def other_checkpoint(text_model: Path) -> Path:
    """Another checkpoint of the text model's architecture: every weight moved, the tied
    embeddings (the output head) too."""
    path = MODELS / "text-hd32-other"

    def write() -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from worker_client.tiny_model import save_atomically

        model = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in model.parameters():
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.add_(noise * parameter.std() * 0.5)
        save_atomically(path, model, AutoTokenizer.from_pretrained(text_model))

    return _written(path, write)


@dataclass
class Served:
    """A proxy with one in-process worker on a real vLLM engine."""

    proxy: RunningProxy
    engine: VLLMEngine
    model: Path


@pytest.fixture(scope="session")
async def served(
    text_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=30 * TIMEOUT_FACTOR,
        max_tokens=4096,
        cache_dir=tmp_path_factory.mktemp("vllm-proxy-cache"),
    )
    engine = VLLMEngine.load(str(text_model), name="tiny", enforce_eager=True, max_model_len=4096)
    running = await start_proxy(config)
    client = WorkerClient(
        running.worker_url, {"tiny": ServedModel(engine, text_model)}, worker_id="vllm-1"
    )
    running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    try:
        yield Served(running, engine, text_model)
    finally:
        await running.stop()
        await engine.close()
