"""Proxy errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.

Anthropic's SDKs choose their exception class from the HTTP status and read the error
``type`` names below (https://docs.anthropic.com/en/api/errors). The proxy's statuses are
kept; only 409 has no Anthropic name and travels as ``invalid_request_error``.
"""

from __future__ import annotations

from aiohttp import web

from proxy.api.errors import json_response
from proxy.exceptions import AuthenticationError, ProxyError, ServiceUnavailableError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(exc: ProxyError) -> dict[str, object]:
    return {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}


def anthropic_error(exc: ProxyError) -> web.Response:
    response = json_response(error_body(exc), status=exc.status)
    if isinstance(exc, ServiceUnavailableError):
        response.headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, AuthenticationError):
        # RFC 9110 §11.6.1: a 401 names the authentication scheme to use.
        response.headers["WWW-Authenticate"] = 'Bearer realm="rollout-relay"'
    return response
