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
* New weights load in place (``WeightLoader``): ``stage_weights`` reads a checkpoint the
  trainer wrote (``save_pretrained``) and checks that every parameter has the served
  model's name and shape; ``commit_weights`` copies it into the served model's parameters
  and drops the cached KV (computed with the old weights). Nothing restarts.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_client.engine import (
    FinishReason,
    LogprobsMode,
    ModelCard,
    SamplingParams,
    TokenChunk,
    check_prompt,
    id_list,
)
from worker_client.exceptions import EngineError, EngineUnavailableError, WeightsError

_GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class _CacheEntry:
    ids: list[int]  # the tokens whose keys/values the cache holds
    cache: Any  # transformers DynamicCache
    last_logits: Any  # logits after the last token of ``ids``


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
    ) -> None:
        self.model = model
        self.device = device
        self._card = ModelCard(name, max_model_len, logprobs_mode, "hf")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_chunk = prefill_chunk
        self.cache_entries = cache_entries
        self._caches: OrderedDict[int, _CacheEntry] = OrderedDict()
        self._cache_ids = 0
        self._lock = asyncio.Lock()
        self._cache_argument: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hf-{name}")
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._staged: dict[str, Any] | None = None  # a checked checkpoint's tensors

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
        """Load a Hugging Face causal-LM directory in float32 on ``device`` (``cpu``,
        ``cuda``, ``cuda:1``, ...)."""
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError as exc:  # pragma: no cover - torch is a dependency of [hf]
            raise EngineUnavailableError(f"the hf backend needs torch: {exc}") from None
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise EngineUnavailableError(f"{path} is not a Hugging Face model directory")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        try:
            model.to(torch.device(device))  # type: ignore[arg-type]  # transformers wraps .to
        except (RuntimeError, AssertionError) as exc:  # no such device, or no CUDA build
            raise EngineUnavailableError(f"the hf backend cannot use {device!r}: {exc}") from None
        model.eval()  # type: ignore[no-untyped-call]
        eos: list[int] = []
        generation = path / "generation_config.json"
        if generation.is_file():
            value = json.loads(generation.read_text()).get("eos_token_id")
            eos = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
        if not eos and isinstance(model.config.eos_token_id, int):
            eos = [model.config.eos_token_id]
        window = max_model_len or int(model.config.max_position_embeddings)
        return cls(
            model,
            name=name or path.name,
            max_model_len=window,
            eos_token_ids=eos,
            logprobs_mode=logprobs_mode,
            device=device,
        )

    @property
    def card(self) -> ModelCard:
        return self._card

    # ------------------------------------------------------------------ torch (executor)

    def _run(self, chunk: Any, cache: Any) -> Any:
        """One forward pass on top of ``cache``. transformers renamed the argument from
        ``past_key_values`` to ``cache`` (5.24, the old name deprecated): the model's own
        signature says which one it takes."""
        if self._cache_argument is None:
            names = inspect.signature(self.model.forward).parameters
            self._cache_argument = "cache" if "cache" in names else "past_key_values"
        return self.model(input_ids=chunk, use_cache=True, **{self._cache_argument: cache})

    def _forward(self, ids: Sequence[int], cache: Any) -> Any:
        """Run ``ids`` through the model on top of ``cache``; return the last logits."""
        import torch

        logits = None
        with torch.inference_mode():
            for start in range(0, len(ids), self.prefill_chunk):
                chunk = torch.tensor(
                    [list(ids[start : start + self.prefill_chunk])], device=self.device
                )
                out = self._run(chunk, cache)
                logits = out.logits[0, -1].float()
        return logits

    def _take_cache(self, prompt: Sequence[int]) -> _CacheEntry:
        """The cached entry sharing the longest prefix with ``prompt``, cropped to it (at
        least one prompt token is always left to run), or a fresh cache."""
        from transformers import DynamicCache

        best_key, best_len = None, 0
        for key, entry in self._caches.items():
            n = _common_prefix(entry.ids, prompt)
            if n > best_len:
                best_key, best_len = key, n
        best_len = min(best_len, len(prompt) - 1)
        if best_key is None or best_len <= 0:
            return _CacheEntry([], DynamicCache(config=self.model.config), None)
        entry = self._caches.pop(best_key)
        if best_len < len(entry.ids):
            entry.cache.crop(best_len - len(entry.ids))  # negative: tokens to drop
            entry.ids = entry.ids[:best_len]
        return entry

    def _prefill(self, prompt: Sequence[int]) -> _CacheEntry:
        entry = self._take_cache(prompt)
        rest = prompt[len(entry.ids) :]
        entry.last_logits = self._forward(rest, entry.cache)
        entry.ids = list(prompt)
        return entry

    def _keep(self, entry: _CacheEntry) -> None:
        self._cache_ids += 1
        self._caches[self._cache_ids] = entry
        while len(self._caches) > self.cache_entries:
            self._caches.popitem(last=False)

    def _sample(self, logits: Any, sampling: SamplingParams, generator: Any) -> tuple[int, float]:
        import torch

        raw = torch.log_softmax(logits, dim=-1)
        if sampling.temperature < _GREEDY_BELOW:
            token = int(torch.argmax(logits))
            processed = raw
        else:
            scaled = logits / sampling.temperature
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
            entry.last_logits = self._forward([token], entry.cache)
            entry.ids.append(token)
        return token, logprob, stop

    # ------------------------------------------------------------------ Engine

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenChunk, None]:
        import torch

        room = check_prompt(self._card, prompt_ids)
        limit = min(sampling.max_tokens, room)
        loop = asyncio.get_running_loop()
        self._running.add(request_id)
        try:
            async with self._lock:
                if request_id in self._aborted:
                    yield TokenChunk([], [], FinishReason.ABORT)
                    return
                entry = await loop.run_in_executor(
                    self._executor, self._prefill, id_list(prompt_ids)
                )
                generator = torch.Generator(device=self.device)
                if sampling.seed is not None:
                    generator.manual_seed(sampling.seed)
                else:
                    generator.seed()
                keep = True
                try:
                    for produced in range(1, limit + 1):
                        if request_id in self._aborted:
                            yield TokenChunk([], [], FinishReason.ABORT)
                            return
                        last = produced == limit
                        token, logprob, stop = await loop.run_in_executor(
                            self._executor, self._step, entry, sampling, generator, last
                        )
                        if stop:
                            yield TokenChunk([token], [logprob], FinishReason.STOP)
                            return
                        if last:
                            yield TokenChunk([token], [logprob], FinishReason.LENGTH)
                            return
                        yield TokenChunk([token], [logprob])
                except Exception:
                    keep = False  # a forward that failed half-way leaves the cache unusable
                    raise
                finally:
                    if keep:
                        self._keep(entry)
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

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
        from transformers import AutoModelForCausalLM

        root = Path(path)
        if not (root / "config.json").is_file():
            raise WeightsError(f"{path} is not a Hugging Face model directory (no config.json)")
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
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

    def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
        """Teacher-forced RAW logprob of each response token given everything before it."""
        import torch
        from transformers import DynamicCache

        if not prompt_ids:
            raise EngineError("scoring needs at least one prompt token")
        ids = [*prompt_ids, *response_ids]
        first = len(prompt_ids) - 1  # position whose logits predict response_ids[0]
        cache = DynamicCache(config=self.model.config)
        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(ids) - 1, self.prefill_chunk):
                end = min(start + self.prefill_chunk, len(ids) - 1)
                chunk = torch.tensor([ids[start:end]], device=self.device)
                logits = self._run(chunk, cache).logits[0]
                if end <= first:
                    continue
                lo = max(first, start)
                logprobs = torch.log_softmax(logits[lo - start :].float(), dim=-1)
                targets = torch.tensor(ids[lo + 1 : end + 1], device=self.device)
                out.extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
