"""Errors raised by the worker side.

::

    WorkerError
    ├── EngineError                 an engine failed to serve a request
    │   ├── PromptTooLongError      prompt + max_tokens exceed the context window
    │   └── EngineUnavailableError  the backend cannot start (missing GPU, package, model)
    ├── WeightsError                a weight update cannot be done (the checkpoint does not
    │                                   load, the backend cannot load, another update runs)
    └── ConnectionRefusedByProxy    the proxy rejected the hello (auth, protocol version)
"""


class WorkerError(Exception):
    """Base class of every error raised by ``worker_client``."""


class EngineError(WorkerError):
    """An engine failed to serve a request."""


class PromptTooLongError(EngineError):
    """The prompt does not fit the model's context window."""


class EngineUnavailableError(EngineError):
    """The backend cannot be started here."""


class WeightsError(WorkerError):
    """A weight update cannot be done; the weights served before stay served."""


class ConnectionRefusedByProxy(WorkerError):
    """The proxy refused this worker (bad token, incompatible protocol version)."""
