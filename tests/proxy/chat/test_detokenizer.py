"""Incremental detokenization: streamed text equals the whole reply's text."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.chat.detokenizer import IncrementalDetokenizer
from proxy.chat.renderer import ChatRenderer


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_directory(tiny_model_dir)


@pytest.mark.parametrize(
    "text",
    [
        "plain words",
        "héllo ✓ 你好 🙂 done",
        '<tool_call>\n{"a": 1}\n</tool_call>',
        "tabs\t\nand  spaces",
    ],
)
def test_one_token_at_a_time_equals_full_decode(renderer: ChatRenderer, text: str) -> None:
    """Pushing ids one by one never splits a character and adds up to the full text."""
    ids = [*renderer.encode(text), renderer.stop_token_ids[0]]
    detok = IncrementalDetokenizer(renderer.tokenizer, renderer.stop_token_ids)
    assert detok._backend is not None  # the fast path, checked against the wrapper's decode
    pieces = [detok.push([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == renderer.completion_text(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_token_in_the_middle_is_shown(renderer: ChatRenderer) -> None:
    """A stop token is hidden only when it is the last token."""
    stop = renderer.stop_token_ids[0]
    ids = [*renderer.encode("a"), stop, *renderer.encode("b")]
    detok = IncrementalDetokenizer(renderer.tokenizer, renderer.stop_token_ids)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == renderer.completion_text(ids)
    assert renderer.tokenizer.decode([stop]) in text


def test_ids_added_without_decoding_flush_to_the_whole_reply(renderer: ChatRenderer) -> None:
    """A reply that is not streamed adds its ids as they come and decodes them once."""
    text = "héllo ✓ 你好 🙂 done"
    ids = [*renderer.encode(text), renderer.stop_token_ids[0]]
    detok = IncrementalDetokenizer(renderer.tokenizer, renderer.stop_token_ids)
    for i in ids:
        detok.add([i])
    assert detok.ids == ids
    assert detok.flush() == renderer.completion_text(ids) == text


def test_a_reply_cut_inside_a_character_ends_as_the_whole_decoding(
    renderer: ChatRenderer,
) -> None:
    """A reply cut between the byte tokens of one character: nothing of the character is
    shown while it streams, and the end gives what decoding the whole reply gives."""
    ids = renderer.encode("ok 🙂")
    for cut in range(1, len(ids)):
        if "\ufffd" not in renderer.completion_text(ids[:cut]):
            continue
        head, tail = ids[:cut], []
        while head and "\ufffd" in renderer.completion_text(head[-1:]):
            tail.insert(0, head.pop())  # the character's leading byte tokens
        detok = IncrementalDetokenizer(renderer.tokenizer, renderer.stop_token_ids)
        shown = "".join(detok.push([i]) for i in head)
        partial = [detok.push([i]) for i in tail]
        assert partial == [""] * len(tail)
        assert shown + detok.flush() == renderer.completion_text(ids[:cut])
        return
    pytest.fail("the tokenizer encodes the emoji as one token: no cut inside it")


@pytest.mark.parametrize("fast", [True, False])
def test_grouped_steps_add_up_to_the_whole_reply(renderer: ChatRenderer, fast: bool) -> None:
    """Steps of several ids, through the tokenizers library's stream and through the
    window decoded here (a tokenizer without a usable fast backend), give the same text."""
    text = "naïve café 🤖🤖 你好, <tool_call> done"
    ids = [*renderer.encode(text), renderer.stop_token_ids[0]]
    detok = IncrementalDetokenizer(renderer.tokenizer, renderer.stop_token_ids)
    if not fast:
        detok._backend = detok._stream = None
    steps = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    pieces = [detok.push(step) for step in steps] + [detok.flush()]
    assert "".join(pieces) == renderer.completion_text(ids) == text
    assert all("\ufffd" not in p for p in pieces)
