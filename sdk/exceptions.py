"""Errors raised by the SDK.

::

    SdkError
    ├── ProxyRequestError      the proxy answered with an error (status, type, code)
    │   ├── ProxyAuthError         401/403: missing or wrong admin token
    │   └── SessionNotFoundError   404 for a trial
    ├── ProxyConnectionError   no answer from the proxy: refused, reset, timed out
    ├── TaskServerError        a task server refused or lost a run
    │   ├── TaskServerTimeoutError  a run did not finish in time
    │   └── TaskDefinitionError     not a valid Harbor task (or an unsafe archive)
    ├── RemoteAgentLoopError   every attempt at a task failed (``attempts`` says how)
    └── RoutingReplayError     recorded routing that does not fit the model it is replayed on
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SdkError(Exception):
    """Base class of every error raised by ``sdk``."""


class ProxyRequestError(SdkError):
    """``should_retry``: the proxy's ``x-should-retry`` (None: it did not say);
    ``retry_after``: its ``Retry-After`` in seconds; ``details``: the error object's other
    fields (``workers`` for a weight update that failed on some)."""

    def __init__(
        self,
        status: int,
        error_type: str,
        code: str | None,
        message: str,
        *,
        should_retry: bool | None = None,
        retry_after: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {error_type}: {message}")
        self.status = status
        self.error_type = error_type
        self.code = code
        self.message = message
        self.should_retry = should_retry
        self.retry_after = retry_after
        self.details = details or {}


class ProxyConnectionError(SdkError):
    """The proxy gave no answer: the connection was refused or dropped, or the request
    timed out. ``refused``: no connection was made at all (nothing reached the proxy)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class SessionNotFoundError(ProxyRequestError):
    pass


class ProxyAuthError(ProxyRequestError):
    """The proxy refused the credential (401) or its kind (403)."""


class TaskServerError(SdkError):
    """A task server refused a run, answered with an error, or could not be reached."""


class TaskServerTimeoutError(TaskServerError):
    """A run did not finish within the time asked for."""


class RemoteAgentLoopError(SdkError):
    """Every attempt at a task failed; ``attempts`` are ``sdk.agent_loop.Attempt`` records."""

    def __init__(self, message: str, attempts: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.attempts = list(attempts)


class TaskDefinitionError(TaskServerError):
    """A task is not a valid Harbor-format task (missing task.toml, instruction.md or
    tests/test.sh, unreadable TOML, an unsafe or oversized archive)."""


class RoutingReplayError(SdkError):
    """Recorded expert routing cannot be replayed on this model: it has no routers, or the
    rows' layers, experts per token, expert ids or positions do not fit it."""


class ImageSpanError(SdkError, ValueError):
    """A sample's image placeholders do not fit its images under this model's processor
    (a span of another length than the processor gives, an image token no image claims,
    bytes missing or not the ones hashed)."""


class VisionRolloutError(SdkError, ValueError):
    """An episode with images handed to a trainer path that cannot take its pixels."""
