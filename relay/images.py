"""Which images a worker holds, and what to send it and drop before the next request.

An agent's history repeats its screenshots in every turn, so an image's bytes cross the
relay once per worker connection, not once per turn: the proxy keeps a ledger per
connection of the images the worker holds, sends the ones a request needs that it lacks
(``protocol.Image``), and, past a byte budget, tells it to forget the least recently used
(``protocol.ImageDrop``), never one the request at hand uses. A request already running on
the worker keeps its images whatever is dropped afterwards: the worker hands the bytes to
its engine when the request starts.

``ImageLedger.plan`` decides; the pool sends. The ledger of a connection that ends is
discarded with it: a worker that comes back holds nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# What a worker holds for one proxy, by default (a 1280x800 PNG screenshot is ~100 kB to
# a few MB): enough for every image of many concurrent trials.
DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024


@dataclass(slots=True, frozen=True)
class PromptImage:
    """An image of a request's prompt: its bytes as the agent sent them, their sha256, and
    the half-open range of its placeholder tokens in the (expanded) prompt ids."""

    sha256: str
    data: bytes
    start: int
    end: int

    def __repr__(self) -> str:
        return f"<PromptImage {self.sha256[:12]} [{self.start}, {self.end}) {len(self.data)} B>"


@dataclass(slots=True, frozen=True)
class ImagePlan:
    """What to send before a request: images to drop first, then images to send."""

    drop: list[str]
    send: list[str]


class ImageLedger:
    """The images one worker holds (by sha256, with their sizes), least recently used first."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._held: OrderedDict[str, int] = OrderedDict()
        self.held_bytes = 0

    def __repr__(self) -> str:
        return f"<ImageLedger {len(self._held)} images {self.held_bytes} B>"

    def __contains__(self, sha256: object) -> bool:
        return sha256 in self._held

    def plan(self, needed: Sequence[str], sizes: Mapping[str, int]) -> ImagePlan:
        """Record that the worker gets ``needed`` (in the request's order) and return what
        that takes. The request's own images are never dropped, even when they alone pass
        the budget."""
        wanted = set(needed)
        send = [sha for sha in dict.fromkeys(needed) if sha not in self._held]
        for sha in needed:
            if sha in self._held:
                self._held.move_to_end(sha)
        incoming = sum(sizes[sha] for sha in send)
        drop: list[str] = []
        for sha, size in list(self._held.items()):
            if self.held_bytes + incoming <= self.budget_bytes:
                break
            if sha in wanted:
                continue
            del self._held[sha]
            self.held_bytes -= size
            drop.append(sha)
        for sha in send:
            self._held[sha] = sizes[sha]
            self.held_bytes += sizes[sha]
        return ImagePlan(drop, send)

    def forget(self, sha256s: Sequence[str]) -> None:
        """The worker no longer holds these images (it said it lacks one of them)."""
        for sha in sha256s:
            size = self._held.pop(sha, None)
            if size is not None:
                self.held_bytes -= size
