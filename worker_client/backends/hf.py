"""The ``hf`` backend: transformers on the CPU (or any torch device), token in, token out.

It is the embedded default for demos and tests, and loads any local Hugging Face causal-LM
directory. Design points:

* One request runs at a time per engine (an ``asyncio.Lock``); torch work runs on a
  single-thread executor so the event loop keeps serving other sessions while a token is
  being computed. Each sampled token is yielded as soon as it exists (real streaming).
* Prompts are prefilled in chunks (``prefill_chunk`` tokens), so a 60k-token prompt never
  materialises a quadratic attention matrix.
* KV caches are kept in a small LRU keyed by the token ids they cover. Agents resend a
  growing prefix every turn; a prompt that starts with a cached sequence only prefills
  its new tokens.
* Logprobs follow ``LogprobsMode`` (see ``worker_client.engine``).
* Vision-language models (a ``config.json`` with a ``vision_config``, e.g. Qwen3-VL) load
  with ``AutoModelForImageTextToText`` and their own image processor (``AutoImageProcessor``,
  which needs no torchvision). A prompt's images come with the range of their placeholder
  tokens (``ImageSpan``); the engine checks each range against the token count its processor
  gives the image (a mismatch fails the request: the ids would not be what the forward saw),
  computes the M-RoPE positions once per prompt, never cuts an image across two prefill
  chunks, and reuses a cached prefix only where its images are the same.
* New weights load in place (``WeightLoader``): ``stage_weights`` reads a checkpoint the
  trainer wrote (``save_pretrained``) and checks that every parameter has the served
  model's name and shape; ``commit_weights`` copies it into the served model's parameters
  and drops the cached KV (computed with the old weights). Nothing restarts.
* Scoring (a teacher, ``PromptScorer``): ``prompt_logprobs`` runs ``score``, the same
  teacher forcing a fidelity check runs, on the engine's thread, under its lock.
* Routing (a mixture-of-experts model: its card has the routers' ``RoutingShape``): a
  request asking ``routed_experts_from=k`` runs with forward hooks on every router
  (``worker_client.routing.RoutingCapture``), in prefill and every decode step, and its last
  chunk carries the rows of positions ``k`` to the last one run forward. A request that
  does not ask runs no hook. A cached KV prefix keeps the rows of its positions beside it
  (those positions are not run again); a prefix whose rows from ``k`` on are not kept is
  reused only up to ``k``, so the rows asked for are always there.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.protocol import RoutedExperts
from worker_client.engine import (
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
from worker_client.routing import RoutingCapture, engine_rows, find_routers

log = logging.getLogger(__name__)

_GREEDY_BELOW = 1e-5
# Decoded images' pixel values kept by sha256: every turn's history repeats the screenshots.
_PIXEL_CACHE = 32

ImageKey = tuple[str, int, int]  # sha256, start, end


@dataclass(slots=True)
class _CacheEntry:
    ids: list[int]  # the tokens whose keys/values the cache holds
    cache: Any  # transformers DynamicCache
    last_logits: Any  # logits after the last token of ``ids``
    images: tuple[ImageKey, ...] = ()  # the images inside ``ids``
    delta: int = 0  # M-RoPE: a token after the prompt at index i has position i + delta
    # Routing rows of positions [routing_from, routing_from + len(routing)) of ``ids``
    # (None: none kept; a request that asked for none captured none).
    routing: Any = None
    routing_from: int = 0

    @property
    def routing_end(self) -> int:
        return self.routing_from + (0 if self.routing is None else len(self.routing))

    def crop_routing(self, end: int) -> None:
        """Forget the rows of positions from ``end`` on (the KV of those was dropped)."""
        if self.routing is not None and self.routing_end > end:
            self.routing = self.routing[: max(end - self.routing_from, 0)]

    def add_routing(self, rows: Any, start: int) -> None:
        """Keep the rows captured from ``start`` on, after the kept ones if they join."""
        import numpy as np

        if self.routing is not None and len(self.routing) and self.routing_end == start:
            self.routing = np.concatenate([self.routing, rows])
        else:
            self.routing, self.routing_from = rows, start


@dataclass(slots=True)
class _Vision:
    """What a vision-language model's forward needs for one prompt beside its ids."""

    images: list[tuple[ImageSpan, Any, Any]]  # span, pixel_values, image_grid_thw
    positions: Any  # (3, 1, len(prompt)) M-RoPE positions
    delta: int  # a token after the prompt at index i has position i + delta on every axis

    @property
    def keys(self) -> tuple[ImageKey, ...]:
        return tuple((span.sha256, span.start, span.end) for span, _, _ in self.images)

    def positions_of(self, lo: int, hi: int) -> Any:
        """The M-RoPE positions of the tokens at indices ``[lo, hi)``."""
        import torch

        known = self.positions.shape[-1]
        if hi <= known:
            return self.positions[:, :, lo:hi]
        after = torch.arange(max(lo, known), hi, device=self.positions.device) + self.delta
        after = after.view(1, 1, -1).expand(3, 1, -1)
        if lo >= known:
            return after
        return torch.cat([self.positions[:, :, lo:known], after], dim=-1)


