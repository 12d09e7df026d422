"""Weight updates end to end: a real proxy, ``rollout-relay worker`` processes on the
tiny model, and a trainer's checkpoints (each version a different model directory, written
with ``save_pretrained``) pushed through ``POST /weights``.

What the trainer relies on, checked by teacher forcing: after an update every recorded
logprob is the new checkpoint's own (and no longer the old one's), every token says which
version sampled it, a bad update changes nothing, and a worker that joins late or
reconnects loads the current checkpoint before it serves anything."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from proxy.appkeys import POOL
from proxy.config import ProxyConfig
from relay.pool import WorkerState
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from sdk.exceptions import ProxyRequestError
from sdk.fidelity import check_fidelity, check_fidelity_by_version
from tests.e2e.conftest import TIMEOUT_FACTOR, worker_command
from worker_client.backends.hf import HFEngine
from worker_client.checkpoints import perturbed_checkpoint

pytestmark = pytest.mark.e2e

FIRST = "b-first"  # the worker that runs for the whole module
LATE = "a-late"  # joins later; idle ties go to the smaller id, so new trials start on it


def write_checkpoint(base: Path, out: Path, seed: int) -> Path:
    """A new policy version of the base model, saved as a trainer saves a checkpoint."""
    return perturbed_checkpoint(base, out, seed=seed)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return [write_checkpoint(tiny_model_dir, root / f"step-{i}", seed=i) for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def scorers(tiny_model_dir: Path, checkpoints: list[Path]) -> dict[Path, HFEngine]:
    """A teacher-forcing model per checkpoint (the base model included)."""
    return {path: HFEngine.load(path) for path in [tiny_model_dir, *checkpoints]}


@pytest.fixture(scope="module")
async def proxy(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        worker_wait_seconds=30 * TIMEOUT_FACTOR,
        max_tokens=24,
        cache_dir=tmp_path_factory.mktemp("weights-cache"),
    )
    running = await start_proxy(config)
    yield running
    await running.stop()


def _start_worker(
    proxy: RunningProxy, model: Path, worker_id: str, *options: str
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        worker_command(proxy.worker_url, model, "--worker-id", worker_id, *options),
        env=os.environ | {"RELAY_WORKER_TOKEN": ""},
    )


@pytest.fixture(scope="module")
async def first_worker(
    proxy: RunningProxy, tiny_model_dir: Path
) -> AsyncIterator[subprocess.Popen[bytes]]:
    process = _start_worker(proxy, tiny_model_dir, FIRST)
    await _joined(proxy, process, FIRST)
    yield process
    process.kill()
    process.wait()


@pytest.fixture
async def client(proxy: RunningProxy) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(proxy.url) as c:
        yield c


async def _joined(
    proxy: RunningProxy, process: subprocess.Popen[bytes], worker_id: str, *, old: object = None
) -> None:
    """Until the worker process serves (joined, and caught up with the current weights);
    ``old``: the handle of its previous connection, which does not count."""
    pool = proxy.app[POOL]
    deadline = asyncio.get_running_loop().time() + 120 * TIMEOUT_FACTOR
    while True:
        handle = pool.workers.get(worker_id)  # type: ignore[call-overload]
        if handle is not None and handle is not old and handle.state is WorkerState.SERVING:
            return
        assert process.poll() is None, "the worker process exited"
        assert asyncio.get_running_loop().time() < deadline, "the worker did not serve"
        await asyncio.sleep(0.1)


async def _turns(client: ProxyClient, n: int = 2, *, seed: int = 0) -> tuple[str, dict[str, Any]]:
    """A trial with ``n`` continued chat turns; its export."""
    trial = await client.create_session(sampling={"temperature": 1.0, "top_p": 1.0})
    agent = AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
    for i in range(n):
        reply = await agent.chat.completions.create(
            model="tiny", messages=messages, seed=seed + i, max_tokens=24
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"And then {i}?"},
        ]
    await agent.close()
    return trial.trial_id, await client.trajectories(trial.trial_id)


def _versions(export: dict[str, Any]) -> set[int]:
    return {
        v
        for traj in export["trajectories"]
        for v, m in zip(traj["response_versions"], traj["response_mask"], strict=True)
        if m
    }


async def _served_by(
    client: ProxyClient, worker_id: str, version: int, scorer: HFEngine, *, seed: int
) -> None:
    """A new trial's turn is served by ``worker_id`` with ``version``'s weights."""
    _, export = await _turns(client, n=1, seed=seed)
    assert {t["worker_id"] for tr in export["trajectories"] for t in tr["turns"]} == {worker_id}
    assert _versions(export) == {version}
    assert check_fidelity(export, scorer.score).max_abs_error <= 1e-4


async def _metric(url: str, name: str) -> float:
    """One sample of the proxy's /metrics (the first line that starts with ``name``)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


