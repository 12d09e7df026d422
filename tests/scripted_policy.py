"""A scripted policy: an engine that samples the tokens of scripted replies, scored by a
real model.

Tests that need a model to reason and call tools in its family's native markup (the tiny
random models rarely do) serve this engine through a real worker: the proxy, the relay
and the worker are the real ones, the *choice* of tokens is scripted, and every token's
logprob is the tiny model's own raw logprob given the exact prompt the worker received,
so fidelity re-scoring of the recorded trajectories is a real check.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence

from worker_client.backends.hf import HFEngine
from worker_client.engine import FinishReason, ModelCard, SamplingParams, TokenChunk


class ScriptedEngine:
    """Replies come from the queue (``script``) in order; once it is empty, from
    ``policy`` (a function of the prompt's text) when there is one."""

    def __init__(
        self, scorer: HFEngine, tokenizer: object, policy: Callable[[str], str] | None = None
    ) -> None:
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.policy = policy
        self.replies: deque[str | Callable[[str], str]] = deque()
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    @property
    def card(self) -> ModelCard:
        return self.scorer.card

    def script(self, *replies: str | Callable[[str], str]) -> None:
        """Queue replies: texts, or functions of the prompt's text giving one."""
        self.replies.extend(replies)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenChunk, None]:
        if not self.replies and self.policy is not None:
            self.replies.append(self.policy)
        reply = self.replies.popleft()
        if callable(reply):
            reply = reply(self.tokenizer.decode(list(prompt_ids)))  # type: ignore[attr-defined]
        ids = self.tokenizer.encode(reply, add_special_tokens=False)  # type: ignore[attr-defined]
        # A reply longer than the request's max_tokens is cut there, as an engine cuts it.
        finish = FinishReason.LENGTH if len(ids) > sampling.max_tokens else FinishReason.STOP
        ids = ids[: sampling.max_tokens]
        self.prompts.append(list(prompt_ids))
        self.sampled.append(ids)
        logprobs = self.scorer.score(prompt_ids, ids)
        for at in range(0, len(ids) - 3, 3):  # streamed in small chunks, as an engine does
            yield TokenChunk(ids[at : at + 3], logprobs[at : at + 3])
        tail = (len(ids) - 1) // 3 * 3 if len(ids) > 3 else 0
        yield TokenChunk(ids[tail:], logprobs[tail:], finish)

    async def abort(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        await self.scorer.close()
