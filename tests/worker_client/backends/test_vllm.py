"""The vllm backend.

Tests that take the ``vllm_mod`` fixture need vLLM's real types and skip without them; run
them in the side venv that ``scripts/vllm-env.sh`` builds (vLLM's CPU build; no GPU needed):

    scripts/vllm-env.sh
    .cache/vllm-venv/bin/pytest tests/worker_client/backends/test_vllm.py -p no:cacheprovider --noconftest

They stand the engine in with fakes, on a GPU platform where a test says so; the real engine
runs in ``tests/e2e/vllm``.

The others run anywhere, including the main venv, which has no vLLM.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import sys
import time
import typing
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

import worker_client.backends
from worker_client.backends.placeholders import collapse_images
from worker_client.backends.vllm import (
    ROUTING_NEEDS_GPU,
    VLLM_LOGPROBS_MODES,
    VLLMEngine,
    check_checkpoint,
    chunk_from_output,
    engine_arguments,
    image_prompt,
    served_image_token,
    to_vllm_sampling,
)
from worker_client.backends.vllm_worker import EXTENSION
from worker_client.engine import (
    FinishReason,
    ImageSpan,
    LogprobsMode,
    ModelCard,
    SamplingParams,
    TokenChunk,
)
from worker_client.exceptions import EngineError, EngineUnavailableError, PromptTooLongError

# torch, which vllm imports, uses its own deprecated torch.jit.script_method on import.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

PROMPT = [11, 12, 13]
EOS = 2
STOP = 5


@pytest.fixture(scope="module")
def vllm_mod() -> Any:
    vllm = pytest.importorskip("vllm")
    for name in ("inputs", "logprobs", "outputs", "sampling_params"):
        importlib.import_module(f"vllm.{name}")
    return vllm


def output(
    token_ids: Sequence[int],
    logprobs: Any,
    finish_reason: str | None = None,
    prompt_token_ids: Sequence[int] = PROMPT,
) -> Any:
    """A DELTA ``RequestOutput`` as vLLM's output processor builds it."""
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=list(token_ids),
        cumulative_logprob=None,
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=None,
    )
    return RequestOutput(
        request_id="r1",
        prompt=None,
        prompt_token_ids=list(prompt_token_ids),
        prompt_logprobs=None,
        outputs=[completion],
        finished=finish_reason is not None,
    )


def positions(pairs: Sequence[tuple[int, float]]) -> list[dict[int, Any]]:
    """Sample logprobs with ``logprobs=0``: one entry per position, the sampled token."""
    from vllm.logprobs import Logprob

    return [{token: Logprob(logprob=value, rank=1)} for token, value in pairs]


# ------------------------------------------------------------------ to_vllm_sampling


def test_sampling_maps_every_field(vllm_mod: Any) -> None:
    """Every field of our SamplingParams reaches vLLM's, with logprobs=0, DELTA, no text."""
    from vllm.sampling_params import RequestOutputKind

    ours = SamplingParams(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, seed=123, stop_token_ids=(EOS, STOP)
    )
    theirs = to_vllm_sampling(ours, vllm_mod)
    assert isinstance(theirs, vllm_mod.SamplingParams)
    assert (theirs.n, theirs.max_tokens, theirs.temperature) == (1, 7, 0.7)
    assert (theirs.top_p, theirs.top_k, theirs.seed) == (0.9, 40, 123)
    assert theirs.stop_token_ids == [EOS, STOP]
    assert theirs.logprobs == 0
    assert theirs.output_kind == RequestOutputKind.DELTA
    assert theirs.ignore_eos is False
    assert theirs.detokenize is False


def test_sampling_imports_vllm_when_not_given(vllm_mod: Any) -> None:
    """Without a module argument, to_vllm_sampling imports vllm itself."""
    theirs = to_vllm_sampling(SamplingParams(max_tokens=3))
    assert isinstance(theirs, vllm_mod.SamplingParams)
    assert (theirs.max_tokens, theirs.seed, theirs.stop_token_ids) == (3, None, [])


@pytest.mark.parametrize("top_k", [0, -1, -7])
def test_top_k_off_becomes_vllm_zero(vllm_mod: Any, top_k: int) -> None:
    """Our top_k <= 0 (off) becomes 0, vLLM's value for off (it rejects values below -1)."""
    theirs = to_vllm_sampling(SamplingParams(max_tokens=4, top_k=top_k), vllm_mod)
    assert theirs.top_k == 0


def test_placeholders_are_never_sampled(vllm_mod: Any) -> None:
    """A vision-language model's placeholder ids go to vLLM with the lowest logit_bias it
    takes; a text model's requests carry none."""
    theirs = to_vllm_sampling(SamplingParams(max_tokens=4), vllm_mod, never_sampled=(11, 12))
    assert theirs.logit_bias == {11: -100.0, 12: -100.0}
    assert to_vllm_sampling(SamplingParams(max_tokens=4), vllm_mod).logit_bias is None


def test_sampling_vllm_rejects_becomes_engine_error(vllm_mod: Any) -> None:
    """A value vLLM refuses (temperature above 2) raises EngineError, not vLLM's error."""
    with pytest.raises(EngineError, match="temperature"):
        to_vllm_sampling(SamplingParams(max_tokens=4, temperature=3.0), vllm_mod)


def _request(vllm_mod: Any, sampling: SamplingParams) -> Any:
    """A vLLM engine-core request, with the EOS handling vLLM's input processor applies."""
    from vllm.v1.request import Request

    params = to_vllm_sampling(sampling, vllm_mod).clone()
    # A model whose tokenizer EOS is 2 and whose generation_config lists 2 and 9.
    params.update_from_generation_config({"eos_token_id": [EOS, 9]}, EOS)
    return Request("r1", list(PROMPT), params, None)