async def _served_version(client: ProxyClient) -> int:
    return int((await client.weights())["version"])


async def test_each_version_samples_with_its_checkpoint(
    first_worker: subprocess.Popen[bytes],
    client: ProxyClient,
    tiny_model_dir: Path,
    checkpoints: list[Path],
    scorers: dict[Path, HFEngine],
) -> None:
    """Before an update the recorded logprobs are the startup model's; after POST /weights
    they are the checkpoint's (and no longer the old model's), each token says its version,
    a conversation spanning the update carries both, and a stamp-only update keeps the
    weights and moves the version."""
    assert (await client.weights())["version"] == 0
    _, before = await _turns(client)
    assert _versions(before) == {0}
    assert check_fidelity(before, scorers[tiny_model_dir].score).max_abs_error <= 1e-4

    # A conversation that spans the update: its first turn on version 0, the next on 1.
    trial = await client.create_session(sampling={"temperature": 1.0})
    agent = AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
    history: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
    first = await agent.chat.completions.create(model="tiny", messages=history, seed=3)

    report = await client.update_weights(1, str(checkpoints[0]))
    assert report["version"] == 1
    assert report["path"] == str(checkpoints[0])
    assert [(w["worker_id"], w["version"], w["state"]) for w in report["workers"]] == [
        (FIRST, 1, "serving")
    ]

    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "More."},
    ]
    await agent.chat.completions.create(model="tiny", messages=history, seed=4)
    await agent.close()
    spanning = await client.trajectories(trial.trial_id)
    (traj,) = spanning["trajectories"]
    assert [t["branch_reason"] for t in traj["turns"]] == ["new_session", "continued"]
    assert [sorted({v for v, _, _ in t["versions"]}) for t in traj["turns"]] == [[0], [1]]
    for turn in traj["turns"]:
        (version, start, end), *_ = turn["versions"]
        assert (start, end) == (turn["response_start"], turn["response_end"])
        assert traj["response_versions"][start:end] == [version] * (end - start)
    assert set(traj["response_versions"]) - {0, 1} == {-1}  # context tokens
    by_version = {0: scorers[tiny_model_dir].score, 1: scorers[checkpoints[0]].score}
    assert check_fidelity_by_version(spanning, by_version).max_abs_error <= 1e-4

    _, after = await _turns(client, seed=7)
    assert _versions(after) == {1}
    assert check_fidelity(after, scorers[checkpoints[0]].score).max_abs_error <= 1e-4
    # The old weights would have given other logprobs: the update really changed them.
    assert check_fidelity(after, scorers[tiny_model_dir].score).max_abs_error > 1e-2

    # Stamp-only (the trainer updated the engines itself): same weights, next version.
    report = await client.update_weights(2)
    assert (report["version"], report["path"]) == (2, str(checkpoints[0]))
    _, stamped = await _turns(client, n=1, seed=9)
    assert _versions(stamped) == {2}
    assert check_fidelity(stamped, scorers[checkpoints[0]].score).max_abs_error <= 1e-4


def _bad_updates(
    tmp: Path, tiny_model_dir: Path, checkpoints: list[Path], current: int
) -> list[tuple[str, bytes, int, str]]:
    """(case, raw body, status, error code): updates that must change nothing."""
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    corrupt = tmp / "corrupt"
    corrupt.mkdir(exist_ok=True)
    (corrupt / "config.json").write_bytes((checkpoints[0] / "config.json").read_bytes())
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    other = tmp / "other-shape"
    if not other.exists():
        from worker_client.tiny_model import VOCAB_SIZE, random_model

        random_model(
            vocab_size=VOCAB_SIZE, hidden_size=32, eos_ids=[2], pad_id=0, seed=0
        ).save_pretrained(str(other))
    step = str(checkpoints[1]).encode()
    nxt = current + 1
    return [
        ("not newer", b'{"version": %d, "path": "%s"}' % (current, step), 409, "version_not_newer"),
        ("older", b'{"version": 0}', 409, "version_not_newer"),
        (
            "no such path",
            b'{"version": %d, "path": "/nonexistent/step"}' % nxt,
            400,
            "weights_load_failed",
        ),
        (
            "not a model",
            b'{"version": %d, "path": "%s"}' % (nxt, str(empty).encode()),
            400,
            "weights_load_failed",
        ),
        (
            "corrupt weights",
            b'{"version": %d, "path": "%s"}' % (nxt, str(corrupt).encode()),
            400,
            "weights_load_failed",
        ),
        (
            "other shapes",
            b'{"version": %d, "path": "%s"}' % (nxt, str(other).encode()),
            400,
            "weights_load_failed",
        ),
        ("malformed json", b'{"version": ', 400, "invalid_json"),
        ("empty body", b"", 400, "invalid_json"),
        ("version as text", b'{"version": "%d"}' % nxt, 400, "invalid_request"),
        ("version as bool", b'{"version": true}', 400, "invalid_request"),
        ("negative version", b'{"version": -1}', 400, "invalid_request"),
        ("unknown mode", b'{"version": %d, "mode": "later"}' % nxt, 400, "invalid_request"),
        ("unknown field", b'{"version": %d, "paths": "x"}' % nxt, 400, "invalid_request"),
        ("empty path", b'{"version": %d, "path": ""}' % nxt, 400, "invalid_request"),
        ("not an object", b"[1]", 400, "invalid_request"),
    ]


