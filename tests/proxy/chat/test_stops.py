"""Stop strings over streamed text."""

from __future__ import annotations

import random

import pytest

from proxy.chat.stops import StopMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    return out, m.hit


@pytest.mark.parametrize(
    ("text", "stops", "expected", "hit"),
    [
        ("hello END world", ["END"], "hello ", "END"),
        ("no stop here", ["END"], "no stop here", None),
        ("ab<stop>cd", ["<st", "<stop>"], "ab", "<st"),
        ("a ENx", ["END"], "a ENx", None),
        ("xxEN", ["END"], "xxEN", None),
        ("first B then A", ["A", "B"], "first ", "B"),
    ],
)
def test_every_chunking_gives_the_same_result(
    text: str, stops: list[str], expected: str, hit: str | None
) -> None:
    """Whatever the chunk boundaries, the shown text stops right before the first stop string."""
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _run(stops, pieces) == (expected, hit)


def test_partial_match_is_held_back_until_decided() -> None:
    """Text that may begin a stop string is not shown until it cannot."""
    m = StopMatcher(["END"])
    assert m.feed("abc E") == "abc "
    assert m.feed("N") == ""
    assert m.feed("X") == "ENX"


def test_nothing_after_a_hit() -> None:
    """Once a stop string matched, later text is never shown."""
    m = StopMatcher(["."])
    assert m.feed("one. two") == "one"
    assert m.feed("three") == ""
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    """An empty stop string never matches."""
    assert _run(["", "Z"], ["abc"]) == ("abc", None)
