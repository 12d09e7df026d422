"""The weights API the trainer uses after an optimizer step (admin token).

``POST /weights`` ``{"version": int, "path": str (optional), "mode": "wait" | "abort"}``:
every connected worker loads the Hugging Face model directory at ``path`` (the trainer
wrote it on storage the workers can read) and serves ``version``; the answer comes once
they all do. Without ``path`` the version is only stamped (the trainer updated the engines
itself, as verl does; ``path`` in the answers stays the checkpoint last loaded). ``GET
/weights``: the version served and each worker's. The relay
carries only the control messages (``relay.weights``); the weights never pass the proxy.
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.errors import json_response, parse_json
from proxy.appkeys import WEIGHTS
from proxy.exceptions import BadRequestError, ConflictError, ServiceUnavailableError
from relay.exceptions import UpdateFailedError, UpdateRefusedError
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
        report = await request.app[WEIGHTS].update(spec.version, spec.path, PauseMode(spec.mode))
    except UpdateRefusedError as exc:
        raise ConflictError(exc.message, code=exc.code) from None
    except UpdateFailedError as exc:
        if exc.code == "update_timeout":
            raise ServiceUnavailableError(exc.message, code=exc.code) from None
        raise BadRequestError(exc.message, code=exc.code) from None
    return json_response(report)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/weights", get_weights)
    app.router.add_post("/weights", update_weights)