def _sample(request: Any, new_token_ids: list[int]) -> tuple[list[int], bool]:
    """Run vLLM's scheduler step that appends sampled tokens and checks for a stop."""
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = SimpleNamespace(max_model_len=1024)
    result: tuple[list[int], bool] = Scheduler._update_request_with_output(
        scheduler,
        request,
        list(new_token_ids),
    )
    return result


def test_stop_token_is_kept_in_the_output(vllm_mod: Any) -> None:
    """vLLM keeps the sampled stop token in the output ids and drops what follows it."""
    from vllm.v1.request import RequestStatus

    request = _request(vllm_mod, SamplingParams(max_tokens=10, stop_token_ids=(STOP,)))
    kept, stopped = _sample(request, [4, STOP, 6])
    assert stopped
    assert kept == [4, STOP]
    assert list(request.output_token_ids) == [4, STOP]
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_model_eos_stops_and_is_kept(vllm_mod: Any) -> None:
    """The tokenizer's EOS stops even when not listed (as in the hf backend), and is kept."""
    from vllm.v1.request import RequestStatus

    request = _request(vllm_mod, SamplingParams(max_tokens=10, stop_token_ids=(STOP,)))
    kept, stopped = _sample(request, [4, EOS, 6])
    assert stopped
    assert kept == [4, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_generation_config_eos_stops(vllm_mod: Any) -> None:
    """An EOS id listed only in the model's generation_config stops too, and is kept."""
    request = _request(vllm_mod, SamplingParams(max_tokens=10, stop_token_ids=(STOP,)))
    kept, stopped = _sample(request, [4, 9, 6])
    assert stopped
    assert kept == [4, 9]


def test_other_tokens_do_not_stop(vllm_mod: Any) -> None:
    """Tokens that are neither stop ids nor EOS ids never stop the request."""
    request = _request(vllm_mod, SamplingParams(max_tokens=10, stop_token_ids=(STOP,)))
    kept, stopped = _sample(request, [4, 6, 7])
    assert not stopped
    assert kept == [4, 6, 7]


def test_max_tokens_stops_with_length(vllm_mod: Any) -> None:
    """max_tokens ends the request as length-capped after exactly that many tokens."""
    from vllm.v1.request import RequestStatus

    request = _request(vllm_mod, SamplingParams(max_tokens=2, stop_token_ids=(STOP,)))
    kept, stopped = _sample(request, [4, 6, 7])
    assert stopped
    assert kept == [4, 6]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_logprobs_modes_are_vllm_values(vllm_mod: Any) -> None:
    """RAW and PROCESSED map to vLLM's raw_logprobs and processed_logprobs engine values."""
    from vllm.config.model import LogprobsMode as VllmLogprobsMode

    assert VLLM_LOGPROBS_MODES == {
        LogprobsMode.RAW: "raw_logprobs",
        LogprobsMode.PROCESSED: "processed_logprobs",
    }
    assert set(VLLM_LOGPROBS_MODES.values()) <= set(typing.get_args(VllmLogprobsMode))


# ------------------------------------------------------------------ chunk_from_output


def test_intermediate_output_has_no_finish_reason(vllm_mod: Any) -> None:
    """An unfinished delta gives its ids and logprobs and no finish reason."""
    chunk = chunk_from_output(output([4, 6], positions([(4, -0.25), (6, -1.5)])))
    assert chunk == TokenChunk([4, 6], [-0.25, -1.5], None)


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("abort", FinishReason.ABORT),
    ],
)
def test_finish_reasons(vllm_mod: Any, reason: str, expected: FinishReason) -> None:
    """vLLM's stop, length and abort map to ours, with the last tokens in the same chunk."""
    chunk = chunk_from_output(output([STOP], positions([(STOP, -0.125)]), reason))
    assert chunk == TokenChunk([STOP], [-0.125], expected)


@pytest.mark.parametrize("logprobs", [[], None])
def test_abort_without_tokens(vllm_mod: Any, logprobs: Any) -> None:
    """The empty final output of an abort is an ABORT chunk with no tokens."""
    chunk = chunk_from_output(output([], logprobs, "abort"))
    assert chunk == TokenChunk([], [], FinishReason.ABORT)


def test_logprob_of_the_sampled_token_is_taken(vllm_mod: Any) -> None:
    """With more candidates at a position, the sampled token's logprob is the one used."""
    from vllm.logprobs import Logprob

    position = {9: Logprob(logprob=-0.1, rank=1), 4: Logprob(logprob=-3.0, rank=2)}
    chunk = chunk_from_output(output([4], [position]))
    assert chunk.logprobs == [-3.0]


def test_flat_logprobs(vllm_mod: Any) -> None:
    """Logprobs in vLLM's flat container (flat_logprobs=True) are read the same way."""
    from vllm.logprobs import FlatLogprobs

    flat = FlatLogprobs()
    flat.extend(positions([(4, -0.5), (6, -0.75)]))
    chunk = chunk_from_output(output([4, 6], flat, "length"))
    assert chunk == TokenChunk([4, 6], [-0.5, -0.75], FinishReason.LENGTH)


def test_missing_logprobs_is_an_engine_error(vllm_mod: Any) -> None:
    """Tokens without logprobs (request sent without logprobs) raise EngineError."""
    with pytest.raises(EngineError, match="logprobs"):
        chunk_from_output(output([4, 6], None))


def test_fewer_logprobs_than_tokens_is_an_engine_error(vllm_mod: Any) -> None:
    """A logprob list shorter than the token list raises EngineError."""
    with pytest.raises(EngineError, match="2 tokens but 1 logprobs"):
        chunk_from_output(output([4, 6], positions([(4, -0.5)])))


def test_logprob_for_another_token_is_an_engine_error(vllm_mod: Any) -> None:
    """A position whose logprobs lack the sampled token raises EngineError."""
    with pytest.raises(EngineError, match="sampled token 6"):
        chunk_from_output(output([4, 6], positions([(4, -0.5), (7, -0.5)])))


