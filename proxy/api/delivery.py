"""Whether a reply reached its client, and what marks a request as a retry.

A turn is recorded (and committed) before its reply's end is written; whether that end
was then handed to the client is recorded after, on the turn (``delivered``), so a reply
the agent never received is not trained. The marks that tell a retry from a new request
(``proxy.sessions.retries``) are read here from the raw request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import web

from proxy.sessions.agents import agent_header_text
from proxy.sessions.model import Session
from proxy.sessions.retries import RetryMarks
from proxy.turns import TurnResult, TurnService

__all__ = ["retry_marks", "send_whole", "settle"]


def retry_marks(request: web.Request, api: str, body: bytes) -> RetryMarks:
    """The request's marks; the same body from two agents is two requests."""
    return RetryMarks.of(f"{api}\0{agent_header_text(request.headers)}", body, request.headers)


def settle(
    service: TurnService, session: Session, results: Sequence[TurnResult], delivered: bool
) -> None:
    """Record on each result's turn whether its reply was handed to the client."""
    replays = [r.node for r in results if r.replayed]
    sampled = [r.node for r in results if not r.replayed]
    if sampled:
        service.settle_delivery(session, sampled, delivered)
    if replays:
        service.settle_delivery(session, replays, delivered, replay=True)


async def send_whole(
    request: web.Request,
    response: web.Response,
    service: TurnService,
    session: Session,
    results: Sequence[TurnResult],
) -> web.Response:
    """Write a whole (not streamed) reply now, and record whether it went out: the
    response is prepared and ended here instead of after the handler returns."""
    delivered = False
    try:
        await response.prepare(request)
        await response.write_eof()
        delivered = True
    except ConnectionError:
        pass  # the client left; aiohttp's own attempt to finish the response fails quietly
    except asyncio.CancelledError:
        settle(service, session, results, False)
        raise
    settle(service, session, results, delivered)
    return response
