"""Telling a client's retry from a new request, and what answers it."""

from __future__ import annotations

from array import array

import pytest

from proxy.sessions.model import TurnMeta, TurnNode
from proxy.sessions.retries import RetryAction, RetryDecision, RetryMarks, decide


def _turn(*, delivered: bool, truncated: bool = False, client_id: str = "") -> TurnNode:
    return TurnNode(
        index=4,
        parent=None,
        context_ids=array("i", [1]),
        completion_ids=array("i", [2]),
        logprobs=array("f", [-0.5]),
        prompt_len=1,
        key=b"k" * 16,
        meta=TurnMeta(
            api="openai.chat",
            model="m",
            requested_model="m",
            worker_id="w",
            finish_reason="abort" if truncated else "stop",
            sampling={},
            created_at=0.0,
            queue_seconds=0.0,
            engine_seconds=0.0,
            branch_reason="new_session",
            truncated=truncated,
            delivered=delivered,
            client_request_id=client_id,
        ),
    )


def test_marks_are_read_from_the_body_and_the_client_headers() -> None:
    """The same raw body hashes the same per API; the retry count and the client's request
    id come from their headers (a count that is not a number is 0)."""
    a = RetryMarks.of("openai.chat", b'{"x": 1}', {"x-stainless-retry-count": "2"})
    b = RetryMarks.of("openai.chat", b'{"x": 1}', {"idempotency-key": "k"})
    assert a.request_hash == b.request_hash
    assert RetryMarks.of("openai.responses", b'{"x": 1}', {}).request_hash != a.request_hash
    assert RetryMarks.of("openai.chat", b'{"x":1}', {}).request_hash != a.request_hash
    assert (a.retry_count, a.client_request_id) == (2, "")
    assert (b.retry_count, b.client_request_id) == (0, "k")
    assert RetryMarks.of("openai.chat", b"", {"x-stainless-retry-count": "one"}).retry_count == 0
    codex = RetryMarks.of("openai.responses", b"", {"x-client-request-id": "r1"})
    assert codex.client_request_id == "r1"


REPLAY = RetryDecision(RetryAction.REPLAY, 4)
ANEW = RetryDecision(RetryAction.SAMPLE, 4)
NEW = RetryDecision(RetryAction.SAMPLE, None)
JOIN = RetryDecision(RetryAction.JOIN)


@pytest.mark.parametrize(
    ("count", "client_id", "earlier", "expected"),
    [
        # A delivered reply: only a marker makes the same body a retry.
        (1, "", _turn(delivered=True), REPLAY),
        (0, "r1", _turn(delivered=True, client_id="r1"), REPLAY),
        (0, "r2", _turn(delivered=True, client_id="r1"), NEW),
        (0, "", _turn(delivered=True), NEW),
        # A reply that never reached the client: the same body is its retry.
        (0, "", _turn(delivered=False), REPLAY),
        # A cut attempt is sampled anew, as the retry of it.
        (0, "", _turn(delivered=False, truncated=True), ANEW),
        (3, "", _turn(delivered=False, truncated=True), ANEW),
        # Nothing recorded for this body: a new sample, whatever the markers.
        (2, "r1", None, NEW),
    ],
)
def test_what_answers_a_request_after_a_recorded_attempt(
    count: int, client_id: str, earlier: TurnNode | None, expected: RetryDecision
) -> None:
    """Replay a whole reply the request retries, sample anew after a cut one, and treat an
    unmarked identical request after a delivered reply as a new sample."""
    marks = RetryMarks("h", count, client_id)
    assert decide(marks, live_request_id=None, earlier=earlier) == expected


def test_an_attempt_in_flight_is_joined_only_by_a_marked_retry() -> None:
    """A marked retry waits for the attempt in flight; an identical unmarked request runs
    beside it (parallel samples)."""
    earlier = _turn(delivered=True)
    assert decide(RetryMarks("h", 1), live_request_id="", earlier=earlier) == JOIN
    assert decide(RetryMarks("h", 0, "r1"), live_request_id="r1", earlier=None) == JOIN
    assert decide(RetryMarks("h", 0, "r2"), live_request_id="r1", earlier=None) == NEW
    assert decide(RetryMarks("h", 0), live_request_id="", earlier=None) == NEW