def test_error_finish_is_an_engine_error(vllm_mod: Any) -> None:
    """vLLM's 'error' finish reason raises EngineError."""
    with pytest.raises(EngineError, match="'error'"):
        chunk_from_output(output([], [], "error"))


# ------------------------------------------------------------------ VLLMEngine


def _config(**fields: Any) -> Any:
    """A stand-in for vLLM's ModelConfig: bfloat16, compiled, and ``fields``."""
    import torch

    return SimpleNamespace(**{"dtype": torch.bfloat16, "enforce_eager": False, **fields})


def _on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's platform answers as a GPU's would."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_unspecified", lambda: False)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)


class FakeLLM:
    """Stands in for vLLM's AsyncLLM: replays the given outputs and records the calls."""

    def __init__(self, outputs: Sequence[Any], fail: Exception | None = None) -> None:
        self.outputs = outputs
        self.fail = fail
        self.calls: list[tuple[Any, Any, str]] = []
        self.aborted: list[str] = []
        self.closed = False
        self.model_config = _config(max_model_len=16)

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        self.calls.append((prompt, params, request_id))
        for item in self.outputs:
            yield item
        if self.fail is not None:
            raise self.fail

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def shutdown(self) -> None:
        self.closed = True


def engine(llm: FakeLLM) -> VLLMEngine:
    card = ModelCard("tiny", 16, LogprobsMode.RAW, "vllm")
    return VLLMEngine(llm, card)


async def collect(stream: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in stream]


async def test_generate_streams_deltas(vllm_mod: Any) -> None:
    """generate sends token ids with DELTA params and yields one chunk per non-empty delta."""
    from vllm.sampling_params import RequestOutputKind

    llm = FakeLLM(
        [
            output([], []),
            output([4], positions([(4, -0.5)])),
            output([6, STOP], positions([(6, -0.25), (STOP, -0.125)]), "stop"),
        ]
    )
    sampling = SamplingParams(max_tokens=8, stop_token_ids=(STOP,))
    chunks = await collect(engine(llm).generate("req-1", PROMPT, sampling))
    assert chunks == [
        TokenChunk([4], [-0.5]),
        TokenChunk([6, STOP], [-0.25, -0.125], FinishReason.STOP),
    ]
    ((prompt, params, request_id),) = llm.calls
    assert prompt == {"prompt_token_ids": PROMPT}
    assert request_id == "req-1"
    assert params.output_kind == RequestOutputKind.DELTA
    assert params.stop_token_ids == [STOP]


async def test_generate_without_finish_is_an_engine_error(vllm_mod: Any) -> None:
    """A vLLM stream that ends without a finish reason raises EngineError."""
    llm = FakeLLM([output([4], positions([(4, -0.5)]))])
    stream = engine(llm).generate("req-1", PROMPT, SamplingParams(max_tokens=8))
    with pytest.raises(EngineError, match="without a finish reason"):
        await collect(stream)


async def test_generate_wraps_vllm_failures(vllm_mod: Any) -> None:
    """An exception raised by vLLM mid-stream becomes EngineError."""
    llm = FakeLLM([output([4], positions([(4, -0.5)]))], fail=RuntimeError("engine dead"))
    stream = engine(llm).generate("req-1", PROMPT, SamplingParams(max_tokens=8))
    with pytest.raises(EngineError, match="engine dead"):
        await collect(stream)


async def test_prompt_too_long() -> None:
    """A prompt that fills the context window raises PromptTooLongError before vLLM runs."""
    llm = FakeLLM([])
    stream = engine(llm).generate("req-1", list(range(16)), SamplingParams(max_tokens=1))
    with pytest.raises(PromptTooLongError):
        await collect(stream)
    assert llm.calls == []


async def test_abort_and_close_reach_vllm() -> None:
    """abort passes the request id to vLLM; close shuts the engine down."""
    llm = FakeLLM([])
    eng = engine(llm)
    await eng.abort("req-9")
    await eng.close()
    assert llm.aborted == ["req-9"]
    assert llm.closed


def test_load_passes_engine_args(vllm_mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """load builds AsyncEngineArgs with the model, the logprobs mode, the worker extension
    and extra kwargs, and the card names the settings served."""
    from vllm.v1.engine.async_llm import AsyncLLM

    seen: list[Any] = []

    def fake_from_engine_args(args: Any) -> FakeLLM:
        seen.append(args)
        return FakeLLM([])

    _on_gpu(monkeypatch)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_from_engine_args)
    eng = VLLMEngine.load(
        "/models/tiny", name="tiny", logprobs_mode=LogprobsMode.PROCESSED, max_model_len=64
    )
    (args,) = seen
    assert (args.model, args.logprobs_mode, args.max_model_len, args.worker_extension_cls) == (
        "/models/tiny",
        "processed_logprobs",
        64,
        EXTENSION,
    )
    settings = {"max_model_len": 16, "dtype": "bfloat16", "enforce_eager": False}
    assert eng.card == ModelCard("tiny", 16, LogprobsMode.PROCESSED, "vllm", engine=settings)


def _float32_checkpoint(root: Any) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "llama", "dtype": "float32"}')
    return str(root)


