"""gpt-oss's harmony replies split into reasoning, answer and tool calls, whole and
streamed."""

from __future__ import annotations

import itertools
import random

import pytest

from proxy.chat.harmony import HarmonySplitter, call_markup
from proxy.chat.reasoning import AnswerPiece, Piece, ReasoningPiece
from proxy.toolcalls import ParsedToolCall, get_parser

ANALYSIS = "<|channel|>analysis<|message|>I should list files.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": "ls"}'
FINAL = "<|start|>assistant<|channel|>final<|message|>Done: 2 files."
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Listing now.<|end|>"

SAMPLES = [
    ANALYSIS + CALL,
    ANALYSIS + FINAL,
    ANALYSIS + PREAMBLE + CALL,
    FINAL.removeprefix("<|start|>assistant"),
    # The recipient in the role, as the template writes history.
    ' to=functions.read<|channel|>commentary json<|message|>{"path": "a"}',
    "Plain text, no harmony at all <|end|> left as is.",
    "<|channel|>analysis<|message|>cut inside the reasoning",
    "<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>fin",
    "<|channel|>final<|message|>a < b and a <| c",
]


def split(chunks: list[str]) -> tuple[list[Piece], str, str]:
    splitter = HarmonySplitter()
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += splitter.feed(chunk)
    pieces += splitter.finish()
    assert "".join(splitter.reasoning) == "".join(
        p.text for p in pieces if isinstance(p, ReasoningPiece)
    )
    return pieces, "".join(splitter.reasoning), "".join(splitter.answer)


def whole(text: str) -> tuple[str, str]:
    _, reasoning, answer = split([text])
    return reasoning, answer


def test_analysis_is_reasoning_and_a_call_is_handed_on_in_one_form() -> None:
    """Analysis is reasoning; a tool call becomes the canonical markup the ``harmony``
    tool-call format parses into the call."""
    reasoning, answer = whole(ANALYSIS + CALL)
    assert reasoning == "I should list files."
    assert answer == call_markup("functions.bash", '{"command": "ls"}')
    parsed = get_parser("harmony").parse(answer)
    assert parsed.tool_calls == [ParsedToolCall("bash", '{"command": "ls"}')]
    assert parsed.content == ""


def test_final_channel_is_the_answer() -> None:
    assert whole(ANALYSIS + FINAL) == ("I should list files.", "Done: 2 files.")


def test_preamble_is_content_beside_the_call() -> None:
    """A commentary message without a recipient is text the user may see."""
    reasoning, answer = whole(ANALYSIS + PREAMBLE + CALL)
    parsed = get_parser("harmony").parse(answer)
    assert (reasoning, parsed.content) == ("I should list files.", "Listing now.")
    assert [c.name for c in parsed.tool_calls] == ["bash"]


def test_recipient_written_in_the_role_is_a_call() -> None:
    _, answer = whole(' to=functions.read<|channel|>commentary json<|message|>{"path": "a"}')
    assert get_parser("harmony").parse(answer).tool_calls == [
        ParsedToolCall("read", '{"path": "a"}')
    ]


def test_text_without_a_header_is_all_answer() -> None:
    text = "Plain text, no harmony at all <|end|> left as is."
    assert whole(text) == ("", text)


def test_a_reply_cut_inside_the_analysis_is_reasoning_only() -> None:
    assert whole("<|channel|>analysis<|message|>cut inside") == ("cut inside", "")


def test_a_lone_angle_bracket_in_the_answer_is_released() -> None:
    """``<`` and ``<|`` that turn out to begin no special token are answer text."""
    splitter = HarmonySplitter()
    assert splitter.feed("<|channel|>final<|message|>a <") == [AnswerPiece("a ")]
    assert splitter.feed("| c") == [AnswerPiece("<| c")]


@pytest.mark.parametrize("text", SAMPLES, ids=range(len(SAMPLES)))
def test_streaming_gives_the_whole_result_at_any_chunking(text: str) -> None:
    """Split at every position, one character at a time, and at random: the same
    reasoning and answer as the whole text."""
    expected = whole(text)
    for i in range(len(text) + 1):
        assert split([text[:i], text[i:]])[1:] == expected
    assert split(list(text))[1:] == expected
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
        bounds = [0, *cuts, len(text)]
        assert split([text[a:b] for a, b in itertools.pairwise(bounds)])[1:] == expected
