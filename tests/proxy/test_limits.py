"""Request and session limits."""

from __future__ import annotations

import pytest

from proxy.exceptions import BadRequestError, TooManyRequestsError
from proxy.limits import (
    Limits,
    check_message_count,
    check_session_count,
    session_token_room,
)


def test_message_count() -> None:
    """Up to the limit passes; one more is a 400 naming the limit; 0 means none."""
    check_message_count(Limits(max_messages=3), 3)
    with pytest.raises(BadRequestError) as exc:
        check_message_count(Limits(max_messages=3), 4)
    assert exc.value.code == "too_many_messages"
    assert "3" in exc.value.message
    check_message_count(Limits(max_messages=0), 10**6)


def test_session_token_room() -> None:
    """The room left caps sampling; a turn that fits not one sampled token is refused."""
    limits = Limits(max_session_tokens=100)
    assert session_token_room(limits, 60, 30) == 10
    assert session_token_room(limits, 0, 99) == 1
    with pytest.raises(BadRequestError) as exc:
        session_token_room(limits, 60, 40)
    assert exc.value.code == "session_token_limit"
    assert session_token_room(Limits(max_session_tokens=0), 10**9, 10**9) is None


def test_session_count() -> None:
    """Registering beyond the limit is a 429 with Retry-After."""
    check_session_count(Limits(max_sessions=2), 1, 5)
    with pytest.raises(TooManyRequestsError) as exc:
        check_session_count(Limits(max_sessions=2), 2, 7)
    assert exc.value.status == 429
    assert exc.value.retry_after == 7
    assert exc.value.code == "too_many_sessions"
    check_session_count(Limits(max_sessions=0), 10**6, 5)