async def test_bad_updates_are_refused_and_change_nothing(
    first_worker: subprocess.Popen[bytes],
    proxy: RunningProxy,
    client: ProxyClient,
    tiny_model_dir: Path,
    checkpoints: list[Path],
    scorers: dict[Path, HFEngine],
    tmp_path: Path,
) -> None:
    """A version not newer, a path that does not load (missing, not a model, corrupt,
    another architecture) or a malformed body is a clear error in the session API's
    format; every worker keeps serving the previous weights under the previous version."""
    before = await client.weights()
    current = int(before["version"])
    serving = Path(before["path"]) if before["path"] else tiny_model_dir
    rolled_back = await _metric(proxy.url, 'relay_weight_updates_total{outcome="rolled_back"}')
    async with aiohttp.ClientSession() as http:
        for case, body, status, code in _bad_updates(
            tmp_path, tiny_model_dir, checkpoints, current
        ):
            async with http.post(
                f"{proxy.url}/weights", data=body, headers={"Content-Type": "application/json"}
            ) as response:
                payload = await response.json(content_type=None)
            assert (response.status, payload["error"]["code"]) == (status, code), case
            assert payload["error"]["message"], case
            assert await client.weights() == before, case
    # Each path that did not load was loaded by no worker: rolled back, counted.
    after = await _metric(proxy.url, 'relay_weight_updates_total{outcome="rolled_back"}')
    assert after == rolled_back + 4
    assert await _metric(proxy.url, "relay_policy_version") == current
    _, export = await _turns(client, n=1, seed=21)
    assert _versions(export) == {current}
    assert check_fidelity(export, scorers[serving].score).max_abs_error <= 1e-4


async def test_late_and_reconnecting_workers_load_the_current_weights(
    first_worker: subprocess.Popen[bytes],
    proxy: RunningProxy,
    client: ProxyClient,
    tiny_model_dir: Path,
    checkpoints: list[Path],
    scorers: dict[Path, HFEngine],
) -> None:
    """A worker that starts after an update (from the startup model) and one that restarts
    load the current checkpoint before serving: their turns score as that checkpoint."""
    current = await _served_version(client)
    report = await client.update_weights(current + 1, str(checkpoints[1]))
    version = int(report["version"])
    late = _start_worker(proxy, tiny_model_dir, LATE)
    try:
        await _joined(proxy, late, LATE)
        workers = {w["worker_id"]: w for w in (await client.weights())["workers"]}
        assert workers[LATE]["version"] == version
        assert workers[LATE]["path"] == str(checkpoints[1])
        await _served_by(client, LATE, version, scorers[checkpoints[1]], seed=31)

        old = proxy.app[POOL].workers[LATE]  # type: ignore[index]
        late.send_signal(signal.SIGKILL)
        late.wait()
        late = _start_worker(proxy, tiny_model_dir, LATE)  # the same id, a fresh process
        await _joined(proxy, late, LATE, old=old)
        await _served_by(client, LATE, version, scorers[checkpoints[1]], seed=32)
    finally:
        late.kill()
        late.wait()


