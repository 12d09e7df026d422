"""Separating think-tag reasoning from the answer, whole and streamed."""

from __future__ import annotations

import pytest

from proxy.chat.reasoning import (
    AnswerPiece,
    ReasoningPiece,
    ReasoningSplitter,
    opens_reasoning,
    split_reasoning,
)

CASES = [
    # (text, starts inside the block, reasoning, answer)
    ("<think>\nplan it\n</think>\n\nDone.", False, "plan it", "Done."),
    ("  <think>a</think>b", False, "a", "b"),
    ("plain answer <think>x</think>", False, "", "plain answer <think>x</think>"),
    ("plan it\n</think>\n\nDone.", True, "plan it", "Done."),
    ("<think>\ncut short", False, "cut short", ""),
    ("<think>\n\n</think>\n\nHi", False, "", "Hi"),
    ("", False, "", ""),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "answer"), CASES)
def test_split_whole(text: str, inside: bool, reasoning: str, answer: str) -> None:
    """A whole reply splits into its reasoning and its answer."""
    assert split_reasoning(text, in_reasoning=inside) == (reasoning, answer)


@pytest.mark.parametrize(("text", "inside", "reasoning", "answer"), CASES)
@pytest.mark.parametrize("size", [1, 2, 5])
def test_streamed_pieces_add_up(
    text: str, inside: bool, reasoning: str, answer: str, size: int
) -> None:
    """Fed a few characters at a time (tags split anywhere), the pieces add up to the
    same reasoning and answer, and no piece carries a tag."""
    splitter = ReasoningSplitter(in_reasoning=inside)
    pieces = []
    for at in range(0, len(text), size):
        pieces += splitter.feed(text[at : at + size])
    pieces += splitter.finish()
    assert "".join(p.text for p in pieces if isinstance(p, ReasoningPiece)) == reasoning
    assert "".join(p.text for p in pieces if isinstance(p, AnswerPiece)) == answer
    if reasoning:
        assert not any("think>" in p.text for p in pieces if isinstance(p, ReasoningPiece))


def test_disabled_splitter_passes_everything_as_answer() -> None:
    """A model without reasoning: think tags are answer text."""
    splitter = ReasoningSplitter(enabled=False)
    pieces = splitter.feed("<think>x</think>y") + splitter.finish()
    assert pieces == [AnswerPiece("<think>x</think>y")]


def test_generation_prompts_that_open_a_block() -> None:
    """R1's prompt ends inside a think block; Qwen3's with thinking off closes it."""
    assert opens_reasoning("<｜Assistant｜><think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")
