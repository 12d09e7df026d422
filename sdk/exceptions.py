"""Errors raised by the SDK.

::

    SdkError
    ├── ProxyRequestError      the proxy answered with an error (status, type, code)
    │   └── SessionNotFoundError   404 for a trial
    └── TaskServerError        a task server refused or lost a run
        └── TaskServerTimeoutError  a run did not finish in time
"""

from __future__ import annotations


class SdkError(Exception):
    """Base class of every error raised by ``sdk``."""


class ProxyRequestError(SdkError):
    def __init__(self, status: int, error_type: str, code: str | None, message: str) -> None:
        super().__init__(f"{status} {error_type}: {message}")
        self.status = status
        self.error_type = error_type
        self.code = code
        self.message = message


class SessionNotFoundError(ProxyRequestError):
    pass


class TaskServerError(SdkError):
    """A task server refused a run, answered with an error, or could not be reached."""


class TaskServerTimeoutError(TaskServerError):
    """A run did not finish within the time asked for."""
