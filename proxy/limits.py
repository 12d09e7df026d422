"""Limits that keep one caller from exhausting the proxy: messages per request, tokens
stored per session, sessions in total (the body size is bounded by aiohttp's
``client_max_size``). A request over a limit is refused before anything is recorded, so
the session is unchanged. Pure checks; 0 means no limit of that kind."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.exceptions import BadRequestError, TooManyRequestsError


@dataclass(slots=True, frozen=True)
class Limits:
    max_messages: int = 0  # messages in one agent request
    max_session_tokens: int = 0  # tokens a session stores (context + sampled, all branches)
    max_sessions: int = 0  # sessions registered and not deleted


def check_message_count(limits: Limits, count: int) -> None:
    if limits.max_messages and count > limits.max_messages:
        raise BadRequestError(
            f"the request has {count} messages; this proxy accepts at most "
            f"{limits.max_messages} per request",
            code="too_many_messages",
        )


def session_token_room(limits: Limits, stored: int, adding: int) -> int | None:
    """How many tokens the next turn may sample when the session already stores
    ``stored`` tokens and the turn adds ``adding`` context tokens; None: no limit.

    Raises when not even one token fits: the session has used its budget."""
    if not limits.max_session_tokens:
        return None
    room = limits.max_session_tokens - stored - adding
    if room < 1:
        raise BadRequestError(
            f"the session stores {stored} tokens and this request adds {adding}; "
            f"a session may store at most {limits.max_session_tokens}",
            code="session_token_limit",
        )
    return room


def check_session_count(limits: Limits, open_sessions: int, retry_after: int) -> None:
    if limits.max_sessions and open_sessions >= limits.max_sessions:
        raise TooManyRequestsError(
            f"the proxy holds {open_sessions} sessions, its limit; delete finished ones",
            retry_after=retry_after,
            code="too_many_sessions",
        )
