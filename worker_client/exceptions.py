"""Errors raised by the worker side.

::

    WorkerError
    ├── EngineError                 an engine failed to serve a request
    │   ├── PromptTooLongError      prompt + max_tokens exceed the context window
    │   └── EngineUnavailableError  the backend cannot start (missing GPU, package, model)
    ├── WeightsError                a weight update cannot be done (the checkpoint does not
    │   │                               load, the backend cannot load, a commit failed)
    │   └── WeightsBusyError        another update (another proxy replica's) holds the worker
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


class WeightsBusyError(WeightsError):
    """Another weight update is in progress on this worker (driven through another proxy
    replica, or the Ray group): the same update may succeed once that one is done."""


class ConnectionRefusedByProxy(WorkerError):
    """The proxy refused this worker (bad token, incompatible protocol version)."""