async def test_update_without_workers_is_loaded_by_the_first_to_join(
    tiny_model_dir: Path,
    checkpoints: list[Path],
    scorers: dict[Path, HFEngine],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """With no worker connected the version is recorded at once; the first worker to
    join loads its checkpoint before it serves."""
    running = await start_proxy(
        ProxyConfig(
            port=0,
            worker_wait_seconds=30 * TIMEOUT_FACTOR,
            max_tokens=16,
            cache_dir=tmp_path_factory.mktemp("weights-empty-cache"),
        )
    )
    try:
        async with ProxyClient(running.url) as c:
            report = await c.update_weights(4, str(checkpoints[2]))
            assert (report["version"], report["workers"]) == (4, [])
            process = _start_worker(running, tiny_model_dir, "joiner")
            try:
                await _joined(running, process, "joiner")
                _, export = await _turns(c, n=1, seed=41)
                assert _versions(export) == {4}
                score = scorers[checkpoints[2]].score
                assert check_fidelity(export, score).max_abs_error <= 1e-4
            finally:
                process.kill()
                process.wait()
    finally:
        await running.stop()


async def test_sdk_surfaces_refusals(client: ProxyClient, first_worker: Any) -> None:
    """ProxyClient.update_weights raises the proxy's error, with its status and code."""
    current = await _served_version(client)
    with pytest.raises(ProxyRequestError) as exc:
        await client.update_weights(current)
    assert (exc.value.status, exc.value.code) == (409, "version_not_newer")


@pytest.fixture(scope="module")
async def paced(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    """A proxy whose worker process replies at a known pace (the ``instant`` backend, 40
    tokens at 40 tokens/s), so an update lands in the middle of a stream every time."""
    running = await start_proxy(
        ProxyConfig(
            port=0,
            worker_wait_seconds=30 * TIMEOUT_FACTOR,
            max_tokens=64,
            cache_dir=tmp_path_factory.mktemp("weights-paced-cache"),
        )
    )
    options = ("--backend", "instant", "--reply-tokens", "40", "--tokens-per-second", "40")
    process = _start_worker(running, tiny_model_dir, "paced", *options)
    try:
        await _joined(running, process, "paced")
        yield running
    finally:
        process.kill()
        process.wait()
        await running.stop()


async def _stream_across_update(
    running: RunningProxy, mode: str
) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """Stream one reply, asking for a stamp-only update once its first tokens are in;
    returns (text received, finish reason, the update's answer, the export)."""
    async with ProxyClient(running.url) as client:
        current = await _served_version(client)
        trial = await client.create_session(sampling={"temperature": 1.0})
        agent = AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
        stream = await agent.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me a long story."}],
            stream=True,
            seed=5,
        )
        text, finish, update = "", "", None
        async for chunk in stream:
            if not chunk.choices:
                continue
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            if update is None and len(text) > 10:
                update = asyncio.create_task(client.update_weights(current + 1, mode=mode))
        await agent.close()
        assert update is not None, "the reply was too short to be interrupted"
        report = await update
        export = await client.trajectories(trial.trial_id)
        await client.complete(trial.trial_id)
        return text, finish, report, export


async def test_abort_update_continues_a_streamed_reply_on_the_new_version(
    paced: RunningProxy, tiny_model_dir: Path
) -> None:
    """An ``abort`` update in the middle of a stream stops the generation, serves the new
    version and continues the reply from the tokens already sampled: the agent gets one
    normal reply, the turn records exactly it, and its tokens carry both versions."""
    preempted = await _metric(paced.url, "relay_requests_preempted_total")
    text, finish, report, export = await _stream_across_update(paced, "abort")
    assert await _metric(paced.url, "relay_requests_preempted_total") == preempted + 1
    assert finish == "stop"
    (traj,) = export["trajectories"]
    (turn,) = traj["turns"]
    assert turn["finish_reason"] == "stop"
    assert not turn["truncated"]
    old, new = report["version"] - 1, report["version"]
    (v1, s1, e1), (v2, s2, e2) = turn["versions"]
    assert (v1, v2) == (old, new)
    assert (s1, e1, e2) == (turn["response_start"], s2, turn["response_end"])
    assert 0 < e1 - s1 < e2 - s1
    assert traj["response_versions"][s1:e2] == [old] * (e1 - s1) + [new] * (e2 - s2)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = traj["response_ids"][s1:e2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


async def test_wait_update_lets_a_streamed_reply_finish_on_the_old_version(
    paced: RunningProxy,
) -> None:
    """A ``wait`` update asked in the middle of a stream returns only after the reply
    finished, all of it on the old version; the next reply is on the new one."""
    text, finish, report, export = await _stream_across_update(paced, "wait")
    assert finish == "stop"
    assert text
    (traj,) = export["trajectories"]
    (turn,) = traj["turns"]
    assert turn["versions"] == [
        [report["version"] - 1, turn["response_start"], turn["response_end"]]
    ]
    async with ProxyClient(paced.url) as client:
        _, after = await _turns(client, n=1)
    assert _versions(after) == {report["version"]}
