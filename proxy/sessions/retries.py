"""Recognising a client's retry of an earlier request, and deciding what answers it.

Clients resend a request when they did not get (or did not finish reading) its reply: the
openai and anthropic SDKs on a timeout or a dropped connection (with
``x-stainless-retry-count`` above 0), Codex after a dropped stream (the whole request again,
with the same ``x-client-request-id``), Claude Code's and litellm's own retry loops (with a
retry count of 0). Under RL a reply that no agent acted on must not be trained, and a
retry must not add a second sample of the same step. So a request is a *retry* of an
earlier attempt of the same session when its raw body is the same and

* a client marker says so: a retry count above 0, or the same ``x-client-request-id`` /
  ``Idempotency-Key`` as the earlier attempt; or
* the earlier attempt's reply never reached the client.

An identical body with none of these after a delivered reply is a new sample (best-of-n by
repeated calls, or a compaction that repeats a body). The decision is a pure function of
the request's marks, the attempt still in flight for that body (if any) and the latest
recorded turn for it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

from proxy.sessions.model import TurnNode

__all__ = ["RetryAction", "RetryDecision", "RetryMarks", "decide"]

RETRY_COUNT_HEADER = "x-stainless-retry-count"
# Ids a client keeps across the attempts of one request (Codex; the Stripe-style header).
REQUEST_ID_HEADERS = ("x-client-request-id", "idempotency-key")
_MAX_ID = 200  # longer ids are cut: they only need to compare equal


class RetryAction(enum.Enum):
    SAMPLE = "sample"  # sample a reply (a new sample, or anew after a cut attempt)
    REPLAY = "replay"  # answer with the recorded reply of ``retry_of``, sampling nothing
    JOIN = "join"  # wait for the attempt in flight, then decide again


@dataclass(slots=True, frozen=True)
class RetryMarks:
    """What identifies a request among its session's attempts."""

    # XXH3-128 of the API and the raw body bytes: every request is hashed, so a hash at
    # memory speed (blake2b took ~1 ms for a 250 KB conversation, a turn's whole budget).
    request_hash: str
    retry_count: int = 0  # x-stainless-retry-count (0 when absent or not a number)
    client_request_id: str = ""  # x-client-request-id or Idempotency-Key ("" when absent)

    @classmethod
    def of(cls, api: str, body: bytes, headers: Mapping[str, str]) -> RetryMarks:
        digest = xxhash.xxh3_128(api.encode() + b"\0")
        digest.update(body)
        count_text = headers.get(RETRY_COUNT_HEADER, "").strip()
        count = int(count_text) if count_text.isdecimal() and len(count_text) < 6 else 0
        client_id = ""
        for name in REQUEST_ID_HEADERS:
            value = headers.get(name, "").strip()
            if value:
                client_id = value[:_MAX_ID]
                break
        return cls(digest.hexdigest(), count, client_id)

    def same_request(self, client_request_id: str) -> bool:
        """The client says this is the request an earlier attempt with this id was."""
        return bool(self.client_request_id) and self.client_request_id == client_request_id


@dataclass(slots=True, frozen=True)
class RetryDecision:
    action: RetryAction
    retry_of: int | None = None  # the earlier turn this request retries


_NEW = RetryDecision(RetryAction.SAMPLE)


def decide(
    marks: RetryMarks, *, live_request_id: str | None, earlier: TurnNode | None
) -> RetryDecision:
    """What answers a request: ``live_request_id`` is the client request id of an attempt
    with the same body still in flight (None when there is none), ``earlier`` the latest
    recorded turn of that body."""
    if live_request_id is not None:
        # The attempt in flight has not answered yet: a marked retry waits for it, an
        # unmarked identical request is a parallel sample of its own.
        if marks.retry_count > 0 or marks.same_request(live_request_id):
            return RetryDecision(RetryAction.JOIN)
        return _NEW
    if earlier is None:
        return _NEW
    meta = earlier.meta
    marked = marks.retry_count > 0 or marks.same_request(meta.client_request_id)
    if not (marked or not meta.delivered):
        return _NEW
    if meta.truncated or meta.finish_reason == "abort":
        return RetryDecision(RetryAction.SAMPLE, earlier.index)
    return RetryDecision(RetryAction.REPLAY, earlier.index)