class HFEngine:
    def __init__(
        self,
        model: Any,
        *,
        name: str,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        logprobs_mode: LogprobsMode = LogprobsMode.RAW,
        prefill_chunk: int = 2048,
        cache_entries: int = 4,
        device: str = "cpu",
        image_processor: Any = None,
    ) -> None:
        self.model = model
        self.device = device
        self.image_processor = image_processor
        image_token = None
        self._never_sampled: Any = None  # a tensor of the ids sampling leaves out
        if image_processor is not None:
            image_token = int(model.config.image_token_id)
            import torch

            self._never_sampled = torch.tensor(placeholder_ids(model.config), device=device)
        # A mixture-of-experts model's routers: its routing is captured where asked. One
        # whose routers cannot be read (find_routers refuses it) is served without routing.
        try:
            self._routers = find_routers(model)
        except EngineError as error:
            log.warning("%s: served without routing: %s", name, error)
            self._routers = []
        routing = RoutingCapture(model, self._routers).shape if self._routers else None
        self._card = ModelCard(name, max_model_len, logprobs_mode, "hf", image_token, routing)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_chunk = prefill_chunk
        self.cache_entries = cache_entries
        self._caches: OrderedDict[int, _CacheEntry] = OrderedDict()
        self._cache_ids = 0
        self._lock = asyncio.Lock()
        self._cache_argument: str | None = None
        self._keeps_logits = False  # whether the model's forward takes logits_to_keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hf-{name}")
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._staged: dict[str, Any] | None = None  # a checked checkpoint's tensors
        self._pixels: OrderedDict[str, tuple[Any, Any]] = OrderedDict()

    def __repr__(self) -> str:
        return f"<HFEngine {self._card.name} running={len(self._running)}>"

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        name: str | None = None,
        logprobs_mode: LogprobsMode = LogprobsMode.RAW,
        max_model_len: int | None = None,
        device: str = "cpu",
    ) -> HFEngine:
        """Load a Hugging Face causal-LM or vision-language directory in float32 on
        ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...)."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a dependency of [hf]
            raise EngineUnavailableError(f"the hf backend needs torch: {exc}") from None
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise EngineUnavailableError(f"{path} is not a Hugging Face model directory")
        image_processor = None
        if is_vision_model(path):
            from transformers import AutoImageProcessor

            image_processor = AutoImageProcessor.from_pretrained(str(path))  # type: ignore[no-untyped-call]
        model = _auto_class(path).from_pretrained(str(path), dtype=torch.float32)
        try:
            model.to(torch.device(device))
        except (RuntimeError, AssertionError) as exc:  # no such device, or no CUDA build
            raise EngineUnavailableError(f"the hf backend cannot use {device!r}: {exc}") from None
        model.eval()
        eos: list[int] = []
        generation = path / "generation_config.json"
        if generation.is_file():
            value = json.loads(generation.read_text()).get("eos_token_id")
            eos = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
        text_config = model.config.get_text_config()
        if not eos and isinstance(text_config.eos_token_id, int):
            eos = [text_config.eos_token_id]
        window = max_model_len or int(text_config.max_position_embeddings)
        return cls(
            model,
            name=name or path.name,
            max_model_len=window,
            eos_token_ids=eos,
            logprobs_mode=logprobs_mode,
            device=device,
            image_processor=image_processor,
        )

    @property
    def card(self) -> ModelCard:
        return self._card

    # ------------------------------------------------------------------ torch (executor)

    def _run(self, chunk: Any, cache: Any, keep: int, **inputs: Any) -> Any:
        """One forward pass on top of ``cache``, with the logits of the chunk's last
        ``keep`` positions only: the output layer over a whole chunk costs more than the
        rest of a small model's forward (a 2048-token chunk on a 150k-token vocabulary is
        1.2 GB of float32 logits) and only these rows are read. transformers renamed the
        cache argument from ``past_key_values`` to ``cache`` (5.24, the old name
        deprecated): the model's own signature says which one it takes, and whether it
        takes ``logits_to_keep``."""
        if self._cache_argument is None:
            names = inspect.signature(self.model.forward).parameters
            self._cache_argument = "cache" if "cache" in names else "past_key_values"
            self._keeps_logits = "logits_to_keep" in names
        if self._keeps_logits:
            inputs["logits_to_keep"] = keep
        return self.model(
            input_ids=chunk, use_cache=True, **{self._cache_argument: cache}, **inputs
        )

    def _chunks(
        self, start: int, stop: int, vision: _Vision | None
    ) -> list[tuple[int, int, dict[str, Any]]]:
        """Cut ``[start, stop)`` into prefill chunks, each with what a vision-language
        forward needs for its tokens: an image is never cut (its features fill all its
        placeholders in one forward), and the chunk that holds it carries its pixels."""
        import torch

        cuts: list[tuple[int, int, dict[str, Any]]] = []
        at = start
        while at < stop:
            end = min(at + self.prefill_chunk, stop)
            inside: list[tuple[ImageSpan, Any, Any]] = []
            if vision is not None:
                for image in vision.images:
                    span = image[0]
                    if span.start < end and span.end > at:  # it overlaps this chunk
                        end = max(end, span.end)
                        inside.append(image)
            inputs: dict[str, Any] = {}
            if vision is not None:
                inputs["position_ids"] = vision.positions_of(at, end)
            if inside:
                inputs["pixel_values"] = torch.cat([pixels for _, pixels, _ in inside])
                inputs["image_grid_thw"] = torch.cat([grid for _, _, grid in inside])
            cuts.append((at, end, inputs))
            at = end
        return cuts

    def _forward(
        self, ids: Sequence[int], cache: Any, start: int = 0, vision: _Vision | None = None
    ) -> Any:
        """Run ``ids[start:]`` through the model on top of ``cache`` (which holds
        ``ids[:start]``); return the last logits."""
        import torch

        logits = None
        with torch.inference_mode():
            for lo, hi, inputs in self._chunks(start, len(ids), vision):
                chunk = torch.tensor([list(ids[lo:hi])], device=self.device)
                out = self._run(chunk, cache, 1, **inputs)
                logits = out.logits[0, -1].float()
        return logits

    def _vision(self, prompt: Sequence[int], images: Sequence[ImageSpan]) -> _Vision:
        """Each image's pixels, checked against its place in ``prompt``, and the prompt's
        M-RoPE positions (computed by the model itself)."""
        import torch

        image_token = int(self.model.config.image_token_id)
        merge = int(self.image_processor.merge_size) ** 2
        expected = [i for i, token in enumerate(prompt) if token == image_token]
        covered = [i for span in images for i in range(span.start, span.end)]
        if sorted(covered) != expected:
            raise EngineError(
                f"the prompt's {len(expected)} image tokens are not where its "
                f"{len(images)} image(s) say they are"
            )
        loaded = []
        for span in sorted(images, key=lambda s: s.start):
            pixels, grid = self._pixel_values(span)
            tokens = int(grid.prod()) // merge
            if tokens != span.end - span.start:
                raise EngineError(
                    f"image {span.sha256[:12]} takes {tokens} tokens with this model's image "
                    f"processor; the prompt holds {span.end - span.start} for it"
                )
            loaded.append((span, pixels, grid))
        input_ids = torch.tensor([list(prompt)], device=self.device)
        types = (input_ids == image_token).int()
        grids = torch.cat([grid for _, _, grid in loaded]) if loaded else None
        positions, deltas = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=types, image_grid_thw=grids
        )
        return _Vision(loaded, positions, int(deltas.reshape(-1)[0]))

    def _pixel_values(self, span: ImageSpan) -> tuple[Any, Any]:
        """The image's pixel values and grid from the model's own processor, cached by
        hash (the history of every turn repeats its screenshots)."""
        import io

        from PIL import Image, UnidentifiedImageError

        cached = self._pixels.get(span.sha256)
        if cached is not None:
            self._pixels.move_to_end(span.sha256)
            return cached
        try:
            with Image.open(io.BytesIO(span.data)) as opened:
                image = opened.convert("RGB")  # a GIF's first frame, as it is opened
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise EngineError(f"image {span.sha256[:12]} cannot be decoded: {exc}") from None
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except ValueError as exc:  # a size the processor refuses (aspect ratio over 200)
            raise EngineError(f"image {span.sha256[:12]} cannot be processed: {exc}") from None
        result = (out["pixel_values"].to(self.device), out["image_grid_thw"].to(self.device))
        self._pixels[span.sha256] = result
        while len(self._pixels) > _PIXEL_CACHE:
            self._pixels.popitem(last=False)
        return result

    def _take_cache(
        self,
        prompt: Sequence[int],
        images: tuple[ImageKey, ...],
        routing_from: int | None = None,
    ) -> _CacheEntry:
        """The cached entry that spares ``prompt`` the most tokens (``_reusable``: the
        shared prefix, its images the same and none cut, at least one prompt token left
        to run, routing rows kept from ``routing_from``), cropped to them, or a fresh
        cache."""
        from transformers import DynamicCache

        for key, entry in list(self._caches.items()):
            try:
                held = entry.cache.get_seq_length()
            except ValueError:  # linear-attention layers only: no length is kept
                continue
            if held != len(entry.ids):
                # Cropping removes positions from the end: with more positions than ids
                # it would leave foreign keys and values in every later token's context.
                log.error(
                    "%s: a cached sequence holds %d positions for %d ids; dropped",
                    self._card.name,
                    held,
                    len(entry.ids),
                )
                del self._caches[key]
        best_key, best_len = None, 0
        for key, entry in self._caches.items():
            n = _reusable(entry, prompt, images, routing_from)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None:
            return _CacheEntry([], DynamicCache(config=self.model.config), None)
        entry = self._caches.pop(best_key)
        if best_len < len(entry.ids):
            entry.cache.crop(best_len - len(entry.ids))  # negative: tokens to drop
            entry.ids = entry.ids[:best_len]
        entry.crop_routing(best_len)
        return entry

    def _prefill(
        self,
        prompt: Sequence[int],
        images: Sequence[ImageSpan] = (),
        routing_from: int | None = None,
    ) -> tuple[_CacheEntry, int]:
        """The prompt run forward on the longest cached prefix it can reuse; returns its
        entry and the first position run this time."""
        vision = self._vision(prompt, images) if self.image_processor is not None else None
        keys = vision.keys if vision is not None else ()
        entry = self._take_cache(prompt, keys, routing_from)
        reused = len(entry.ids)
        entry.last_logits = self._forward(prompt, entry.cache, reused, vision)
        entry.ids = list(prompt)
        entry.images = keys
        entry.delta = vision.delta if vision is not None else 0
        return entry, reused

    def _keep(self, entry: _CacheEntry) -> None:
        self._cache_ids += 1
        self._caches[self._cache_ids] = entry
        while len(self._caches) > self.cache_entries:
            self._caches.popitem(last=False)

    def _sample(self, logits: Any, sampling: SamplingParams, generator: Any) -> tuple[int, float]:
        import torch

        raw = torch.log_softmax(logits, dim=-1)
        allowed = logits
        if self._never_sampled is not None:
            allowed = logits.index_fill(0, self._never_sampled, float("-inf"))
        if sampling.temperature < _GREEDY_BELOW:
            token = int(torch.argmax(allowed))
            processed = raw
        else:
            scaled = allowed / sampling.temperature
            if sampling.top_k > 0 and sampling.top_k < scaled.shape[-1]:
                kth = torch.topk(scaled, sampling.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if sampling.top_p < 1.0:
                order = torch.argsort(scaled, descending=True)
                probs = torch.softmax(scaled[order], dim=-1)
                before = torch.cumsum(probs, dim=-1) - probs
                drop = order[before >= sampling.top_p]
                scaled = scaled.index_fill(0, drop, float("-inf"))
            processed = torch.log_softmax(scaled, dim=-1)
            token = int(torch.multinomial(processed.exp(), 1, generator=generator))
        chosen = raw if self._card.logprobs_mode is LogprobsMode.RAW else processed
        return token, float(chosen[token])

    def _step(
        self, entry: _CacheEntry, sampling: SamplingParams, generator: Any, last: bool
    ) -> tuple[int, float, bool]:
        """Sample one token; run it through the model unless generation ends here."""
        token, logprob = self._sample(entry.last_logits, sampling, generator)
        stop = token in self.eos_token_ids or token in sampling.stop_token_ids
        if not stop and not last:
            entry.ids.append(token)
            entry.last_logits = self._forward(
                entry.ids, entry.cache, len(entry.ids) - 1, self._decoding(entry)
            )
        return token, logprob, stop

    def _decoding(self, entry: _CacheEntry) -> _Vision | None:
        """What a vision-language model needs to run a sampled token: only its position
        (text after the prompt moves every M-RoPE axis by one)."""
        if self.image_processor is None:
            return None
        import torch

        return _Vision([], torch.zeros((3, 1, 0), dtype=torch.long), entry.delta)

    # ------------------------------------------------------------------ Engine

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Stream one request's tokens; ``images`` sit in ``prompt_ids`` where they say.
        With ``routed_experts_from``, the last chunk carries the routing rows from there."""
        import torch

        room = check_prompt(self._card, prompt_ids)
        if images and self.image_processor is None:
            raise EngineError(f"{self._card.name} does not take images")
        routing = refuse_routing(self._card, routed_experts_from)
        limit = min(sampling.max_tokens, room)
        loop = asyncio.get_running_loop()
        prompt = id_list(prompt_ids)
        self._running.add(request_id)
        try:
            async with self._lock:
                if request_id in self._aborted:
                    yield TokenChunk([], [], FinishReason.ABORT)
                    return
                # Hooks on the routers only while a request that asked for routing runs.
                capture = None if routing is None else RoutingCapture(self.model, self._routers)
                with capture if capture is not None else contextlib.nullcontext():
                    entry, ran_from = await loop.run_in_executor(
                        self._executor, self._prefill, prompt, images, routed_experts_from
                    )
                    generator = torch.Generator(device=self.device)
                    if sampling.seed is not None:
                        generator.manual_seed(sampling.seed)
                    else:
                        generator.seed()
                    keep = True
                    produced = 0

                    def last(
                        tokens: list[int], logprobs: list[float], reason: FinishReason
                    ) -> TokenChunk:
                        """The request's last chunk, with its routing rows where asked."""
                        chunk = TokenChunk(tokens, logprobs, reason)
                        if capture is not None and routed_experts_from is not None:
                            end = len(prompt) + produced - 1  # the last token is not run
                            chunk.routed_experts = self._routed(
                                entry, capture, ran_from, routed_experts_from, end
                            )
                        return chunk

                    try:
                        for produced in range(1, limit + 1):
                            if request_id in self._aborted:
                                produced -= 1  # this one was never sampled
                                yield last([], [], FinishReason.ABORT)
                                return
                            ends = produced == limit
                            token, logprob, stop = await loop.run_in_executor(
                                self._executor, self._step, entry, sampling, generator, ends
                            )
                            if stop:
                                yield last([token], [logprob], FinishReason.STOP)
                                return
                            if ends:
                                yield last([token], [logprob], FinishReason.LENGTH)
                                return
                            yield TokenChunk([token], [logprob])
                    except Exception:
                        keep = False  # a forward that failed half-way leaves the cache unusable
                        raise
                    finally:
                        if keep:
                            if capture is not None and entry.routing_end < len(entry.ids):
                                # Closed before its last chunk: the rows still join the cache.
                                entry.add_routing(capture.rows(), ran_from)
                            self._keep(entry)
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    def _routed(
        self, entry: _CacheEntry, capture: RoutingCapture, ran_from: int, start: int, end: int
    ) -> RoutedExperts:
        """The rows of positions ``[start, end)``: those the cached prefix kept, then those
        captured from ``ran_from`` on; all of them stay with the cache entry."""
        entry.add_routing(capture.rows(), ran_from)
        capture.clear()
        kept = entry.routing[: max(end - entry.routing_from, 0)]
        return engine_rows(
            kept, capture.shape, end=entry.routing_from + len(kept), start_from=start
        )

    async def abort(self, request_id: str) -> None:
        # Only requests that are queued or running: remembering any other id would abort
        # a later request that reuses it (a restarted proxy numbers its requests anew).
        if request_id in self._running:
            self._aborted.add(request_id)

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ weights

    def _read_checkpoint(self, path: str) -> dict[str, Any]:
        """The parameters of the checkpoint at ``path``, checked against the served model:
        the same names and shapes (a checkpoint of another architecture is refused)."""
        import torch

        root = Path(path)
        if not (root / "config.json").is_file():
            raise WeightsError(f"{path} is not a Hugging Face model directory (no config.json)")
        try:
            loaded = _auto_class(root).from_pretrained(str(root), dtype=torch.float32)
        except Exception as exc:  # transformers raises many kinds for unreadable files
            raise WeightsError(f"{path} does not load: {type(exc).__name__}: {exc}") from None
        mine, theirs = self.model.config, loaded.config
        for key in ("model_type", "tie_word_embeddings"):
            if getattr(mine, key, None) != getattr(theirs, key, None):
                # Tied and untied embeddings have the same parameter names: copying one
                # into the other would leave a model that is neither.
                raise WeightsError(
                    f"{path} has {key}={getattr(theirs, key, None)!r}, the served model "
                    f"{getattr(mine, key, None)!r}"
                )
        new = loaded.state_dict()
        served = self.model.state_dict()
        if set(new) != set(served):
            missing, extra = sorted(set(served) - set(new)), sorted(set(new) - set(served))
            raise WeightsError(
                f"{path} has other parameters than the served model "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        for name, tensor in new.items():
            if tensor.shape != served[name].shape:
                raise WeightsError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, the served model "
                    f"{tuple(served[name].shape)}"
                )
        return {name: tensor.detach() for name, tensor in new.items()}

    def _apply_checkpoint(self, tensors: dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            self.model.load_state_dict(tensors, strict=True)
        self._caches.clear()  # keys and values computed with the old weights

    async def stage_weights(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        tensors = await loop.run_in_executor(self._executor, self._read_checkpoint, path)
        self._staged = tensors

    async def commit_weights(self, version: int) -> None:
        if self._staged is None:
            raise WeightsError("no checkpoint was staged")
        tensors, self._staged = self._staged, None
        async with self._lock:  # no forward pass runs while the parameters change
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._apply_checkpoint, tensors
            )

    async def discard_weights(self) -> None:
        self._staged = None

    # ------------------------------------------------------------------ scoring

    async def prompt_logprobs(
        self,
        request_id: str,
        ids: Sequence[int],
        start: int,
        images: Sequence[ImageSpan] = (),
    ) -> list[float]:
        """Teacher forcing (``PromptScorer``): ``score`` of ``ids[start:]`` after
        ``ids[:start]``, one prefill of ``ids``, run as a request (one at a time)."""
        check_scoring(self._card, ids, start)
        sequence = id_list(ids)
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self.score, sequence[:start], sequence[start:], images
            )

    def score(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        images: Sequence[ImageSpan] = (),
    ) -> list[float]:
        """Teacher-forced RAW logprob of each response token given everything before it
        (and the images, where they say they are in ``prompt_ids + response_ids``)."""
        import torch
        from transformers import DynamicCache

        if not prompt_ids:
            raise EngineError("scoring needs at least one prompt token")
        if images and self.image_processor is None:
            raise EngineError(f"{self._card.name} does not take images")
        ids = [*prompt_ids, *response_ids]
        first = len(prompt_ids) - 1  # position whose logits predict response_ids[0]
        vision = None
        if self.image_processor is not None:
            # Images anywhere in the sequence: a trajectory's later turns bring theirs
            # among the response ids (context tokens, mask 0).
            vision = self._vision(ids, images)
        cache = DynamicCache(config=self.model.config)
        out: list[float] = []
        with torch.inference_mode():
            for start, end, inputs in self._chunks(0, len(ids) - 1, vision):
                chunk = torch.tensor([ids[start:end]], device=self.device)
                lo = max(first, start)
                # Only the rows that predict response tokens are read (a chunk of prompt
                # alone keeps one, the least the forward returns).
                logits = self._run(chunk, cache, max(end - lo, 1), **inputs).logits[0]
                if end <= first:
                    continue
                logprobs = torch.log_softmax(logits[-(end - lo) :].float(), dim=-1)
                targets = torch.tensor(ids[lo + 1 : end + 1], device=self.device)
                out.extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
        return out


