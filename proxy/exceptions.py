"""Errors raised by the proxy. Each maps to one HTTP status; the API layer turns them into
the caller's error format (OpenAI or Anthropic) in exactly one place per API.

::

    ProxyError                      500 internal_error
    ├── BadRequestError             400 invalid_request_error
    │   ├── ContextLengthError      400 prompt + completion exceed the context window
    │   ├── TemplateError           400 the chat template rejected the messages
    │   ├── ToolsUnsupportedError   400 the model's template drops tools and no listing
    │   │                               of its family puts them in the prompt
    │   ├── ImageError              400 an image that cannot be taken: not an image, a
    │   │                               format or size past the limits, a URL not allowed
    │   └── TeacherRefusedError     400 a teacher that cannot score the session (nothing
    │       │                           of it changes)
    │       ├── UnknownTeacherError     no teacher of that name is served
    │       ├── UnknownPolicyError      the policy that sampled the session is not known to
    │       │                           this proxy: its vocabulary cannot be compared
    │       ├── TokenizerMismatchError  the teacher's vocabulary is not the policy's
    │       ├── TeacherImagesError      the session has images the teacher cannot take
    │       └── TeacherWindowError      a trajectory is longer than the teacher's window
    ├── AuthenticationError         401 missing or invalid credential
    ├── PermissionDeniedError       403 credential of the wrong kind or for another trial
    ├── NotFoundError               404 unknown trial, model or route
    ├── ConflictError               409 session completed/deleted, trial id taken
    ├── MisdirectedRequestError     421 a forwarded request reached a replica that does not
    │                                   own its trial (the replicas' lists differ)
    ├── PayloadTooLargeError        413 request body over the limit
    ├── UpstreamError               502 the worker failed the request
    ├── GatewayTimeoutError         504 a worker did not answer in time
    ├── ServiceUnavailableError     503 no worker became available, queue full, draining
    │   ├── TooManyRequestsError    429 too many requests waiting for this trial, or too
    │   │                               many sessions (Retry-After)
    │   └── StorageError            503 the session store cannot commit (or, at startup,
    │                                   open) what must be durable
    └── ConfigurationError          startup: unusable settings (TLS files); never on the wire
"""

from __future__ import annotations


class ProxyError(Exception):
    status = 500
    error_type = "internal_error"
    code: str | None = None
    # Whether asking again may succeed, as ``x-should-retry`` (None: not said).
    should_retry: bool | None = None
    # More fields of the error object, for errors that say which parts failed.
    details: dict[str, object] | None = None

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequestError(ProxyError):
    status = 400
    error_type = "invalid_request_error"


class ContextLengthError(BadRequestError):
    code = "context_length_exceeded"


class TemplateError(BadRequestError):
    code = "template_error"


class ToolsUnsupportedError(BadRequestError):
    """A request with tools for a model whose chat template does not render them, of a
    family with no known listing: refused rather than sampled without the tools."""

    code = "tools_unsupported"


class BudgetExhaustedError(BadRequestError):
    """A request of a trial whose turn or token budget is spent: refused (the agent is
    told in its API's format; the trial's outcome is ``budget_exhausted``)."""

    code = "budget_exhausted"


class ImageError(BadRequestError):
    """An image in a request that the proxy will not take; ``code`` says why and the message
    names the image. Nothing of the request is recorded."""

    code = "invalid_image"


class TeacherRefusedError(BadRequestError):
    """A teacher asked to score a session that it cannot score; nothing of the session
    changes."""

    code = "teacher_refused"


class UnknownTeacherError(TeacherRefusedError):
    """No worker serves a teacher of that name (or the model named is not a teacher)."""

    code = "teacher_not_found"


class UnknownPolicyError(TeacherRefusedError):
    """A model that sampled the session has not been served since the proxy started: the
    teacher's vocabulary cannot be compared with it."""

    code = "policy_unknown"


class TokenizerMismatchError(TeacherRefusedError):
    """The teacher's vocabulary differs from the policy's: the same ids would be other
    tokens to it."""

    code = "teacher_tokenizer_mismatch"


class TeacherImagesError(TeacherRefusedError):
    """The session's prompts hold images the teacher cannot take (a text model, or one
    whose image processor gives an image another number of tokens)."""

    code = "teacher_images_unsupported"


class TeacherWindowError(TeacherRefusedError):
    """A trajectory to score is longer than the teacher's context window."""

    code = "teacher_context_too_short"


class AuthenticationError(ProxyError):
    status = 401
    error_type = "authentication_error"


class PermissionDeniedError(ProxyError):
    status = 403
    error_type = "permission_error"


class NotFoundError(ProxyError):
    status = 404
    error_type = "not_found_error"


class ConflictError(ProxyError):
    status = 409
    error_type = "conflict_error"


class PayloadTooLargeError(ProxyError):
    status = 413
    error_type = "request_too_large"


class UpstreamError(ProxyError):
    status = 502
    error_type = "upstream_error"


class GatewayTimeoutError(ProxyError):
    status = 504
    error_type = "timeout_error"


class MisdirectedRequestError(ProxyError):
    status = 421
    error_type = "invalid_request_error"


class ServiceUnavailableError(ProxyError):
    status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 5, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class TooManyRequestsError(ServiceUnavailableError):
    """One trial's share of the wait queue is full; other trials are still served."""

    status = 429
    error_type = "rate_limit_error"


class ConfigurationError(ProxyError):
    """Settings the proxy cannot start with (raised at startup, before serving)."""


class StorageError(ServiceUnavailableError):
    """The session store could not commit a write (nothing is acknowledged without it), or
    could not be opened at startup."""

    code = "storage_unavailable"