def test_on_cpu_a_float32_checkpoint_is_served_in_float32(
    vllm_mod: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """On CPU, without a dtype given, a float32 checkpoint starts vLLM with dtype float32
    (vLLM's auto would downcast it); a dtype given is kept."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    seen: list[Any] = []

    def fake_from_engine_args(args: Any) -> FakeLLM:
        seen.append(args)
        llm = FakeLLM([])
        llm.model_config = _config(max_model_len=16, dtype=getattr(torch, args.dtype))
        return llm

    monkeypatch.setattr(current_platform, "is_unspecified", lambda: False)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_from_engine_args)
    model = _float32_checkpoint(tmp_path / "m")
    assert VLLMEngine.load(model).card.engine["dtype"] == "float32"
    assert seen[0].dtype == "float32"
    assert VLLMEngine.load(model, dtype="bfloat16").card.engine["dtype"] == "bfloat16"


def test_a_downcast_is_a_warning_at_start(
    vllm_mod: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM serving a float32 checkpoint in bfloat16 is logged as a warning naming --dtype."""
    from vllm.v1.engine.async_llm import AsyncLLM

    _on_gpu(monkeypatch)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", lambda args: FakeLLM([]))
    with caplog.at_level("WARNING", logger="worker_client.backends.vllm"):
        VLLMEngine.load(_float32_checkpoint(tmp_path / "m"))
    (record,) = [r for r in caplog.records if r.name == "worker_client.backends.vllm"]
    assert "bfloat16" in record.getMessage()
    assert "--dtype float32" in record.getMessage()


def test_on_cpu_routed_experts_are_refused_naming_why(
    vllm_mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU build cannot return routing: load refuses before starting anything, and
    says it needs a GPU."""
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.setattr(current_platform, "is_unspecified", lambda: False)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", pytest.fail)
    with pytest.raises(EngineUnavailableError, match="Triton") as caught:
        VLLMEngine.load("/models/moe", routed_experts=True)
    assert ROUTING_NEEDS_GPU in str(caught.value)


def test_load_wraps_startup_failures(vllm_mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while vLLM starts becomes EngineUnavailableError."""
    from vllm.v1.engine.async_llm import AsyncLLM

    def broken(args: Any) -> FakeLLM:
        raise RuntimeError("CUDA out of memory")

    _on_gpu(monkeypatch)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", broken)
    with pytest.raises(EngineUnavailableError, match="CUDA out of memory"):
        VLLMEngine.load("/models/tiny")


def test_load_without_gpu_is_unavailable(vllm_mod: Any) -> None:
    """On a machine without a GPU, load raises EngineUnavailableError quickly."""
    from vllm.platforms import current_platform

    if not current_platform.is_unspecified():
        pytest.skip("this machine has a device vLLM can use")
    started = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="no GPU"):
        VLLMEngine.load("/nonexistent/model")
    assert time.monotonic() - started < 30


def test_without_vllm_import_works_and_load_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without vllm, the module imports, and load raises EngineUnavailableError naming vllm."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    monkeypatch.delitem(sys.modules, "worker_client.backends.vllm")
    monkeypatch.setattr(worker_client.backends, "vllm", None, raising=False)
    module = importlib.import_module("worker_client.backends.vllm")
    with pytest.raises(EngineUnavailableError, match="'vllm' package"):
        module.VLLMEngine.load("some/model")
    with pytest.raises(EngineUnavailableError, match="'vllm' package"):
        module.to_vllm_sampling(SamplingParams(max_tokens=4))


# --------------------------------------------------------------------------- weight updates


class ReloadingLLM(FakeLLM):
    """FakeLLM with AsyncLLM's weight-update methods (the signatures vLLM 0.32 has: see
    test_weight_update_calls_fit_asyncllm), recording the calls in order."""

    def __init__(self, fail_reload: bool = False) -> None:
        super().__init__([])
        self.model_config = _config(max_model_len=16, hf_config=SimpleNamespace(model_type="llama"))
        self.fail_reload = fail_reload
        self.fail_path: str | None = None
        self.updates: list[tuple[str, Any]] = []

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.updates.append(("pause_generation", {"mode": mode, "clear_cache": clear_cache}))

    async def resume_generation(self) -> None:
        self.updates.append(("resume_generation", None))

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,  # noqa: ASYNC109 - AsyncLLM's own parameter
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        self.updates.append(("collective_rpc", (method, kwargs)))
        path = (kwargs or {}).get("weights_path")
        if self.fail_reload or (path is not None and path == self.fail_path):
            raise RuntimeError("shapes differ")
        return [None]

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.updates.append(("reset_prefix_cache", None))
        return True

    async def update_weight_version(self, new_version: str) -> None:
        self.updates.append(("update_weight_version", new_version))


def _checkpoint(root: Any, model_type: str = "llama", weights: bool = True) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    if weights:
        (root / "model.safetensors").write_bytes(b"")
    return str(root)


async def test_weights_reload_in_place_through_vllm(tmp_path: Any) -> None:
    """A staged checkpoint is loaded by vLLM's own in-place reload on commit: pause, reload
    on every worker, pack the output head again (CPU), reset the prefix cache, stamp the
    version, resume."""
    llm = ReloadingLLM()
    vllm_engine = engine(llm)
    path = _checkpoint(tmp_path / "step-1")
    await vllm_engine.stage_weights(path)
    assert llm.updates == []  # staging touches no engine
    await vllm_engine.commit_weights(3)
    assert llm.updates == [
        ("pause_generation", {"mode": "abort", "clear_cache": True}),
        (
            "collective_rpc",
            ("reload_weights", {"weights_path": path, "is_checkpoint_format": True}),
        ),
        ("collective_rpc", ("repack_embedding_gemms", None)),
        ("reset_prefix_cache", None),
        ("update_weight_version", "3"),
        ("resume_generation", None),
    ]


async def test_a_reload_that_fails_part_way_loads_the_served_checkpoint_back(
    tmp_path: Any,
) -> None:
    """vLLM failing while it reloads a checkpoint has the engine load the one it served
    before (no half-written model serves), and the update fails naming both."""
    from worker_client.exceptions import WeightsError

    llm = ReloadingLLM()
    layout = {"a.weight": ("F32", [2])}
    served = _safetensors(tmp_path / "step-0", layout)
    vllm_engine = VLLMEngine(llm, ModelCard("tiny", 16, LogprobsMode.RAW, "vllm"), path=served)
    broken = _safetensors(tmp_path / "step-1", layout)
    llm.fail_path = broken
    await vllm_engine.stage_weights(broken)
    with pytest.raises(WeightsError, match=r"serves .*step-0 again"):
        await vllm_engine.commit_weights(1)
    rpcs = [args for call, args in llm.updates if call == "collective_rpc"]
    reloads = [kwargs["weights_path"] for method, kwargs in rpcs if method == "reload_weights"]
    assert reloads == [broken, served]
    assert ("update_weight_version", "1") not in llm.updates
    assert llm.updates[-1] == ("resume_generation", None)
    assert not llm.closed


def _safetensors(root: Any, tensors: dict[str, tuple[str, list[int]]]) -> str:
    """A model directory whose safetensors header names ``tensors`` (zero-filled data)."""
    import json
    import struct

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = 4
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return str(root)


def test_a_checkpoint_of_other_tensors_is_refused_before_vllm_reloads(tmp_path: Any) -> None:
    """Against the served checkpoint, one with a tensor missing, of another shape or dtype,
    or cut short is refused at staging, from the safetensors headers alone."""
    from worker_client.exceptions import WeightsError

    layout = {"a.weight": ("F32", [4, 2]), "b.weight": ("F32", [3])}
    served = _safetensors(tmp_path / "served", layout)
    check_checkpoint(_safetensors(tmp_path / "same", layout), "llama", served)
    for name, tensors, reason in [
        ("missing", {"a.weight": ("F32", [4, 2])}, "missing .*b.weight"),
        ("shape", {**layout, "b.weight": ("F32", [4])}, r"b.weight is F32 \[4\]"),
        ("dtype", {**layout, "a.weight": ("BF16", [4, 2])}, "a.weight is BF16"),
    ]:
        with pytest.raises(WeightsError, match=reason):
            check_checkpoint(_safetensors(tmp_path / name, tensors), "llama", served)
    cut = _safetensors(tmp_path / "cut", layout)
    data = (tmp_path / "cut" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(WeightsError, match="cut short"):
        check_checkpoint(cut, "llama", served)


def test_engine_arguments_read_json_values() -> None:
    """--engine-arg pairs: dashes become underscores, JSON values are parsed, the rest is
    text, and a pair without '=' is refused."""
    assert engine_arguments(
        [
            "max-num-seqs=8",
            "enable_prefix_caching=false",
            'limit_mm_per_prompt={"image": 1}',
            "kv_cache_dtype=auto",
        ]
    ) == {
        "max_num_seqs": 8,
        "enable_prefix_caching": False,
        "limit_mm_per_prompt": {"image": 1},
        "kv_cache_dtype": "auto",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        engine_arguments(["enforce_eager"])


async def test_weights_that_do_not_fit_are_refused_before_vllm_is_touched(tmp_path: Any) -> None:
    """A path that is no model directory, holds no weights or is another architecture is
    refused when staged; vLLM is never paused for it."""
    from worker_client.exceptions import WeightsError

    llm = ReloadingLLM()
    vllm_engine = engine(llm)
    for path, reason in [
        (str(tmp_path / "missing"), "not a Hugging Face model"),
        (_checkpoint(tmp_path / "empty", weights=False), "no weights"),
        (_checkpoint(tmp_path / "other", model_type="qwen3"), "'qwen3' model"),
    ]:
        with pytest.raises(WeightsError, match=reason):
            await vllm_engine.stage_weights(path)
    with pytest.raises(WeightsError, match="staged"):
        await vllm_engine.commit_weights(1)
    assert llm.updates == []


async def test_a_failed_reload_with_nothing_to_go_back_to_stops_vllm(tmp_path: Any) -> None:
    """vLLM failing to reload, with no served checkpoint to load back, becomes WeightsError
    (the worker leaves service) and stops the engine, which is not resumed."""
    from worker_client.exceptions import WeightsError

    llm = ReloadingLLM(fail_reload=True)
    vllm_engine = engine(llm)
    await vllm_engine.stage_weights(_checkpoint(tmp_path / "step-1"))
    with pytest.raises(WeightsError, match=r"shapes differ.*stopped"):
        await vllm_engine.commit_weights(1)
    assert llm.closed
    assert ("resume_generation", None) not in llm.updates


class DyingLLM(ReloadingLLM):
    """ReloadingLLM whose every reload fails and which, once shut down, fails to resume
    (as a real AsyncLLM's RPC to its stopped engine core would)."""

    def __init__(self) -> None:
        super().__init__(fail_reload=True)

    async def resume_generation(self) -> None:
        if self.closed:
            raise RuntimeError("engine core is dead")
        await super().resume_generation()


@pytest.mark.parametrize("served", [False, True])
async def test_a_reload_that_stops_the_engine_says_so_and_does_not_resume_it(
    tmp_path: Any, served: bool
) -> None:
    """A failed reload whose restore closed the engine raises the error saying it stopped,
    and never resumes the stopped engine (whose failure would hide that error)."""
    from worker_client.exceptions import WeightsError

    llm = DyingLLM()
    layout = {"a.weight": ("F32", [2])}
    path = _safetensors(tmp_path / "step-0", layout) if served else None
    card = ModelCard("tiny", 16, LogprobsMode.RAW, "vllm")
    vllm_engine = VLLMEngine(llm, card, path=path)
    await vllm_engine.stage_weights(_safetensors(tmp_path / "step-1", layout))
    with pytest.raises(WeightsError, match=r"stopped$"):
        await vllm_engine.commit_weights(1)
    assert llm.closed
    assert ("resume_generation", None) not in llm.updates


def test_weight_update_calls_fit_asyncllm(vllm_mod: Any) -> None:
    """Every AsyncLLM method the backend calls exists with the arguments it passes, and
    the GPU worker's reload_weights takes weights_path and is_checkpoint_format."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("pause_generation", (), {"mode": "abort", "clear_cache": True}),
        ("collective_rpc", ("reload_weights",), {"kwargs": {"weights_path": "p"}}),
        ("reset_prefix_cache", (), {}),
        ("update_weight_version", ("3",), {}),
        ("resume_generation", (), {}),
    ]
    for name, args, kwargs in calls:
        method = getattr(AsyncLLM, name)
        assert inspect.iscoroutinefunction(method), name
        inspect.signature(method).bind(None, *args, **kwargs)
    assert set(inspect.signature(ReloadingLLM.pause_generation).parameters) == set(
        inspect.signature(AsyncLLM.pause_generation).parameters
    )
    # Read, not imported: importing the GPU model runner needs GPU-only packages.
    spec = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner")
    assert spec is not None
    assert spec.origin is not None
    with open(spec.origin, encoding="utf-8") as source_file:
        source = source_file.read()
    assert "def reload_weights(" in source
    assert "weights_path: str | None = None" in source
    assert "is_checkpoint_format: bool = True" in source


# --------------------------------------------------------------------------- images

PAD = 151655  # Qwen-VL's <|image_pad|>
VSTART, VEND = 151652, 151653


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


RED, BLUE = png((200, 30, 40), (64, 48)), png((10, 10, 240), (32, 32))
# The proxy's expanded ids: text, RED in 4 placeholders, text, BLUE in 2, text.
EXPANDED = [11, VSTART, PAD, PAD, PAD, PAD, VEND, 12, VSTART, PAD, PAD, VEND, 13]
IMAGES = [
    ImageSpan(hashlib.sha256(RED).hexdigest(), RED, 2, 6),
    ImageSpan(hashlib.sha256(BLUE).hexdigest(), BLUE, 9, 11),
]
COLLAPSED = [11, VSTART, PAD, VEND, 12, VSTART, PAD, VEND, 13]


def vision_engine(llm: FakeLLM) -> VLLMEngine:
    return VLLMEngine(llm, ModelCard("tiny-vl", 64, LogprobsMode.RAW, "vllm", PAD))


def qwen_vl_replacements(counts: Sequence[int]) -> Any:
    """The prompt updates vLLM's Qwen2-VL/Qwen3-VL processor builds for images that take
    ``counts`` tokens: each image's one placeholder replaced by ``count`` of it
    (``Qwen2VLMultiModalProcessor._get_prompt_updates``), bound to each image."""
    from vllm.multimodal.processing.processor import PromptReplacement

    update = PromptReplacement(
        modality="image", target=[PAD], replacement=lambda i: [PAD] * counts[i]
    )
    return {"image": [[update.resolve(i)] for i in range(len(counts))]}


def test_vllm_expands_the_collapsed_prompt_to_the_proxys(vllm_mod: Any) -> None:
    """vLLM's own prompt replacement, given the collapsed ids and each image's token count,
    rebuilds exactly the proxy's expanded ids, with each image's placeholders where its
    span says; given the expanded ids it expands them again (the garbage this avoids)."""
    from vllm.multimodal.processing.processor import apply_token_matches, find_mm_placeholders

    updates = qwen_vl_replacements([4, 2])
    collapsed = collapse_images(EXPANDED, IMAGES, PAD)
    assert collapsed == COLLAPSED
    ids, applied = apply_token_matches(collapsed, updates)
    assert ids == EXPANDED
    assert applied == {"image": [0, 0]}
    placeholders = find_mm_placeholders(ids, updates)["image"]
    assert [(p.start_idx, p.start_idx + p.length) for p in placeholders] == [(2, 6), (9, 11)]
    twice, _ = apply_token_matches(EXPANDED, updates)
    assert twice != EXPANDED
    assert len(twice) > len(EXPANDED)


def test_image_prompt_is_a_tokens_prompt_vllm_parses(vllm_mod: Any) -> None:
    """The prompt holds one placeholder per image and the decoded images in span order,
    which vLLM's multimodal data parser reads as that many images of those sizes."""
    from vllm.multimodal.parse import MultiModalDataParser

    prompt = image_prompt(EXPANDED, list(reversed(IMAGES)), PAD)
    assert prompt["prompt_token_ids"] == COLLAPSED
    images = prompt["multi_modal_data"]["image"]
    assert [(im.mode, im.size) for im in images] == [("RGB", (64, 48)), ("RGB", (32, 32))]
    items = MultiModalDataParser().parse_mm_data(prompt["multi_modal_data"])
    assert items.get_count("image") == 2
    parsed = items["image"]
    assert [parsed.get_image_size(i) for i in range(2)] == [(64, 48), (32, 32)]


async def test_generate_sends_images_and_checks_vllms_expansion(vllm_mod: Any) -> None:
    """An image request reaches vLLM as one placeholder per image plus the images; the
    prompt ids vLLM reports are the proxy's, so the tokens stream as for text."""
    llm = FakeLLM(
        [
            output([4], positions([(4, -0.5)]), prompt_token_ids=EXPANDED),
            output([STOP], positions([(STOP, -0.25)]), "stop", prompt_token_ids=EXPANDED),
        ]
    )
    sampling = SamplingParams(max_tokens=8, stop_token_ids=(STOP,))
    chunks = await collect(vision_engine(llm).generate("req-1", EXPANDED, sampling, IMAGES))
    assert chunks == [TokenChunk([4], [-0.5]), TokenChunk([STOP], [-0.25], FinishReason.STOP)]
    ((prompt, _, _),) = llm.calls
    assert prompt["prompt_token_ids"] == COLLAPSED
    assert [im.size for im in prompt["multi_modal_data"]["image"]] == [(64, 48), (32, 32)]


async def test_another_expansion_fails_the_request_before_any_token(vllm_mod: Any) -> None:
    """vLLM expanding an image to another count (its processor set otherwise than the
    model's files) fails the request before a token goes out, and vLLM's stream is closed
    (which aborts the request in vLLM)."""
    theirs = [*EXPANDED[:3], PAD, *EXPANDED[3:]]  # RED took 5 tokens in vLLM
    closed: list[bool] = []

    class ClosingLLM(FakeLLM):
        async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
            try:
                for item in self.outputs:
                    yield item
            finally:
                closed.append(True)

    llm = ClosingLLM([output([4], positions([(4, -0.5)]), prompt_token_ids=theirs)])
    received: list[TokenChunk] = []

    async def run() -> None:
        stream = vision_engine(llm).generate("r", EXPANDED, SamplingParams(max_tokens=8), IMAGES)
        received.extend([chunk async for chunk in stream])

    with pytest.raises(EngineError, match="14 prompt ids where the proxy's expansion has 13"):
        await run()
    assert received == []
    assert closed == [True]


async def test_bad_spans_fail_before_vllm(vllm_mod: Any) -> None:
    """Spans the prompt does not bear out and undecodable bytes fail before vLLM is called."""
    llm = FakeLLM([])
    sampling = SamplingParams(max_tokens=4)
    bad_span = [IMAGES[0], ImageSpan(IMAGES[1].sha256, BLUE, 8, 11)]
    with pytest.raises(EngineError, match="other tokens"):
        await collect(vision_engine(llm).generate("r", EXPANDED, sampling, bad_span))
    broken = [IMAGES[0], ImageSpan("0" * 64, b"not an image", 9, 11)]
    with pytest.raises(EngineError, match="cannot be decoded"):
        await collect(vision_engine(llm).generate("r", EXPANDED, sampling, broken))
    assert llm.calls == []


async def test_a_text_model_refuses_images() -> None:
    """Images for a model whose card names no image token fail before vLLM is called."""
    llm = FakeLLM([])
    with pytest.raises(EngineError, match=r"tiny \(vllm backend\) does not take images"):
        await collect(engine(llm).generate("r", PROMPT, SamplingParams(max_tokens=4), IMAGES))
    assert llm.calls == []


def _model_config(multimodal: Any, image_token_id: Any = PAD) -> Any:
    return _config(
        max_model_len=64,
        multimodal_config=multimodal,
        hf_config=SimpleNamespace(model_type="qwen3_vl", image_token_id=image_token_id),
    )


class _Limits:
    def __init__(self, image: int) -> None:
        self.image = image

    def get_limit_per_prompt(self, modality: str) -> int:
        return self.image if modality == "image" else 999


def test_served_image_token_needs_images_allowed() -> None:
    """The card names the config's image_token_id only for a multimodal model served with
    images allowed (the proxy then expands its images)."""
    assert served_image_token(_model_config(_Limits(999))) == PAD
    assert served_image_token(_model_config(None)) is None  # a text model
    assert served_image_token(_model_config(_Limits(0))) is None  # images off
    assert served_image_token(_model_config(_Limits(5), image_token_id=None)) is None
    assert served_image_token(SimpleNamespace(max_model_len=16)) is None


def test_served_image_token_reads_vllms_configs(vllm_mod: Any) -> None:
    """With vLLM's own MultiModalConfig: images allowed by default, off with a zero image
    limit or language_model_only; ModelConfig has the fields read."""
    import dataclasses

    from vllm.config.model import ModelConfig
    from vllm.config.multimodal import MultiModalConfig

    assert served_image_token(_model_config(MultiModalConfig())) == PAD
    off = MultiModalConfig(limit_per_prompt={"image": 0})
    assert served_image_token(_model_config(off)) is None
    assert served_image_token(_model_config(MultiModalConfig(language_model_only=True))) is None
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {"multimodal_config", "hf_config", "max_model_len"} <= fields


def test_load_announces_the_image_token(vllm_mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vision-language model vLLM serves with images is announced with its placeholder."""
    from vllm.config.multimodal import MultiModalConfig
    from vllm.v1.engine.async_llm import AsyncLLM

    def fake_from_engine_args(args: Any) -> FakeLLM:
        llm = FakeLLM([])
        llm.model_config = _model_config(MultiModalConfig())
        return llm

    _on_gpu(monkeypatch)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_from_engine_args)
    eng = VLLMEngine.load("/models/tiny-vl", name="tiny-vl")
    assert (eng.card.name, eng.card.max_model_len, eng.card.image_token_id) == ("tiny-vl", 64, PAD)
    assert eng.card.vision


# ------------------------------------------------------------------ routing (R3)

MOE_LAYERS, MOE_TOP_K, MOE_EXPERTS = 3, 2, 8  # of 4 decoder layers: layer 0 is dense


def _moe_config() -> Any:
    """A DeepSeek-shaped config: its first layer dense, the other three with experts."""
    return SimpleNamespace(
        num_hidden_layers=4,
        n_routed_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        first_k_dense_replace=1,
        moe_layer_freq=1,
    )


def routed_output(
    token_ids: Sequence[int], finish_reason: str | None, rows: Any = None, prompt_len: int = 3
) -> Any:
    """A DELTA output whose finished completion carries vLLM's routed experts."""
    out = output(
        token_ids,
        positions([(t, -0.5) for t in token_ids]),
        finish_reason,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
    )
    out.outputs[0].routed_experts = rows
    return out


def vllm_rows(first: int, end: int) -> Any:
    """vLLM's rows of positions ``[first, end)`` over every decoder layer, uint8: position p,
    layer l holds experts ``(p + l) % 8`` and ``(p + l + 1) % 8`` (the dense layer 0: 0s)."""
    import numpy as np

    rows = np.zeros((end - first, 4, MOE_TOP_K), dtype=np.uint8)
    for i, p in enumerate(range(first, end)):
        for layer in range(1, 4):
            rows[i, layer] = [(p + layer) % 8, (p + layer + 1) % 8]
    return rows


def moe_engine(llm: FakeLLM) -> VLLMEngine:
    from worker_client.backends.vllm import served_routing

    shape, layers = served_routing(SimpleNamespace(hf_text_config=_moe_config()))
    return VLLMEngine(llm, ModelCard("moe", 64, LogprobsMode.RAW, "vllm", None, shape), layers)


def test_the_routing_shape_comes_from_the_hf_config(vllm_mod: Any) -> None:
    """The card counts the mixture-of-experts layers as the model builds them, for
    DeepSeek's dense first layers and for Qwen3-MoE's mlp_only_layers / sparse step."""
    from transformers import Qwen3MoeConfig

    from worker_client.backends.vllm import served_routing
    from worker_client.routing import RoutingShape

    shape, layers = served_routing(SimpleNamespace(hf_text_config=_moe_config()))
    assert (shape, layers) == (RoutingShape(3, 2, 8), [1, 2, 3])
    qwen = Qwen3MoeConfig(
        num_hidden_layers=6, num_experts=300, num_experts_per_tok=4, mlp_only_layers=[0]
    )
    shape, layers = served_routing(SimpleNamespace(hf_text_config=qwen))
    assert (shape, layers) == (RoutingShape(5, 4, 300), [1, 2, 3, 4, 5])
    assert shape.dtype == "uint16"
    dense = SimpleNamespace(
        hf_text_config=SimpleNamespace(num_hidden_layers=4),
        get_num_experts=lambda: 0,
        get_num_experts_per_tok=lambda: 0,
        get_total_num_hidden_layers=lambda: 4,
    )
    with pytest.raises(EngineUnavailableError, match="dense"):
        served_routing(dense)


def test_sampling_asks_for_rows_from_the_start(vllm_mod: Any) -> None:
    """vLLM's own SamplingParams takes the prompt position rows are wanted from."""
    params = to_vllm_sampling(SamplingParams(max_tokens=4), vllm_mod, 7)
    assert params.routed_experts_prompt_start == 7
    assert to_vllm_sampling(SamplingParams(max_tokens=4), vllm_mod).routed_experts_prompt_start == 0


async def test_generate_returns_the_moe_layers_rows_from_the_asked_start(vllm_mod: Any) -> None:
    """Prompt of 3, 3 tokens sampled: vLLM's rows of positions [1, 5) (it was asked from
    min(k, prompt) = 3 but an engine may give more) are cut to positions 4.. and the MoE
    layers; the first chunks carry no rows."""
    import numpy as np

    from worker_client.routing import unpack_rows

    llm = FakeLLM(
        [
            routed_output([7], None),
            routed_output([8, 9], "length", vllm_rows(1, 5)),
        ]
    )
    eng = moe_engine(llm)
    chunks = await collect(
        eng.generate("r1", PROMPT, SamplingParams(max_tokens=3), routed_experts_from=4)
    )
    assert llm.calls[0][1].routed_experts_prompt_start == 3
    assert chunks[0].routed_experts is None
    routed = chunks[-1].routed_experts
    assert routed is not None
    assert (routed.start, routed.rows) == (4, 1)
    assert eng.card.routing is not None
    assert np.array_equal(unpack_rows(routed, eng.card.routing), vllm_rows(4, 5)[:, 1:])


async def test_rows_from_a_later_start_than_asked_fail_the_request(vllm_mod: Any) -> None:
    llm = FakeLLM([routed_output([7, 8], "stop", vllm_rows(3, 4))])
    with pytest.raises(EngineError, match="from position 3; it was asked from 1"):
        await collect(
            moe_engine(llm).generate(
                "r1", PROMPT, SamplingParams(max_tokens=3), routed_experts_from=1
            )
        )


async def test_no_rows_from_a_finished_request_fail_it_but_an_early_abort_has_none(
    vllm_mod: Any,
) -> None:
    llm = FakeLLM([routed_output([7], "stop", None)])
    with pytest.raises(EngineError, match="enable_return_routed_experts"):
        await collect(
            moe_engine(llm).generate(
                "r1", PROMPT, SamplingParams(max_tokens=3), routed_experts_from=0
            )
        )
    llm = FakeLLM([routed_output([], "abort", None)])
    (chunk,) = await collect(
        moe_engine(llm).generate("r1", PROMPT, SamplingParams(max_tokens=3), routed_experts_from=0)
    )
    assert chunk.finish_reason is FinishReason.ABORT
    assert chunk.routed_experts is None


async def test_a_text_request_asks_nothing_and_a_model_without_routing_refuses(
    vllm_mod: Any,
) -> None:
    llm = FakeLLM([routed_output([7], "stop", None)])
    chunks = await collect(moe_engine(llm).generate("r1", PROMPT, SamplingParams(max_tokens=3)))
    assert chunks[-1].routed_experts is None
    assert llm.calls[0][1].routed_experts_prompt_start == 0
    with pytest.raises(EngineError, match="reports no routing"):
        await collect(
            engine(FakeLLM([])).generate(
                "r1", PROMPT, SamplingParams(max_tokens=3), routed_experts_from=0
            )
        )


def test_load_turns_on_routed_experts(vllm_mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``routed_experts=True`` starts vLLM with enable_return_routed_experts (a real
    AsyncEngineArgs field) and announces the shape."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from worker_client.routing import RoutingShape

    seen: list[Any] = []

    def fake_from_engine_args(args: Any) -> FakeLLM:
        seen.append(args)
        llm = FakeLLM([])
        llm.model_config = _config(max_model_len=64, hf_text_config=_moe_config())
        return llm

    _on_gpu(monkeypatch)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", fake_from_engine_args)
    eng = VLLMEngine.load("/models/moe", name="moe", routed_experts=True)
    assert seen[0].enable_return_routed_experts is True
    assert eng.card.routing == RoutingShape(3, 2, 8)
    plain = VLLMEngine.load("/models/moe", name="moe")
    assert seen[1].enable_return_routed_experts is False
    assert plain.card.routing is None
