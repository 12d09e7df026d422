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
from sdk.fidelity import FidelityReport  # noqa: E402
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
def vlm_model() -> Path:
    """A tiny VLM with heads 32 wide (another model than the shipped one, same seed)."""
    from worker_client.tiny_vlm import write_tiny_vlm

    path = MODELS / "vlm-hd32"
    return _written(path, lambda: write_tiny_vlm(path, head_dim=32))


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start an engine of their own run before the shared text engine starts:
    two engines both bound to core 0 slow each other's start-up by minutes. Only this
    folder's tests move (the hook sees every collected test)."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if here in Path(item.path).parents]
    ordered = sorted(
        (items[i] for i in places),
        key=lambda item: "served" in getattr(item, "fixturenames", ()),
    )
    for i, item in zip(places, ordered, strict=True):
        items[i] = item


# The largest teacher-forcing gap each test saw, reported at the end of the run.
GAPS: dict[str, float] = {}


def within(report: FidelityReport, tolerance: float = 1e-4) -> bool:
    """Whether ``report`` re-scored some sampled tokens within ``tolerance``; its gap is
    kept for the run's summary."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    GAPS[test] = max(GAPS.get(test, 0.0), report.max_abs_error)
    return report.sampled_tokens > 0 and report.max_abs_error <= tolerance


def pytest_terminal_summary(terminalreporter: object) -> None:
    if not GAPS:
        return
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write("")
    write("teacher-forcing gaps (largest |vLLM logprob - transformers float32| per test):")
    for test, gap in sorted(GAPS.items(), key=lambda item: -item[1]):
        write(f"  {gap:.3g}  {test}")
    worst = max(GAPS, key=GAPS.__getitem__)
    write(f"largest teacher-forcing gap: {GAPS[worst]:.3g} ({worst})")
