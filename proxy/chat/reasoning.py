"""Separating a model's reasoning from its answer, as text streams in.

Reasoning models of the think-tag families (Qwen3, DeepSeek-R1/V3.1, GLM-4.5) write
``<think>reasoning</think>answer``. Some generation prompts already open the block
(DeepSeek-R1's ends in ``<think>\\n``), so the sampled text starts inside the reasoning;
whether it does is read from the prompt's end (``opens_reasoning``).

Rules:

* Reasoning is recognised only at the start of the reply: ``<think>`` after nothing but
  whitespace, or from the first character when the prompt opened the block. A ``<think>``
  later in the answer is answer text.
* The reasoning is the text between the tags, without the newlines that frame it; the
  answer is what follows ``</think>``, without the newlines that separate it.
* A reply that ends inside the block (cut short) is all reasoning and no answer.
* Text that may still become a tag is held back until it is known not to be one, so the
  streamed pieces add up to the final values.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from proxy.chat.stops import held_back

OPEN = "<think>"
CLOSE = "</think>"


class _State(Enum):
    START = "start"  # nothing but whitespace seen yet
    REASONING = "reasoning"
    SEPARATOR = "separator"  # after </think>, dropping the newlines before the answer
    ANSWER = "answer"


@dataclass(slots=True, frozen=True)
class ReasoningPiece:
    text: str


@dataclass(slots=True, frozen=True)
class AnswerPiece:
    text: str


Piece = ReasoningPiece | AnswerPiece


class Splitter(Protocol):
    """One reply's text in (``feed`` as it streams, then ``finish`` once), reasoning and
    answer pieces out; ``reasoning`` and ``answer`` collect every piece's text."""

    reasoning: list[str]
    answer: list[str]

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves a think block open."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class PieceCollector:
    """What every splitter shares: each non-empty piece goes out and into ``reasoning`` or
    ``answer``."""

    __slots__ = ("answer", "reasoning")

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.answer: list[str] = []

    def _emit(self, pieces: list[Piece], piece: Piece) -> None:
        if piece.text:
            (self.reasoning if isinstance(piece, ReasoningPiece) else self.answer).append(
                piece.text
            )
            pieces.append(piece)


class ReasoningSplitter(PieceCollector):
    """One reply's text in, reasoning and answer pieces out."""

    __slots__ = ("_buffer", "_lead", "_state")

    def __init__(self, *, in_reasoning: bool = False, enabled: bool = True) -> None:
        """``enabled=False``: a model without reasoning, every piece is answer."""
        self._state = (
            _State.ANSWER if not enabled else _State.REASONING if in_reasoning else _State.START
        )
        super().__init__()
        self._buffer = ""
        self._lead = in_reasoning  # newlines right after the open tag are dropped

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._buffer:
            buffer = self._buffer
            if self._state is _State.START:
                stripped = buffer.lstrip()
                if stripped.startswith(OPEN):
                    self._buffer = stripped[len(OPEN) :]
                    self._state, self._lead = _State.REASONING, True
                    continue
                if OPEN.startswith(stripped) and not final:
                    break  # whitespace or a partial tag: wait
                self._state = _State.ANSWER
                continue
            if self._state is _State.REASONING:
                if self._lead:
                    stripped = buffer.lstrip("\n")
                    if not stripped and not final:
                        self._buffer = ""
                        break
                    buffer, self._lead = stripped, False
                at = buffer.find(CLOSE)
                if at >= 0:
                    self._emit(pieces, ReasoningPiece(buffer[:at].rstrip("\n")))
                    self._buffer = buffer[at + len(CLOSE) :]
                    self._state = _State.SEPARATOR
                    continue
                keep = 0
                if not final:  # a partial close tag, and the newlines before it
                    tag = held_back(buffer, CLOSE)
                    keep = tag + _trailing_newlines(buffer[: len(buffer) - tag])
                self._emit(pieces, ReasoningPiece(buffer[: len(buffer) - keep]))
                self._buffer = buffer[len(buffer) - keep :]
                if final:
                    self._buffer = ""
                    if pieces and isinstance(pieces[-1], ReasoningPiece):
                        # A reply cut inside the block: drop the framing newlines.
                        last = pieces.pop()
                        self.reasoning.pop()
                        self._emit(pieces, ReasoningPiece(last.text.rstrip("\n")))
                break
            if self._state is _State.SEPARATOR:
                stripped = buffer.lstrip("\n")
                if not stripped:
                    self._buffer = ""
                    break
                self._buffer, self._state = stripped, _State.ANSWER
                continue
            self._emit(pieces, AnswerPiece(buffer))
            self._buffer = ""
        return pieces


def _trailing_newlines(text: str) -> int:
    return len(text) - len(text.rstrip("\n"))


def split_whole(splitter: Splitter, text: str) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply, through a fresh ``splitter``."""
    splitter.feed(text)
    splitter.finish()
    return "".join(splitter.reasoning), "".join(splitter.answer)


def split_reasoning(text: str, *, in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole think-tag reply."""
    return split_whole(ReasoningSplitter(in_reasoning=in_reasoning), text)
