"""A scripted worker on the tiny model, for the end-to-end tests that need a reply of a
given shape: text then a tool call, a reply long enough to still be running when a worker
is hit or the proxy drains, a few words of text.

Sampling from the tiny model gives such shapes only for some seeds, and which seeds
depends on the processor that trained the weights. Here the proxy, the relay and the
worker client are the real ones and each token's logprob is the tiny model's own (so a
trajectory re-scores by teacher forcing), but the choice of tokens is scripted
(``tests.scripted_policy``), paced one token per engine step as a real engine streams.

``python -m tests.scripted_worker --proxy URL --model DIR --worker-id ID`` runs a worker
of its own that answers every request with ``LONG_STORY`` (one the tests can kill or
freeze mid-reply).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from relay import protocol
from rollout_relay.embedded import RunningProxy
from tests.scripted_policy import ScriptedEngine
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel, WorkerClient
from worker_client.engine import FinishReason, ImageSpan, SamplingParams, TokenChunk

# Seconds between two tokens: enough that each engine step leaves as a frame of its own.
STEP_SECONDS = 0.002

# A reply of about 340 tokens with no end of turn: cut by max_tokens, finish "length".
LONG_STORY = " ".join(
    ["the agent reads every file of the project and runs the tests then writes a summary"] * 22
)

# A call as the policy writes it: (name, arguments).
Call = tuple[str, dict[str, Any]]


def tiny_reply(content: str = "", calls: Sequence[Call] = ()) -> str:
    """One assistant turn of the tiny model as it samples it (and its chat template renders
    it back): the text, each call in hermes markup on a line of its own, ``<|im_end|>``."""
    blocks = [
        "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        for name, args in calls
    ]
    return "\n".join([content, *blocks] if content else blocks) + "<|im_end|>"


class PacedScriptedEngine(ScriptedEngine):
    """A ``ScriptedEngine`` streaming one token per step, ``delay`` seconds apart, that
    stops when its request is aborted."""

    def __init__(
        self,
        scorer: HFEngine,
        tokenizer: object,
        policy: Callable[[str], str] | None = None,
        *,
        delay: float = STEP_SECONDS,
    ) -> None:
        super().__init__(scorer, tokenizer, policy)
        self.delay = delay
        self._aborted: set[str] = set()

    def reset(self, delay: float = STEP_SECONDS) -> None:
        """No reply queued or recorded, no policy, the default pace (between tests on a
        shared stack)."""
        self.replies.clear()
        self.prompts.clear()
        self.sampled.clear()
        self.policy = None
        self.delay = delay

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenChunk, None]:
        self._aborted.discard(request_id)
        async for chunk in super().generate(request_id, prompt_ids, sampling):
            if not chunk.token_ids:
                yield chunk
                continue
            last = len(chunk.token_ids) - 1
            for at, token in enumerate(chunk.token_ids):
                await asyncio.sleep(self.delay)
                if request_id in self._aborted:
                    self._aborted.discard(request_id)
                    yield TokenChunk([], [], FinishReason.ABORT)
                    return
                finish = chunk.finish_reason if at == last else None
                yield TokenChunk([token], [chunk.logprobs[at]], finish)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)


def scripted_engine(
    model_dir: Path, policy: Callable[[str], str] | None = None
) -> PacedScriptedEngine:
    """A paced scripted engine scored by the model in ``model_dir`` (served under its name)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return PacedScriptedEngine(HFEngine.load(model_dir), tokenizer, policy)


def serve_scripted(running: RunningProxy, model_dir: Path, worker_id: str) -> PacedScriptedEngine:
    """A scripted engine on the tiny model, served to ``running`` by a real worker client in
    this loop (as ``start_hf_worker`` serves the model itself)."""
    engine = scripted_engine(model_dir)
    client = WorkerClient(
        running.worker_url, {engine.card.name: ServedModel(engine, model_dir)}, worker_id=worker_id
    )
    running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    return engine


# The routing a scripted mixture-of-experts engine reports: 2 MoE layers, 2 of 8 experts.
ROUTING = protocol.RoutingShape(layers=2, top_k=2, experts=8)


def routing_row(position: int, token: int) -> bytes:
    """The experts the scripted engine routes the token ``token`` at ``position`` to: a
    function of both, so rows put at the wrong position or for the wrong token show."""
    width = ROUTING.layers * ROUTING.top_k
    return bytes((token * 7 + position * 3 + slot) % ROUTING.experts for slot in range(width))


def routing_rows(ids: Sequence[int], start: int, end: int) -> bytes:
    return b"".join(routing_row(p, ids[p]) for p in range(start, end))


class RoutingEngine:
    """A scripted engine served as a mixture-of-experts engine that reports routing: its
    card announces ``ROUTING`` and a request that asks ends with the rows asked for
    (``routing_row`` of every position run forward from the one asked). ``early`` rows
    more than asked (an engine may start earlier), ``short`` fewer at the end (an engine
    that gave fewer); ``asked`` records (asked from, rows start, rows) per request."""

    def __init__(self, inner: PacedScriptedEngine) -> None:
        self.inner = inner
        self.card = dataclasses.replace(inner.card, routing=ROUTING)
        self.early = 0
        self.short = 0
        self.asked: list[tuple[int | None, int, int]] = []

    def __getattr__(self, name: str) -> Any:  # abort, close, load_weights, ... as the inner
        return getattr(self.inner, name)

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        ids = list(prompt_ids)
        stream = self.inner.generate(request_id, prompt_ids, sampling)  # takes no images
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                ids.extend(chunk.token_ids)
                if chunk.finish_reason is None or routed_experts_from is None:
                    if chunk.finish_reason is not None:
                        self.asked.append((None, 0, 0))
                    yield chunk
                    continue
                start = max(0, routed_experts_from - self.early)
                end = max(start, len(ids) - 1 - self.short)
                self.asked.append((routed_experts_from, start, end - start))
                rows = protocol.RoutedExperts(start, end - start, routing_rows(ids, start, end))
                yield dataclasses.replace(chunk, routed_experts=rows)


def serve_routing(
    running: RunningProxy, model_dir: Path, worker_id: str
) -> tuple[PacedScriptedEngine, RoutingEngine]:
    """A scripted engine on the tiny model served as a mixture-of-experts model that
    reports routing (``RoutingEngine``)."""
    engine = scripted_engine(model_dir)
    routing = RoutingEngine(engine)
    served = {routing.card.name: ServedModel(routing, model_dir)}
    client = WorkerClient(running.worker_url, served, worker_id=worker_id)
    running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    return engine, routing


async def _serve(proxy_url: str, model_dir: Path, worker_id: str, delay: float) -> None:
    engine = scripted_engine(model_dir, lambda prompt: LONG_STORY)
    engine.delay = delay
    served = {engine.card.name: ServedModel(engine, model_dir)}
    await WorkerClient(proxy_url, served, worker_id=worker_id).run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.scripted_worker")
    parser.add_argument("--proxy", required=True, help="the proxy's worker URL (ws://...)")
    parser.add_argument("--model", required=True, type=Path, help="the tiny model's folder")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between tokens")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.proxy, args.model, args.worker_id, args.delay))


if __name__ == "__main__":
    main()
