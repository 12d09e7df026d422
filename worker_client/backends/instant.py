"""The ``instant`` backend: a benchmark-only engine that runs no model.

It answers every request at once with token ids and logprobs drawn from a seeded
generator, so a benchmark through proxy + relay + worker measures the proxy's own cost
rather than a model's. It is not a policy: its tokens are noise from the tokenizer's plain
vocabulary (special and added tokens are never produced, so a reply never looks like a
tool call), and its logprobs are made up.

* A reply has ``reply_tokens`` tokens (capped by ``max_tokens`` and the context window).
  When the cap did not cut it short, its last token is the model's end-of-sequence token
  and the reply finishes with ``stop``; otherwise with ``length``.
* Tokens are streamed one per chunk, as a real engine does, either back to back
  (``tokens_per_second=0``) or paced at that rate in engine steps: steps fall on a clock
  shared by every request, so all running requests get their next token at the same
  moment, as a batching GPU engine samples one token for every running sequence per step.
* The same seed and prompt length give the same reply; without a seed, the request id
  seeds it.
* A vision-language model's directory (its config names an ``image_token_id``) makes a
  card that takes images: they are received and ignored, so a benchmark measures what
  carrying images costs the proxy and the relay, not what a vision encoder costs.
* A mixture-of-experts model's directory (its config names experts per token) makes a
  card with its routing shape: a request that asks for routing gets rows of made-up expert
  ids from the asked position on, as an engine reports them, so a benchmark measures what
  recording routing costs the proxy.
* The last chunk's ``extra`` carries ``first_token_time``: the wall-clock time (Unix
  seconds) at which the first token was handed on, so a benchmark can tell how long the
  token took to reach the agent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

from relay.protocol import RoutedExperts, RoutingShape
from worker_client.engine import (
    FinishReason,
    ImageSpan,
    LogprobsMode,
    ModelCard,
    SamplingParams,
    TokenChunk,
    check_prompt,
    refuse_images,
    refuse_routing,
)
from worker_client.exceptions import EngineUnavailableError
from worker_client.routing import pack_rows, shape_from_config


class InstantEngine:
    def __init__(
        self,
        *,
        name: str,
        vocab: Sequence[int],
        eos_token_id: int,
        max_model_len: int = 131072,
        reply_tokens: int = 16,
        tokens_per_second: float = 0.0,
        image_token_id: int | None = None,
        routing: RoutingShape | None = None,
    ) -> None:
        if not vocab:
            raise EngineUnavailableError("the instant backend needs a non-empty vocabulary")
        if reply_tokens < 1:
            raise EngineUnavailableError("reply_tokens must be at least 1")
        if tokens_per_second < 0:
            raise EngineUnavailableError("tokens_per_second must be >= 0")
        self._card = ModelCard(
            name, max_model_len, LogprobsMode.RAW, "instant", image_token_id, routing
        )
        self.vocab = list(vocab)
        self.eos_token_id = eos_token_id
        self.reply_tokens = reply_tokens
        self.tokens_per_second = tokens_per_second
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._step: asyncio.Event | None = None  # set when the coming step is taken
        self.served = 0

    def __repr__(self) -> str:
        return f"<InstantEngine {self._card.name} running={len(self._running)}>"

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        name: str | None = None,
        reply_tokens: int = 16,
        tokens_per_second: float = 0.0,
        max_model_len: int | None = None,
    ) -> InstantEngine:
        """Take the vocabulary, end-of-sequence token and window from a Hugging Face
        model directory's tokenizer and config files (weights are never read)."""
        path = Path(model_dir)
        try:
            tokenizer = json.loads((path / "tokenizer.json").read_text())
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise EngineUnavailableError(
                f"{path}: no readable tokenizer.json/config.json: {exc}"
            ) from None
        special = {int(t["id"]) for t in tokenizer.get("added_tokens", [])}
        vocab = sorted(
            i for i in tokenizer.get("model", {}).get("vocab", {}).values() if i not in special
        )
        text = config.get("text_config")
        text = text if isinstance(text, dict) else {}
        eos = config.get("eos_token_id", text.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if not isinstance(eos, int):
            raise EngineUnavailableError(f"{path}/config.json declares no eos_token_id")
        window = max_model_len or int(
            config.get("max_position_embeddings", text.get("max_position_embeddings", 131072))
        )
        image_token = config.get("image_token_id")
        return cls(
            name=name or path.name,
            vocab=vocab,
            eos_token_id=eos,
            max_model_len=window,
            reply_tokens=reply_tokens,
            tokens_per_second=tokens_per_second,
            image_token_id=image_token if isinstance(image_token, int) else None,
            routing=shape_from_config(config),
        )

    @property
    def card(self) -> ModelCard:
        return self._card

    def _rng(self, request_id: str, prompt_len: int, seed: int | None) -> random.Random:
        base = seed if seed is not None else request_id
        digest = hashlib.blake2b(f"{base}/{prompt_len}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little"))

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        routing = refuse_routing(self._card, routed_experts_from)
        if not self._card.vision:  # a vision card takes them, and runs no model on them
            refuse_images(self._card, images)
        room = check_prompt(self._card, prompt_ids)
        limit = min(sampling.max_tokens, room)
        count = min(self.reply_tokens, limit)
        ends_with_stop = count == self.reply_tokens
        rng = self._rng(request_id, len(prompt_ids), sampling.seed)
        delay = 1.0 / self.tokens_per_second if self.tokens_per_second > 0 else 0.0
        self._running.add(request_id)
        self.served += 1
        first_at = 0.0
        try:
            for produced in range(1, count + 1):
                if request_id in self._aborted:
                    yield TokenChunk([], [], FinishReason.ABORT)
                    return
                if delay:
                    await self._next_step(delay).wait()
                logprob = -rng.random() * 4.0
                if produced == 1:
                    first_at = time.time()
                if produced < count:
                    yield TokenChunk([rng.choice(self.vocab)], [logprob])
                    continue
                extra: dict[str, str | int | float] = {"first_token_time": first_at}
                rows = None
                if routing is not None and routed_experts_from is not None:
                    rows = _made_up_rows(routing, routed_experts_from, len(prompt_ids) + count - 1)
                token = self.eos_token_id if ends_with_stop else rng.choice(self.vocab)
                finish = FinishReason.STOP if ends_with_stop else FinishReason.LENGTH
                yield TokenChunk([token], [logprob], finish, extra, routed_experts=rows)
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    def _next_step(self, interval: float) -> asyncio.Event:
        """The coming engine step, shared by every request: steps fall on multiples of
        ``interval`` of the loop's clock, and every request waiting on one wakes in the
        same turn of the loop (so the worker sends their tokens as one frame)."""
        if self._step is None or self._step.is_set():
            loop = asyncio.get_running_loop()
            self._step = asyncio.Event()
            loop.call_at((math.floor(loop.time() / interval) + 1) * interval, self._step.set)
        return self._step

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    async def close(self) -> None:
        return None


def _made_up_rows(shape: RoutingShape, start: int, end: int) -> RoutedExperts:
    """Rows of positions ``[start, end)`` with made-up expert ids (an engine's are its
    routers' choices; only their size matters to a benchmark)."""
    import numpy as np

    rows = max(end - start, 0)
    ids = np.arange(rows * shape.layers * shape.top_k) % shape.experts
    return pack_rows(ids.reshape(rows, shape.layers, shape.top_k), start, shape)