def is_vision_model(model_dir: Path) -> bool:
    """Whether the Hugging Face directory holds a vision-language model (its configuration
    has a vision tower)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def _auto_class(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(model_dir) else AutoModelForCausalLM


def _reusable(
    entry: _CacheEntry,
    prompt: Sequence[int],
    images: tuple[ImageKey, ...],
    routing_from: int | None,
) -> int:
    """How many leading tokens of ``prompt`` can be taken from ``entry`` instead of run:
    the shared prefix, leaving at least one prompt token to run and no image cut; with
    ``routing_from``, past that position only as far as the entry keeps those positions'
    routing rows. 0 where that means cutting a cache that cannot be cut back."""
    n = min(_shared_prefix(entry.ids, entry.images, prompt, images), len(prompt) - 1)
    if routing_from is not None and routing_from < n:
        if entry.routing_from <= routing_from < entry.routing_end:
            n = min(n, entry.routing_end)
        else:
            n = routing_from
    n = _uncut(n, images)
    if n < len(entry.ids) and not _can_cut(entry.cache):
        return 0
    return n


def _can_cut(cache: Any) -> bool:
    """Whether ``cache`` can be cut back to an earlier position as if the tokens after it
    had never run: not where a layer keeps a running state (linear attention), nor a
    sliding-window layer that reached its window (it no longer holds the positions
    before the window, which a shorter sequence attends to)."""
    if not getattr(cache, "is_croppable", True):
        return False
    return all(
        layer.get_seq_length() < layer.sliding_window
        for layer in cache.layers
        if getattr(layer, "is_sliding", False)
    )


def _shared_prefix(
    ids: Sequence[int],
    images: tuple[ImageKey, ...],
    prompt: Sequence[int],
    prompt_images: tuple[ImageKey, ...],
) -> int:
    """How many leading tokens of a cached sequence a prompt can reuse: the same ids, and
    before that point the same images in the same places (an image's placeholder ids are
    the same whatever the image)."""
    n = _common_prefix(ids, prompt)
    for start in {key[1] for key in set(images) ^ set(prompt_images)}:
        n = min(n, start)
    return n


def _uncut(n: int, images: tuple[ImageKey, ...]) -> int:
    """``n``, or less so that no image is cut: its placeholders are prefilled together."""
    for _, start, end in images:
        if start < n < end:
            n = start
    return n


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
