"""Errors raised by the relay (wire protocol and worker pool).

::

    RelayError
    ├── ProtocolError              the peer broke the wire protocol
    │   ├── FrameError             a frame could not be decoded
    │   ├── VersionMismatchError   the peer speaks another protocol version
    │   └── IllegalTransitionError a message is not allowed in the current state
    ├── NoWorkerAvailableError     no worker serving the model became free in time
    ├── PoolOverloadedError        the wait queue (overall or the trial's share) is full
    ├── WorkerFailedError          the worker reported an error for a request
    ├── RequestCancelledError      the request was cancelled before it finished
    └── WeightsUpdateError         a weight update did not happen everywhere (``workers``:
        │                              which; ``retryable``: asking again later may succeed)
        ├── UpdateRefusedError     refused before anything changed (version not newer,
        │                              another update running, a worker that cannot update)
        └── UpdateFailedError      a worker could not pause, load or answer (every worker
                                       was rolled back), or could not commit (it was taken
                                       out of service; the others serve the new version)
"""


class RelayError(Exception):
    """Base class of every error raised by ``relay``."""


class ProtocolError(RelayError):
    """The peer broke the wire protocol."""


class FrameError(ProtocolError):
    """A frame could not be decoded into a known message."""


class VersionMismatchError(ProtocolError):
    """The peer speaks an incompatible protocol version."""


class IllegalTransitionError(ProtocolError):
    """The message is not allowed in the connection's current state."""


class NoWorkerAvailableError(RelayError):
    """No worker serving the requested model became available within the wait bound."""

    def __init__(self, model: str, waited: float) -> None:
        super().__init__(f"no worker serving model {model!r} became available within {waited:g}s")
        self.model = model
        self.waited = waited


class PoolOverloadedError(RelayError):
    """The bounded wait queue is full, overall (``scope="pool"``) or for one trial
    (``scope="trial"``); the request was not queued."""

    def __init__(self, scope: str, limit: int) -> None:
        what = "the request queue" if scope == "pool" else "this trial's share of the queue"
        super().__init__(f"{what} is full ({limit} waiting requests)")
        self.scope = scope
        self.limit = limit


class WorkerFailedError(RelayError):
    """The worker reported an error while serving the request."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RequestCancelledError(RelayError):
    """The request was cancelled before it finished."""


class WeightsUpdateError(RelayError):
    """A weight update did not happen on every worker. ``workers``: the workers it failed
    on (empty: it was refused, or no worker answered); ``retryable``: the same update asked
    again later may succeed (another update was running, a worker was busy with another
    proxy replica's update); otherwise asking again gets this same answer."""

    def __init__(
        self, code: str, message: str, *, workers: tuple[str, ...] = (), retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.workers = workers
        self.retryable = retryable


class UpdateRefusedError(WeightsUpdateError):
    """The update was refused before any worker was asked to do anything."""


class UpdateFailedError(WeightsUpdateError):
    """A worker could not pause, load or answer in time (the update was rolled back), or
    could not commit (``commit_failed``: it is out of service)."""
