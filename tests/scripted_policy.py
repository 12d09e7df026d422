"""A scripted policy: an engine that samples the tokens of scripted replies, scored by a
real model.

Tests that need a model to reason and call tools in its family's native markup (the tiny
random models rarely do) serve this engine through a real worker: the proxy, the relay
and the worker are the real ones, the *choice* of tokens is scripted, and every token's
logprob is the tiny model's own raw logprob given the exact prompt the worker received,
so fidelity re-scoring of the recorded trajectories is a real check.

Agents resend a growing prefix every turn (Claude Code's system prompt and tools are ~20k
tokens), so the engine keeps the KV cache of the last sequence it scored and runs only what
follows the shared prefix, as the hf engine's own generation does; the fidelity checks
re-score whole trajectories with ``HFEngine.score``, which reuses nothing.

Like a real model, the policy calls only tools its prompt shows: a reply scripted as a
``Turn`` keeps a tool call only when the prompt it is given contains that tool's name and
definition, so a template that drops the agent's tools cannot pass unnoticed (the calls
are left out, the agent gets none, and ``unseen`` names them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker_client.backends.hf import HFEngine
from worker_client.engine import FinishReason, ModelCard, SamplingParams, TokenChunk

# A tool call as the policy means to write it: (name, arguments).
Call = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Turn:
    """A reply the policy means to write; ``ScriptedEngine.write`` puts it in the model's
    markup once the calls to tools the prompt does not show are left out."""

    reasoning: str
    content: str
    calls: tuple[Call, ...] = ()


def shows_tool(prompt: str, name: str, definition: Sequence[str] = ()) -> bool:
    """Whether ``prompt`` shows the tool: its name and every given part of its definition
    (its description, its parameters' names) appear in it."""
    return all(part in prompt for part in (name, *definition))


Reply = str | Turn | Callable[[str], str | Turn]


class ScriptedEngine:
    """Replies come from the queue (``script``) in order; once it is empty, from
    ``policy`` (a function of the prompt's text) when there is one.

    A ``Turn`` is written by ``write`` (the prompt, reasoning, content and calls → the
    model's text), keeping only calls to tools the prompt shows; ``tools`` gives each
    tool's definition as the agent sends it (see ``shows_tool``)."""

    def __init__(
        self,
        scorer: HFEngine,
        tokenizer: object,
        policy: Callable[[str], str | Turn] | None = None,
        *,
        write: Callable[[str, str, str, list[Call]], str] | None = None,
        tools: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.policy = policy
        self.write = write
        self.tools = dict(tools or {})
        self.replies: deque[Reply] = deque()
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []
        # The tools a Turn meant to call that its prompt did not show.
        self.unseen: list[str] = []
        # The KV cache of the last sequence scored, and the ids it holds.
        self._cache: Any = None
        self._cached: list[int] = []

    @property
    def card(self) -> ModelCard:
        return self.scorer.card

    def script(self, *replies: Reply) -> None:
        """Queue replies: texts or turns, or functions of the prompt's text giving one."""
        self.replies.extend(replies)

    def _written(self, prompt: str, turn: Turn) -> str:
        """The turn in the model's markup, calling only tools the prompt shows; with none
        left it answers that it has no such tool, as a model that was not shown it would."""
        if self.write is None:
            raise TypeError("a Turn needs the engine's write function")
        calls = [c for c in turn.calls if shows_tool(prompt, c[0], self.tools.get(c[0], ()))]
        missing = [c[0] for c in turn.calls if c not in calls]
        self.unseen.extend(missing)
        content = turn.content
        if missing and not calls:
            content = content or f"No tool named {missing[0]} was shown to me."
        return self.write(prompt, turn.reasoning, content, calls)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenChunk, None]:
        if not self.replies and self.policy is not None:
            self.replies.append(self.policy)
        reply = self.replies.popleft()
        if not isinstance(reply, str):
            prompt = self.tokenizer.decode(list(prompt_ids))  # type: ignore[attr-defined]
            if callable(reply):
                reply = reply(prompt)
            if isinstance(reply, Turn):
                reply = self._written(prompt, reply)
        ids = self.tokenizer.encode(reply, add_special_tokens=False)  # type: ignore[attr-defined]
        # A reply longer than the request's max_tokens is cut there, as an engine cuts it.
        finish = FinishReason.LENGTH if len(ids) > sampling.max_tokens else FinishReason.STOP
        ids = ids[: sampling.max_tokens]
        self.prompts.append(list(prompt_ids))
        self.sampled.append(ids)
        logprobs = self._logprobs(prompt_ids, ids)
        for at in range(0, len(ids) - 3, 3):  # streamed in small chunks, as an engine does
            yield TokenChunk(ids[at : at + 3], logprobs[at : at + 3])
        tail = (len(ids) - 1) // 3 * 3 if len(ids) > 3 else 0
        yield TokenChunk(ids[tail:], logprobs[tail:], finish)

    def _logprobs(self, prompt_ids: Sequence[int], ids: Sequence[int]) -> list[float]:
        """The scorer's raw logprob of each of ``ids`` after ``prompt_ids`` (what
        ``HFEngine.score`` gives), running forward only what follows the prefix shared
        with the last sequence scored."""
        import torch
        from transformers import DynamicCache

        if not ids:
            return []
        sequence = [*prompt_ids, *ids]
        first = len(prompt_ids) - 1  # the position whose logits predict ids[0]
        shared = 0
        for a, b in zip(self._cached, sequence, strict=False):
            if a != b:
                break
            shared += 1
        shared = min(shared, first)
        if self._cache is None or shared == 0:
            self._cache, shared = DynamicCache(config=self.scorer.model.config), 0
        elif shared < len(self._cached):
            self._cache.crop(shared - len(self._cached))  # negative: tokens to drop
        self._cached = []  # until the cache holds what it is going to
        out: list[float] = []
        step = self.scorer.prefill_chunk
        with torch.inference_mode():
            for start in range(shared, len(sequence) - 1, step):
                end = min(start + step, len(sequence) - 1)
                lo = max(first, start)
                chunk = torch.tensor([sequence[start:end]], device=self.scorer.device)
                logits = self.scorer._run(chunk, self._cache, max(end - lo, 1)).logits[0]
                if end <= first:
                    continue
                logprobs = torch.log_softmax(logits[-(end - lo) :].float(), dim=-1)
                targets = torch.tensor(sequence[lo + 1 : end + 1], device=self.scorer.device)
                out.extend(logprobs.gather(1, targets[:, None])[:, 0].tolist())
        self._cached = sequence[:-1]
        return out

    async def abort(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        await self.scorer.close()
