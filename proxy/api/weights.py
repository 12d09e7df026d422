"""The weights API the trainer uses after an optimizer step (admin token).

``POST /weights`` ``{"version": int, "path": str (optional), "mode": "wait" | "abort"}``:
every connected worker loads the Hugging Face model directory at ``path`` (the trainer
wrote it on storage the workers can read) and serves ``version``; the answer comes once
they all do. Without ``path`` the version is only stamped (the trainer updated the engines
itself, as verl does; ``path`` in the answers stays the checkpoint last loaded). ``GET
/weights``: the version served and each worker's. The relay carries only the control
messages (``relay.weights``); the weights never pass the proxy.

The update belongs to the proxy: a trainer that hangs up does not stop it, and asking for
the same update again (version and path) waits for it or gets the answer of the last one
that finished; asking for exactly the version and checkpoint served already (an update that
committed before a restart, or through another replica) is answered as a success. What an error means for the trainer (``x-should-retry`` says it too):

====  ======================  ==============================================================
503   update_in_progress      another update runs: retry after ``Retry-After``
503   worker_busy             a worker is in another proxy replica's update; rolled back:
                              retry after ``Retry-After``
409   version_not_newer       not retryable; also worker_cannot_update (an old worker)
400   weights_load_failed     the checkpoint cannot be loaded (a bad path); rolled back,
                              not retryable: the same request gets the same answer
504   update_timeout          a worker did not answer a phase in time; rolled back, not
                              retried (the same request gets the same answer)
502   commit_failed           the workers in ``workers`` could not commit and are out of
                              service; the others serve the version (if any did)
====  ======================  ==============================================================
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.errors import json_response, parse_json
from proxy.appkeys import CONFIG, WEIGHTS
from proxy.exceptions import (
    BadRequestError,
    ConflictError,
    GatewayTimeoutError,
    ProxyError,
    ServiceUnavailableError,
    UpstreamError,
)
from relay.exceptions import UpdateFailedError, UpdateRefusedError, WeightsUpdateError
from relay.protocol import PauseMode


class UpdateWeights(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    version: int = Field(ge=0)
    path: str | None = Field(default=None, min_length=1)
    mode: Literal["wait", "abort"] = "wait"


async def get_weights(request: web.Request) -> web.Response:
    return json_response(request.app[WEIGHTS].report())


async def update_weights(request: web.Request) -> web.Response:
    spec = parse_json(UpdateWeights, await request.read())
    try:
        # WeightSync runs the update as its own task and this waits through a shield: a
        # trainer that hangs up cancels only this wait.
        report = await request.app[WEIGHTS].update(spec.version, spec.path, PauseMode(spec.mode))
    except WeightsUpdateError as exc:
        raise wire_error(exc, request.app[CONFIG].retry_after_seconds) from None
    return json_response(report)


def wire_error(exc: WeightsUpdateError, retry_after: int) -> ProxyError:
    """The HTTP error for an update that did not happen everywhere (the module's table)."""
    error: ProxyError
    if exc.retryable:
        error = ServiceUnavailableError(exc.message, retry_after=retry_after, code=exc.code)
    elif isinstance(exc, UpdateRefusedError):
        error = ConflictError(exc.message, code=exc.code)
    elif isinstance(exc, UpdateFailedError) and exc.code == "update_timeout":
        error = GatewayTimeoutError(exc.message, code=exc.code)
    elif isinstance(exc, UpdateFailedError) and exc.code == "commit_failed":
        error = UpstreamError(exc.message, code=exc.code)
    else:
        error = BadRequestError(exc.message, code=exc.code)
    error.should_retry = exc.retryable
    if exc.workers:
        error.details = {"workers": list(exc.workers)}
    return error


def add_routes(app: web.Application) -> None:
    app.router.add_get("/weights", get_weights)
    app.router.add_post("/weights", update_weights)
