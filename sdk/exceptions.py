"""Errors raised by the SDK.

::

    SdkError
    └── ProxyRequestError      the proxy answered with an error (status, type, code)
        └── SessionNotFoundError   404 for a trial
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
