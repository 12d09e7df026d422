"""Where a continuation's new text starts: pure functions over rendered template text.

A continuation's prompt is *the parent's context ids + the sampled ids + the text the
template writes after them*. That text is found by rendering a short probe conversation
twice, both times ending in an *anchor*: the assistant message the parent returned, with
its tool calls but with its content replaced by a sentinel:

* ``alone``: ``[probe user, anchor]``, no generation prompt (the anchor is the last
  message);
* ``followed``: ``[probe user, anchor, *new messages]`` with the generation prompt.

(Templates that drop the content of a message with tool calls, as Llama 3's does, get
the sentinel as the value of the last call's arguments instead.) Everything after the
sentinel is the template's rendering of what follows the anchor's
content. In ``alone`` that is the anchor's *close* (its tool-call markup and end of turn);
in ``followed`` it is the close as history writes it, then the new messages, then the
generation prompt. Anchoring on the content, not on the start of the probe, is what makes
this hold on real templates: they rewrite what comes *before* an earlier assistant
message's content (Qwen3 and GLM drop or empty its reasoning once a new user query
follows, DeepSeek and Qwen3 give the last message a think block), never what comes after.

Two closes are accepted: the same text in both renderings, or one end-of-turn token
swapped for another (gpt-oss ends the last message with ``<|return|>`` and writes
``<|end|>`` in history). Anything else means the template rewrote the anchor's own close:
the caller then renders the request in full as a new branch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

# Letters and digits only: templates escape, trim or JSON-encode what they render, and
# this must come through all of that unchanged.
SENTINEL = "rolloutrelayanchor7f3a9c"


class NotPrefixStableError(Exception):
    """The template rewrote the anchor's close when new messages were appended."""


@dataclass(slots=True, frozen=True)
class Split:
    close: str  # the anchor's close as history writes it
    rest: str  # the new messages and the generation prompt
    swapped: bool = False  # history ends the anchor with another end-of-turn token


def split_after_anchor(alone: str, followed: str, specials: Collection[str]) -> Split:
    """The close and the new text in ``followed``, checked against ``alone``."""
    if alone.count(SENTINEL) != 1 or followed.count(SENTINEL) != 1:
        raise NotPrefixStableError("the template does not render assistant content verbatim")
    close = alone[alone.index(SENTINEL) + len(SENTINEL) :]
    after = followed[followed.index(SENTINEL) + len(SENTINEL) :]
    if after.startswith(close):
        return Split(close, after[len(close) :])
    for end in specials:
        if not close.endswith(end):
            continue
        stem = close[: len(close) - len(end)]
        if not after.startswith(stem):
            continue
        tail = after[len(stem) :]
        for history_end in specials:
            if tail.startswith(history_end):
                return Split(stem + history_end, tail[len(history_end) :], swapped=True)
    raise NotPrefixStableError("the template rewrote the close of an earlier assistant turn")


def text_after_completion(split: Split, final_token: str | None) -> str:
    """The context text between a sampled completion and the next generation.

    ``final_token`` is the text of the stop token the completion ended on (None when it
    was cut short). The model wrote its own content and tool-call markup; what the template
    adds after them is:

    * the part of the close after the end-of-turn token the model sampled (``\\n`` after
      ChatML's ``<|im_end|>``), then the new messages;
    * only the new messages when history writes another end token in its place (gpt-oss:
      the model's ``<|return|>`` stands where history has ``<|end|>``);
    * the new messages minus their opening token when the stop token *is* that opening
      (GLM stops on ``<|observation|>`` and ``<|user|>``, which begin the next message):
      it is already in the context, sampled.

    A completion cut short gets the whole close: the turn must be ended before the next
    message, as the template would end it."""
    if final_token is None:
        return split.close + split.rest
    at = split.close.rfind(final_token)
    if at >= 0:
        return split.close[at + len(final_token) :] + split.rest
    if split.swapped:
        return split.rest
    rest = split.rest.lstrip()
    if rest.startswith(final_token):
        return rest[len(final_token) :]
    # A stop token the template never writes here (Qwen's <|endoftext|> where the turn
    # ends with <|im_end|>): the turn is closed as the template closes it.
    return split.close + split.rest
