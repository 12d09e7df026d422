"""Log lines: JSON with the trial id and request id of the request they were logged under."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.logs import LogFormat, configure_logging, request_id_var, trial_id_var
from proxy.observability import ProxyMetrics, observe_middleware, setup_observability
from relay.pool import WorkerPool


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("DEBUG", LogFormat.JSON, stream)
    yield stream
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved_handlers:
        root.addHandler(handler)
    root.setLevel(saved_level)


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_context(captured: io.StringIO) -> None:
    """Every JSON line has time, level, logger, message, trial_id and request_id."""
    log = logging.getLogger("proxy.test")
    log.info("outside")
    t1, t2 = trial_id_var.set("trial-1"), request_id_var.set("req-1")
    try:
        log.warning("inside %s", "request", extra={"tokens": 3})
    finally:
        trial_id_var.reset(t1)
        request_id_var.reset(t2)
    outside, inside = _lines(captured)
    assert outside["message"] == "outside"
    assert outside["trial_id"] is None
    assert outside["request_id"] is None
    assert inside["message"] == "inside request"
    assert inside["level"] == "WARNING"
    assert inside["logger"] == "proxy.test"
    assert inside["trial_id"] == "trial-1"
    assert inside["request_id"] == "req-1"
    assert inside["tokens"] == 3
    assert "time" in inside


def test_text_format_shows_context() -> None:
    """The text format names trial and request in brackets when there are any."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = list(root.handlers)
    handler = configure_logging("INFO", "text", stream)
    try:
        token = trial_id_var.set("t-9")
        logging.getLogger("x").info("hello")
        trial_id_var.reset(token)
    finally:
        root.removeHandler(handler)
        for h in saved:
            root.addHandler(h)
    assert "[trial=t-9] hello" in stream.getvalue()


async def test_request_lines_carry_the_requests_ids(captured: io.StringIO) -> None:
    """Records logged while a request is handled, and its access line, carry its trial id
    (from the path) and request id (the client's X-Request-Id or a generated one)."""

    async def handler(request: web.Request) -> web.Response:
        logging.getLogger("proxy.handler").info("handling")
        return web.Response(text="ok")

    app = web.Application(middlewares=[observe_middleware])
    setup_observability(app, ProxyMetrics(WorkerPool(), lambda: 0))
    app.router.add_get("/{trial_id}/v1/echo", handler)
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/trial-7/v1/echo", headers={"X-Request-Id": "abc-1"})
        assert response.status == 200
        assert response.headers["X-Request-Id"] == "abc-1"
    lines = [
        line for line in _lines(captured) if line["logger"] in {"proxy.handler", "proxy.access"}
    ]
    assert [line["logger"] for line in lines] == ["proxy.handler", "proxy.access"]
    for line in lines:
        assert line["trial_id"] == "trial-7"
        assert line["request_id"] == "abc-1"
    access = lines[1]
    assert access["status"] == 200
    assert access["route"] == "/{trial_id}/v1/echo"
