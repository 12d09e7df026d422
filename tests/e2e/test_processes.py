"""The CLI's proxy and worker as separate processes, the way they are deployed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.conftest import TIMEOUT_FACTOR

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_until(predicate: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds * TIMEOUT_FACTOR
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError("condition not reached")


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


ADMIN_TOKEN = "a-secret"


def _json(method: str, url: str, body: object = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def processes(
    tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    cli = [sys.executable, "-m", "rollout_relay.cli", "--log-level", "WARNING"]
    env = os.environ | {"RELAY_WORKER_TOKEN": "w-secret", "RELAY_ADMIN_TOKEN": ADMIN_TOKEN}
    proxy = subprocess.Popen(
        [
            *cli,
            "proxy",
            "--port",
            str(port),
            "--cache-dir",
            str(tmp_path),
            "--worker-wait-seconds",
            "3",
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    worker: subprocess.Popen[bytes] | None = None
    try:
        _wait_until(lambda: _status(f"{url}/healthz") == 200, 30)
        worker = subprocess.Popen(
            [
                *cli,
                "worker",
                "--proxy",
                f"ws://127.0.0.1:{port}/ws/worker",
                "--model",
                str(tiny_model_dir),
            ],
            env=env,
        )
        _wait_until(lambda: _status(f"{url}/readyz") == 200, 90)
        yield url, worker
    finally:
        for p in (worker, proxy):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_cli_proxy_and_worker_serve_the_sync_openai_client(
    processes: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """A trial registered over HTTP is served by a worker process through the relay."""
    url, worker = processes
    created = _json("POST", f"{url}/sessions", {"metadata": {"task": "t"}})
    client = OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    reply = client.chat.completions.create(
        model="whatever", messages=[{"role": "user", "content": "hello"}], max_tokens=6
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens >= 1
    export = _json("GET", f"{url}/sessions/{created['trial_id']}/trajectories")
    assert sum(export["trajectories"][0]["response_mask"]) == reply.usage.completion_tokens

    worker.kill()
    worker.wait(10)
    _wait_until(lambda: _status(f"{url}/readyz") == 503, 30)


def test_worker_with_wrong_token_is_refused(
    tiny_model_dir: Path, processes: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """A worker presenting the wrong token exits with an error instead of joining."""
    url, _ = processes
    port = url.rsplit(":", 1)[1]
    env = os.environ | {"RELAY_WORKER_TOKEN": "wrong"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_relay.cli",
            "worker",
            "--proxy",
            f"ws://127.0.0.1:{port}/ws/worker",
            "--model",
            str(tiny_model_dir),
        ],
        env=env,
        capture_output=True,
        timeout=120 * TIMEOUT_FACTOR,
    )
    assert result.returncode != 0
    assert b"invalid worker token" in result.stderr
