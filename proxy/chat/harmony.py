"""gpt-oss replies (the harmony format) split into reasoning, answer and tool calls, as text
streams in.

A harmony reply is a run of messages, each a header, ``<|message|>``, a body and an end
token. The generation prompt already wrote the first ``<|start|>assistant``, so the
reply opens with the first header; the stop token (``<|return|>`` after a final answer,
``<|call|>`` after a tool call) is not part of the text seen here::

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS
    <|start|>assistant<|channel|>final<|message|>ANSWER

Routing by header:

* channel ``analysis``: reasoning;
* a recipient (``to=functions.NAME``, before or after the channel): a tool call. It is
  passed on whole, once its body has ended, in one canonical form that the ``harmony``
  tool-call format parses: ``<|start|>assistant to=functions.NAME<|channel|>commentary
  json<|message|>ARGS<|call|>``;
* channel ``final``, or ``commentary`` without a recipient (a preamble the user may see):
  answer text, streamed as it comes.

A reply that does not open with a header (the model ignored the format) is all answer.
Text that may still become a special token is held back until it is known not to be one.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Final

from proxy.chat.reasoning import AnswerPiece, Piece, PieceCollector, ReasoningPiece
from proxy.chat.stops import held_back

MESSAGE: Final = "<|message|>"
START: Final = "<|start|>"
CHANNEL: Final = "<|channel|>"
ENDS: Final = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT: Final = re.compile(r"\bto=([^\s<]+)")
_CHANNEL: Final = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class _State(Enum):
    START = "start"  # nothing seen yet: a header, or plain text
    HEADER = "header"  # reading a header, up to <|message|>
    BODY = "body"
    PLAIN = "plain"  # not harmony: everything is answer


class _Route(Enum):
    REASONING = "reasoning"
    ANSWER = "answer"
    CALL = "call"


def call_markup(recipient: str, arguments: str) -> str:
    """The canonical text of one tool call, as the ``harmony`` tool-call format reads it."""
    return f"{START}assistant to={recipient}{CHANNEL}commentary json{MESSAGE}{arguments}<|call|>"


class HarmonySplitter(PieceCollector):
    """One harmony reply's text in, reasoning and answer pieces out (the same interface as
    :class:`proxy.chat.reasoning.ReasoningSplitter`)."""

    __slots__ = ("_body", "_buffer", "_recipient", "_route", "_state")

    def __init__(self) -> None:
        super().__init__()
        self._state = _State.START
        self._buffer = ""
        self._route = _Route.ANSWER
        self._recipient = ""
        self._body: list[str] = []  # a tool call's arguments so far

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        pieces = self._drain(final=True)
        if self._state is _State.BODY:
            self._end_message(pieces)
        elif self._state is _State.HEADER and self._buffer.strip():
            # Cut inside a header: nothing of it is an answer; keep it where it is seen.
            self._emit(pieces, ReasoningPiece(self._buffer))
        self._buffer = ""
        return pieces

    def _drain(self, *, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self._buffer:
            buffer = self._buffer
            if self._state is _State.START:
                head = buffer.lstrip()
                if head.startswith((CHANNEL, START, " to=", "to=")):
                    self._state = _State.HEADER
                    continue
                if not final and any(m.startswith(head) for m in (CHANNEL, START, "to=")):
                    break  # may still become a header
                self._state = _State.PLAIN
                continue
            if self._state is _State.PLAIN:
                self._emit(pieces, AnswerPiece(buffer))
                self._buffer = ""
                break
            if self._state is _State.HEADER:
                at = buffer.find(MESSAGE)
                if at < 0:
                    break  # the header is not complete yet
                self._open_message(buffer[:at])
                self._buffer = buffer[at + len(MESSAGE) :]
                self._state = _State.BODY
                continue
            # BODY: up to an end token, or a <|start|> written without one.
            end, size = _first_end(buffer)
            if end >= 0:
                self._body_text(pieces, buffer[:end])
                self._end_message(pieces)
                self._buffer = buffer[end + size :]
                self._state = _State.HEADER
                continue
            keep = 0 if final else held_back(buffer, *ENDS, START)
            self._body_text(pieces, buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep :]
            break
        return pieces

    def _open_message(self, header: str) -> None:
        header = header.removeprefix(START).strip()
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self._body = []
        if recipient is not None and recipient.group(1) != "assistant":
            self._route, self._recipient = _Route.CALL, recipient.group(1)
        elif channel is not None and channel.group(1) == "analysis":
            self._route = _Route.REASONING
        else:  # final, or a commentary preamble
            self._route = _Route.ANSWER

    def _body_text(self, pieces: list[Piece], text: str) -> None:
        if self._route is _Route.REASONING:
            self._emit(pieces, ReasoningPiece(text))
        elif self._route is _Route.ANSWER:
            self._emit(pieces, AnswerPiece(text))
        else:
            self._body.append(text)

    def _end_message(self, pieces: list[Piece]) -> None:
        if self._route is _Route.CALL:
            self._emit(pieces, AnswerPiece(call_markup(self._recipient, "".join(self._body))))
        self._route, self._body = _Route.ANSWER, []


def _first_end(text: str) -> tuple[int, int]:
    """Where the first end token (or a bare ``<|start|>``) is, and its length."""
    found = [(text.find(t), len(t)) for t in (*ENDS, START)]
    hits = [(at, size) for at, size in found if at >= 0]
    return min(hits) if hits else (-1, 0)
