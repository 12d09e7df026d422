"""Stop sequences over streamed text.

Engines stop on token ids; agents ask for stop *strings*, which may span tokens. The
matcher sees the reply's text as it streams, releases only text that cannot be the start
of a stop string, and reports the first stop string found. The reply ends before it; the
tokens sampled up to that point are recorded verbatim.
"""

from __future__ import annotations

from collections.abc import Sequence


def held_back(text: str, *marks: str) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``marks``
    (text a streaming reader must hold until the next piece says what it is)."""
    longest = 0
    for mark in marks:
        for size in range(min(len(mark) - 1, len(text)), longest, -1):
            if mark.startswith(text[-size:]):
                longest = size
                break
    return longest


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> str:
        """Add text; return what may be shown. After a hit, returns only the text before
        the stop string, and nothing ever after."""
        if self.hit is not None:
            return ""
        buffer = self._held + text
        first: tuple[int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.hit = first[1]
            self._held = ""
            return buffer[: first[0]]
        keep = held_back(buffer, *self.stops)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """End of generation: release the held text (it did not become a stop string)."""
        held, self._held = self._held, ""
        return "" if self.hit is not None else held
