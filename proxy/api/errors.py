"""Turning exceptions into wire errors: the one place that does it for the OpenAI-style
APIs and the session API. Messages are sanitised: no traceback, no token."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from aiohttp import web
from pydantic import BaseModel, ValidationError

from proxy.exceptions import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    ProxyError,
    ServiceUnavailableError,
)

log = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The code of the error a request was answered with, for metrics and the access log.
ERROR_CODE = web.RequestKey("error_code", str)


def json_response(payload: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json"
    )


def error_body(exc: ProxyError) -> dict[str, object]:
    error: dict[str, object] = {"message": exc.message, "type": exc.error_type, "code": exc.code}
    if exc.details:
        error.update({k: v for k, v in exc.details.items() if k not in error})
    return {"error": error}


def openai_error(exc: ProxyError) -> web.Response:
    response = json_response(error_body(exc), status=exc.status)
    if isinstance(exc, ServiceUnavailableError):
        response.headers["Retry-After"] = str(exc.retry_after)
    if exc.should_retry is not None:
        # The header the OpenAI and Anthropic SDKs obey before their own status rules.
        response.headers["x-should-retry"] = "true" if exc.should_retry else "false"
    if isinstance(exc, AuthenticationError):
        # RFC 9110 §11.6.1: a 401 names the authentication scheme to use.
        response.headers["WWW-Authenticate"] = 'Bearer realm="rollout-relay"'
    return response


def validation_message(exc: ValidationError, at: tuple[str | int, ...] = ()) -> str:
    """The first error, where it is (``at``: where the validated part sits in the body)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in (*at, *first["loc"])) or "body"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"invalid request: {where}: {first['msg']}{more}"


def parse_json(model: type[ModelT], body: bytes) -> ModelT:
    """Validate a JSON body; malformed JSON and wrong shapes become 400s."""
    if not body:
        raise BadRequestError("the request body is empty; expected JSON", code="invalid_json")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise BadRequestError(
                "the request body is not valid JSON", code="invalid_json"
            ) from None
        raise BadRequestError(validation_message(exc), code="invalid_request") from None


def from_http_exception(exc: web.HTTPException) -> ProxyError:
    if exc.status == 413:
        return PayloadTooLargeError("request body is too large", code="body_too_large")
    if exc.status == 404:
        return NotFoundError("no such route", code="route_not_found")
    if exc.status == 405:
        error: ProxyError = BadRequestError("method not allowed", code="method_not_allowed")
        error.status = 405
        return error
    error = ProxyError(exc.reason or "http error", code="http_error")
    error.status = exc.status
    return error


ErrorRenderer = Callable[[ProxyError], web.Response]

# Path suffix → renderer, for APIs whose clients expect their own error shape (Anthropic).
# Everything else answers in the OpenAI shape.
_ERROR_FORMATS: list[tuple[str, ErrorRenderer]] = []


def register_error_format(path_suffix: str, render: ErrorRenderer) -> None:
    _ERROR_FORMATS.append((path_suffix, render))


def _renderer_for(path: str) -> ErrorRenderer:
    for suffix, render in _ERROR_FORMATS:
        if path.endswith(suffix):
            return render
    return openai_error


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where exceptions become wire errors."""
    render_as = _renderer_for(request.path)

    def render(exc: ProxyError) -> web.Response:
        request[ERROR_CODE] = exc.code or exc.error_type
        return render_as(exc)

    try:
        return await handler(request)
    except ProxyError as exc:
        return render(exc)
    except ValidationError as exc:
        return render(BadRequestError(validation_message(exc), code="invalid_request"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return render(from_http_exception(exc))
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return render(ProxyError("internal error"))
