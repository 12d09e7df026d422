"""The session registry's listings: the viewer's newest, and the session API's pages."""

from __future__ import annotations

import pytest

from proxy.exceptions import BadRequestError
from proxy.sessions.registry import SessionRegistry


def test_newest_lists_the_latest_registrations_first() -> None:
    registry = SessionRegistry()
    for i in range(5):
        registry.create(f"t{i}", metadata={}, sampling={}, model=None)
    assert [s.trial_id for s in registry.newest(3)] == ["t4", "t3", "t2"]
    assert [s.trial_id for s in registry.newest(10)] == ["t4", "t3", "t2", "t1", "t0"]
    registry.discard(registry.get("t3").trial_id)
    assert [s.trial_id for s in registry.newest(2)] == ["t4", "t2"]


def test_a_page_starts_after_a_cursor_or_after_a_place_another_replica_gave() -> None:
    """Paged in creation order; a cursor of this registry, or the (created_at, id) of a
    session another replica holds, which falls between this one's."""
    registry = SessionRegistry()
    for i in range(4):
        registry.create(f"t{i}", metadata={}, sampling={}, model=None)
    page, cursor = registry.page(limit=2)
    assert ([s.trial_id for s in page], cursor) == (["t0", "t1"], "t1")
    page, cursor = registry.page(limit=2, after=cursor)
    assert ([s.trial_id for s in page], cursor) == (["t2", "t3"], None)
    elsewhere = (registry.position("t1")[0], "t1~")  # created with t1, sorted after it
    page, _ = registry.page(limit=5, position=elsewhere)
    assert [s.trial_id for s in page] == ["t2", "t3"]
    with pytest.raises(BadRequestError, match="unknown cursor"):
        registry.page(limit=2, after="nobody")
