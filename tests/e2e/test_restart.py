"""Durability end to end: ``kill -9`` the proxy mid-episode, restart it on the same data
directory, and the agent carries on as if nothing happened."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from sdk.samples import build_samples
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.e2e.test_processes import _free_port, _status, _wait_until

pytestmark = pytest.mark.e2e


def _request(method: str, url: str, body: object = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60 * TIMEOUT_FACTOR) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _json(method: str, url: str, body: object = None) -> Any:
    status, raw = _request(method, url, body)
    assert status < 300, raw
    return json.loads(raw)


class Proxy:
    """``rollout-relay up`` (proxy + in-process worker) as a real process on a data dir."""

    def __init__(self, model: Path, data_dir: Path, cache_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "rollout_relay.cli",
            "--log-level",
            "WARNING",
            "up",
            "--port",
            str(self.port),
            "--model",
            str(model),
            "--data-dir",
            str(data_dir),
            "--cache-dir",
            str(cache_dir),
            "--max-tokens",
            "12",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        process = self.process

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"the proxy exited with {process.returncode}")
            return _status(f"{self.url}/readyz") == 200

        _wait_until(ready, 120)

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


@pytest.fixture
def proxy(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Proxy]:
    running = Proxy(tiny_model_dir, tmp_path / "data", tmp_path / "cache")
    try:
        yield running
    finally:
        running.stop()


def _assistant(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    return out


def test_kill_9_restart_and_the_agent_continues(proxy: Proxy) -> None:
    """Every acknowledged session and turn (streamed or not) is served byte-identical after
    ``kill -9`` and a restart; the agent's next turn continues its context, nothing is lost
    or duplicated, a completed session stays completed with its reward and a deleted one
    deleted."""
    proxy.start()
    trial = _json("POST", f"{proxy.url}/sessions", {"metadata": {"task": "restart"}})
    tid = trial["trial_id"]
    agent = OpenAI(base_url=trial["base_url"], api_key=trial["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    reply = agent.chat.completions.create(model="any", messages=messages, seed=1)
    messages += [_assistant(reply.choices[0].message), {"role": "user", "content": "and now?"}]
    # The second turn streams: its turn must be committed before [DONE].
    stream = agent.chat.completions.create(
        model="any",
        messages=messages,
        seed=2,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]

    done = _json("POST", f"{proxy.url}/sessions", {"trial_id": "finished-trial"})
    other = OpenAI(base_url=done["base_url"], api_key=done["api_key"], max_retries=0)
    other.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], seed=3)
    _json("POST", f"{proxy.url}/sessions/finished-trial/complete", {"reward": {"pass": 1.0}})
    _json("POST", f"{proxy.url}/sessions", {"trial_id": "gone"})
    _json("DELETE", f"{proxy.url}/sessions/gone")

    before = {
        path: _request("GET", f"{proxy.url}{path}")
        for path in (
            f"/sessions/{tid}",
            f"/sessions/{tid}/trajectories",
            "/sessions/finished-trial",
            "/sessions/finished-trial/trajectories",
            "/sessions",
        )
    }
    summary = json.loads(before[f"/sessions/{tid}"][1])
    assert summary["turns"] == 2
    assert summary["branches"] == 1

    proxy.kill9()
    proxy.start()

    after = {path: _request("GET", f"{proxy.url}{path}") for path in before}
    for path, (status, body) in before.items():
        assert status == 200
        assert after[path] == (status, body), path

    # Deleting is durable too: the id answers 409, not 404, and cannot be registered again.
    status, body = _request("GET", f"{proxy.url}/sessions/gone")
    assert status == 409
    assert json.loads(body)["error"]["code"] == "session_deleted"
    assert _request("POST", f"{proxy.url}/sessions", {"trial_id": "gone"})[0] == 409

    # The agent carries on: the third turn continues the second one.
    agent = OpenAI(base_url=trial["base_url"], api_key=trial["api_key"], max_retries=0)
    third = agent.chat.completions.create(model="any", messages=messages, seed=4)
    export = _json("GET", f"{proxy.url}/sessions/{tid}/trajectories")
    old = json.loads(before[f"/sessions/{tid}/trajectories"][1])["trajectories"][0]
    (trajectory,) = export["trajectories"]
    assert [t["turn"] for t in trajectory["turns"]] == [0, 1, 2]
    assert trajectory["turns"][2]["parent"] == 1
    assert trajectory["turns"][2]["branch_reason"] == "continued"
    assert trajectory["prompt_ids"] == old["prompt_ids"]
    n = len(old["response_ids"])
    assert trajectory["response_ids"][:n] == old["response_ids"]
    assert trajectory["response_logprobs"][:n] == old["response_logprobs"]
    assert third.usage is not None
    assert sum(trajectory["response_mask"][n:]) == third.usage.completion_tokens

    # The completed session refuses more turns after the restart, as before it.
    status, body = _request(
        "POST",
        f"{done['base_url']}/chat/completions",
        {"model": "any", "messages": [{"role": "user", "content": "more"}]},
    )
    assert status == 409
    assert json.loads(body)["error"]["code"] == "session_completed"

    # A third life: the continued turn survived too, and nothing was duplicated. Its
    # delivery is recorded after the reply's last byte went out, so the export to compare
    # with is the one that shows it, and a session created after it (answered once
    # committed, by the same writer, in order) marks it committed.
    for _ in range(100):
        if export["trajectories"][0]["turns"][2]["delivered"]:
            break
        time.sleep(0.05)
        export = _json("GET", f"{proxy.url}/sessions/{tid}/trajectories")
    assert export["trajectories"][0]["turns"][2]["delivered"]
    _json("POST", f"{proxy.url}/sessions", {"trial_id": "after-the-third-turn"})
    proxy.kill9()
    proxy.start()
    status, body = _request("GET", f"{proxy.url}/sessions/{tid}/trajectories")
    assert status == 200
    assert json.loads(body) == export


def _logprobs(choice: Any) -> tuple[float, ...]:
    return tuple(t.logprob for t in choice.logprobs.content) if choice.logprobs else ()


def _trained(export: dict[str, Any]) -> list[tuple[float, ...]]:
    """The logprobs of every stretch of sampled tokens ``build_samples`` trains."""
    out = []
    for sample in build_samples(export):
        for turn in sample.turns:
            start, end = turn["response_start"], turn["response_end"]
            if end > start and all(sample.response_mask[start:end]):
                out.append(tuple(sample.response_logprobs[start:end]))
    return out


def test_kill_9_under_load_trains_only_what_the_agents_received(proxy: Proxy) -> None:
    """Agents keep calling while the proxy is killed with ``kill -9`` and restarted, twice;
    their clients' own retries carry them over (a reply recorded but never delivered is
    replayed, a cut one sampled anew). Afterwards every session trains exactly the replies
    its agent received: zero tokens it did not receive, none of them twice."""
    proxy.start()
    agents = 3
    trials = [_json("POST", f"{proxy.url}/sessions", {}) for _ in range(agents)]
    received: list[list[tuple[float, ...]]] = [[] for _ in range(agents)]
    failures: list[BaseException] = []
    stop = threading.Event()

    def agent(n: int) -> None:
        trial = trials[n]
        # The client retries on its own through the restarts (backoff up to 8 s a try).
        client = OpenAI(base_url=trial["base_url"], api_key=trial["api_key"], max_retries=8)
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {n}"}]
        try:
            while not stop.is_set():
                reply = client.chat.completions.create(
                    model="any",
                    messages=messages,  # type: ignore[arg-type]
                    logprobs=True,
                )
                choice = reply.choices[0]
                received[n].append(_logprobs(choice))
                turn = len(received[n])
                messages += [_assistant(choice.message), {"role": "user", "content": f"go {turn}"}]
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(agents)]
    for thread in threads:
        thread.start()

    def progress() -> None:
        """Until every agent has had one more reply (or one failed)."""
        seen = [len(r) for r in received]
        _wait_until(
            lambda: failures or all(len(r) > k for r, k in zip(received, seen, strict=True)), 60
        )

    for _ in range(2):
        progress()  # every agent is calling again: kill at a random moment of their calls
        time.sleep(random.uniform(0.0, 0.3))
        proxy.kill9()
        proxy.start()
    progress()
    stop.set()
    for thread in threads:
        thread.join(240 * TIMEOUT_FACTOR)
    assert not failures, failures
    for n, trial in enumerate(trials):
        export = _json("GET", f"{proxy.url}/sessions/{trial['trial_id']}/trajectories")
        assert len(received[n]) >= 4
        assert sorted(_trained(export)) == sorted(received[n])


def test_kill_9_keeps_every_image_of_an_acknowledged_turn(tmp_path: Path) -> None:
    """A vision-language session: each image is committed with the turn that first used
    it, so after ``kill -9`` the export, its spans and the image bytes are the same, and the
    agent's next turn (its history repeating the screenshots) continues the chain."""
    import base64
    import hashlib

    from tests.e2e.test_images import GREEN, RED
    from worker_client.tiny_vlm import SHIPPED_TINY_VLM

    def user(text: str, image: bytes) -> dict[str, Any]:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        return {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }

    proxy = Proxy(SHIPPED_TINY_VLM, tmp_path / "data", tmp_path / "cache")
    try:
        proxy.start()
        trial = _json("POST", f"{proxy.url}/sessions", {})
        tid = trial["trial_id"]
        agent = OpenAI(base_url=trial["base_url"], api_key=trial["api_key"], max_retries=0)
        messages: list[dict[str, Any]] = [user("what is this", RED)]
        reply = agent.chat.completions.create(model="any", messages=messages, seed=1)  # type: ignore[arg-type]
        messages += [_assistant(reply.choices[0].message), user("and this", GREEN)]
        stream = agent.chat.completions.create(model="any", messages=messages, seed=2, stream=True)  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "so?"}]
        paths = [
            f"/sessions/{tid}/trajectories",
            *(f"/sessions/{tid}/images/{hashlib.sha256(i).hexdigest()}" for i in (RED, GREEN)),
        ]
        before = {path: _request("GET", f"{proxy.url}{path}") for path in paths}
        assert before[paths[1]] == (200, RED)
        assert before[paths[2]] == (200, GREEN)

        proxy.kill9()
        proxy.start()

        assert {path: _request("GET", f"{proxy.url}{path}") for path in paths} == before
        agent = OpenAI(base_url=trial["base_url"], api_key=trial["api_key"], max_retries=0)
        agent.chat.completions.create(model="any", messages=messages, seed=3)  # type: ignore[arg-type]
        (trajectory,) = _json("GET", f"{proxy.url}/sessions/{tid}/trajectories")["trajectories"]
        assert [t["branch_reason"] for t in trajectory["turns"]] == [
            "new_session",
            "continued",
            "continued",
        ]
        assert len(trajectory["multi_modal_data"]["images"]) == 2
    finally:
        proxy.stop()
