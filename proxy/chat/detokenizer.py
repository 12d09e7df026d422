"""Incremental detokenization for streaming.

Byte-level tokenizers split multi-byte characters across tokens, and decoding a token
alone can differ from decoding it in context. Text is therefore emitted only once a
window of recent tokens decodes to complete characters, and only the text that the new
tokens added to it. With a fast tokenizer that is the tokenizers library's own
``DecodeStream`` (the window kept in Rust, one call per engine step, no slices of the
reply per token); otherwise the window is decoded here, twice per step. A trailing stop
token is held back: when the generation ends on it, its text is never shown (the agent
receives the reply without it, as in the non-streamed case). The concatenation of all
emitted text equals ``ChatRenderer.completion_text``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        # The fast tokenizer's backend decodes the same text when the wrapper has no
        # clean-up to apply, without the wrapper's per-call cost (once per sampled token).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend: Any = backend if backend is not None and not cleans else None
        self._stream = DecodeStream(skip_special_tokens=False) if self._backend else None
        self._stop = frozenset(stop_token_ids)
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoding starts here for context
        self._read = 0  # tokens before this were emitted (or, with a stream, fed to it)
        self._shown = 0  # characters emitted
        self._waiting = False  # the stream holds an incomplete character

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            fast: str = self._backend.decode(list(ids), skip_special_tokens=False)
            return fast
        text: str = self._tokenizer.decode(ids, skip_special_tokens=False)
        return text

    def add(self, new_ids: Sequence[int]) -> None:
        """Add sampled ids without decoding them yet (``flush`` returns their text)."""
        self.ids.extend(new_ids)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add sampled ids; return the text that can be shown now."""
        self.ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the generation: the rest, minus a final stop token."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        ids = self.ids
        end = len(ids)
        if end and ids[-1] in self._stop:
            end -= 1  # a trailing stop token is shown only if more tokens follow it
        if end <= self._read:
            text = ""
        elif self._stream is not None and not (final and not self._read):
            new = ids[self._read] if end - self._read == 1 else ids[self._read : end]
            self._read = end
            step = self._stream.step(self._backend, new)
            self._waiting = step is None
            text = step or ""
        else:
            before = self._decode(ids[self._prefix : self._read])
            after = self._decode(ids[self._prefix : end])
            if after.endswith(_REPLACEMENT) and not final:
                return ""  # an incomplete character: wait for the next token
            self._prefix, self._read = self._read, end
            text = after[len(before) :]
        if final and self._waiting:
            # The reply ended inside a character: what the stream still holds, as the
            # whole reply's decoding shows it.
            self._waiting = False
            text = self._decode(ids[:end])[self._shown :]
        self._shown += len(text)
        return text
