"""Weight updates end to end: a real proxy, ``rollout-relay worker`` processes on the
tiny model, and a trainer's checkpoints (each version a different model directory, written
with ``save_pretrained``) pushed through ``POST /weights``.

What the trainer relies on, checked by teacher forcing: after an update every recorded
logprob is the new checkpoint's own (and no longer the old one's), every token says which
version sampled it, a bad update changes nothing, and a worker that joins late or
reconnects loads the current checkpoint before it serves anything."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
from tests.processes import reap
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
    reap(process)


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
    assert (report["version"], report["path"]) == (2, None)  # no checkpoint holds a stamped version
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
    step = str(checkpoints[1]).encode()  # not the one served: that would be a retry
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
    # Known weights to compare with, whatever the tests before left (a stamped version
    # names no checkpoint).
    await client.update_weights(await _served_version(client) + 1, str(checkpoints[2]))
    serving = checkpoints[2]
    before = await client.weights()
    current = int(before["version"])
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
        reap(late)  # SIGKILL
        late = _start_worker(proxy, tiny_model_dir, LATE)  # the same id, a fresh process
        await _joined(proxy, late, LATE, old=old)
        await _served_by(client, LATE, version, scorers[checkpoints[1]], seed=32)
    finally:
        reap(late)


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
                reap(process)
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
        reap(process)
        await running.stop()


async def _stream_across_update(
    running: RunningProxy, mode: str
) -> tuple[str, str, dict[str, Any], dict[str, Any], bool]:
    """Stream one reply, asking for a stamp-only update once its first tokens are in;
    returns (text received, finish reason, the update's answer, the export, whether the
    update had answered before the reply's last token arrived)."""
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
        text, finish, update, early = "", "", None, False
        async for chunk in stream:
            if not chunk.choices:
                continue
            # Checked as each token arrives, the last one included: had the update answered?
            early = early or (update is not None and update.done())
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            if update is None and len(text) > 10:
                update = asyncio.create_task(client.update_weights(current + 1, mode=mode))
        await agent.close()
        assert update is not None, "the reply was too short to be interrupted"
        report = await update
        export = await client.trajectories(trial.trial_id)
        await client.complete(trial.trial_id)
        return text, finish, report, export, early


async def test_abort_update_continues_a_streamed_reply_on_the_new_version(
    paced: RunningProxy, tiny_model_dir: Path
) -> None:
    """An ``abort`` update in the middle of a stream stops the generation, serves the new
    version and continues the reply from the tokens already sampled: the agent gets one
    normal reply, the turn records exactly it, and its tokens carry both versions."""
    preempted = await _metric(paced.url, "relay_requests_preempted_total")
    text, finish, report, export, _ = await _stream_across_update(paced, "abort")
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
    finished (it had not answered when the reply's last token arrived), all of the reply
    on the old version; the next reply is on the new one."""
    text, finish, report, export, early = await _stream_across_update(paced, "wait")
    assert not early, "the update answered while the reply was still streaming"
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


# --------------------------------------------------------------------------- faults


@dataclass(slots=True)
class Gates:
    """What the in-process hf workers of ``gated`` do when asked to load weights: wait
    for ``loading`` (a slow checkpoint read), counted in ``loads``; with ``commit_error``
    their parameter swap raises it (a device error) before touching the weights."""

    loading: asyncio.Event = field(default_factory=asyncio.Event)
    loads: int = 0
    commit_error: str | None = None


GATED = ("g-1", "g-2")


@pytest.fixture
async def gated(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[RunningProxy, Gates]]:
    """A proxy with two in-process hf workers on the tiny model whose loading waits for
    the test (``Gates``)."""
    from worker_client.client import ServedModel, WorkerClient

    running = await start_proxy(
        ProxyConfig(
            port=0,
            worker_wait_seconds=30 * TIMEOUT_FACTOR,
            max_tokens=16,
            cache_dir=tmp_path / "cache",
            weights_phase_seconds=60 * TIMEOUT_FACTOR,
        )
    )
    gates = Gates()
    # Two engines read checkpoints in one process here (a worker process has one):
    # transformers' from_pretrained, run in two threads at once, was seen to leave a tied
    # parameter on the meta device, so the reads take turns.
    reading = asyncio.Lock()
    for worker_id in GATED:
        engine = HFEngine.load(tiny_model_dir, name="tiny")
        stage, apply = engine.stage_weights, engine._apply_checkpoint

        async def slow_stage(path: str, stage: Any = stage) -> None:
            gates.loads += 1
            await gates.loading.wait()
            async with reading:
                await stage(path)

        def failing_apply(tensors: Any, apply: Any = apply) -> None:
            if gates.commit_error is not None:
                raise RuntimeError(gates.commit_error)
            apply(tensors)

        monkeypatch.setattr(engine, "stage_weights", slow_stage)
        monkeypatch.setattr(engine, "_apply_checkpoint", failing_apply)
        client = WorkerClient(
            running.worker_url,
            {"tiny": ServedModel(engine, tiny_model_dir)},
            worker_id=worker_id,
        )
        running.worker_tasks.append(asyncio.get_running_loop().create_task(client.run()))
    await running.wait_for_workers(len(GATED), within_seconds=60 * TIMEOUT_FACTOR)
    yield running, gates
    gates.loading.set()
    await running.stop()


async def _post_weights(
    url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """POST /weights on a connection of its own: (status, body, headers)."""
    limit = aiohttp.ClientTimeout(total=300 * TIMEOUT_FACTOR)
    async with (
        aiohttp.ClientSession(timeout=limit) as http,
        http.post(f"{url}/weights", json=body) as response,
    ):
        return response.status, await response.json(), dict(response.headers)


async def _until_updating(url: str, state: str) -> None:
    """Until GET /weights says the running update is in ``state``."""
    async with ProxyClient(url) as client:
        for _ in range(int(1200 * TIMEOUT_FACTOR)):
            updating = (await client.weights())["updating"]
            if updating is not None and updating["state"] == state:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the update never was {state}")


async def _until_settled(url: str, version: int, workers: int) -> dict[str, Any]:
    """Until no update runs and ``workers`` workers serve ``version``; the report."""
    async with ProxyClient(url) as client:
        for _ in range(int(1200 * TIMEOUT_FACTOR)):
            report = await client.weights()
            states = [(w["version"], w["state"]) for w in report["workers"]]
            if report["updating"] is None and states == [(version, "serving")] * workers:
                return report
            await asyncio.sleep(0.05)
    raise AssertionError(f"the workers did not settle on version {version}: {report}")


async def _hang_up(url: str, body: dict[str, Any], state: str) -> None:
    """POST /weights and close the connection once the update is in ``state``, as a
    trainer whose timeout fired (or whose connection a load balancer closed)."""
    post = asyncio.create_task(_post_weights(url, body))
    await _until_updating(url, state)
    post.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await post


async def _turn_at_once(url: str, *, seed: int) -> set[int]:
    """A new trial's turn, which must be served within seconds (no worker left paused);
    the versions that sampled it."""
    async with ProxyClient(url) as client:
        _, export = await asyncio.wait_for(_turns(client, n=1, seed=seed), 20 * TIMEOUT_FACTOR)
    return _versions(export)


async def test_a_trainer_hanging_up_during_a_wait_pause_leaves_no_worker_paused(
    paced: RunningProxy,
) -> None:
    """A wait-mode POST /weights whose client goes away while the update waits for a
    streaming reply: the reply finishes on the old version, the update commits anyway,
    new turns are served at once on the new version, and the next update succeeds."""
    async with ProxyClient(paced.url) as client:
        current = await _served_version(client)
        trial = await client.create_session(sampling={"temperature": 1.0})
    agent = AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0)
    stream = await agent.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        stream=True,
        seed=11,
    )
    text, hung_up = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if hung_up is None and len(text) > 10:
            hung_up = asyncio.create_task(
                _hang_up(paced.url, {"version": current + 1, "mode": "wait"}, "pausing")
            )
    await agent.close()
    assert hung_up is not None, "the reply was too short to be interrupted"
    await hung_up
    report = await _until_settled(paced.url, current + 1, 1)
    assert report["version"] == current + 1
    assert await _turn_at_once(paced.url, seed=12) == {current + 1}
    async with ProxyClient(paced.url) as client:
        assert (await client.update_weights(current + 2))["version"] == current + 2
    assert await _turn_at_once(paced.url, seed=13) == {current + 2}


async def test_a_trainer_hanging_up_while_workers_load_leaves_no_worker_paused(
    gated: tuple[RunningProxy, Gates], checkpoints: list[Path], scorers: dict[Path, HFEngine]
) -> None:
    """A POST /weights whose client goes away while the workers read the checkpoint: the
    update runs to its commit, both workers serve the checkpoint as the new version, new
    turns are served at once on it, and the next update succeeds."""
    running, gates = gated
    body = {"version": 1, "path": str(checkpoints[0])}
    await _hang_up(running.url, body, "loading")
    gates.loading.set()
    report = await _until_settled(running.url, 1, len(GATED))
    assert report["path"] == str(checkpoints[0])
    async with ProxyClient(running.url) as client:
        _, export = await asyncio.wait_for(_turns(client, n=1, seed=51), 20 * TIMEOUT_FACTOR)
        assert _versions(export) == {1}
        assert check_fidelity(export, scorers[checkpoints[0]].score).max_abs_error <= 1e-4
        assert (await client.update_weights(2, str(checkpoints[1])))["version"] == 2
    assert await _turn_at_once(running.url, seed=52) == {2}


async def test_a_retry_of_the_same_update_gets_its_outcome(
    gated: tuple[RunningProxy, Gates], checkpoints: list[Path]
) -> None:
    """The same update asked again while it runs waits for it and gets its answer, asked
    again after it finished gets the same answer, and the workers load the checkpoint
    once; another update meanwhile is refused with a retryable 503."""
    running, gates = gated
    body = {"version": 1, "path": str(checkpoints[0])}
    first = asyncio.create_task(_post_weights(running.url, body))
    await _until_updating(running.url, "loading")
    retry = asyncio.create_task(_post_weights(running.url, {**body, "mode": "abort"}))
    status, other, headers = await _post_weights(
        running.url, {"version": 2, "path": str(checkpoints[1])}
    )
    assert (status, other["error"]["code"]) == (503, "update_in_progress")
    assert (headers["x-should-retry"], int(headers["Retry-After"]) > 0) == ("true", True)
    assert not retry.done()
    gates.loading.set()
    (s1, answer, _), (s2, again, _) = await asyncio.gather(first, retry)
    assert (s1, s2) == (200, 200)
    assert answer == again
    assert [(w["version"], w["state"]) for w in answer["workers"]] == [(1, "serving")] * 2
    status, later, _ = await _post_weights(running.url, body)
    assert (status, later) == (200, answer)
    assert gates.loads == len(GATED)  # one load per worker: the retries ran nothing


async def test_a_commit_failing_on_every_worker_moves_no_version(
    gated: tuple[RunningProxy, Gates],
    checkpoints: list[Path],
    scorers: dict[Path, HFEngine],
    tiny_model_dir: Path,
) -> None:
    """When no worker can swap the weights in, POST /weights answers 502 commit_failed
    naming every worker (and says so again to a retry), the version served does not
    move, and the workers, back after being taken out of service, serve the old weights
    under the old version."""
    running, gates = gated
    gates.loading.set()
    gates.commit_error = "CUDA error: an illegal memory access was encountered"
    body = {"version": 1, "path": str(checkpoints[0])}
    status, error, headers = await _post_weights(running.url, body)
    assert (status, error["error"]["code"]) == (502, "commit_failed")
    assert sorted(error["error"]["workers"]) == sorted(GATED)
    assert headers["x-should-retry"] == "false"
    assert (await _post_weights(running.url, body))[:2] == (status, error)
    gates.commit_error = None
    await running.wait_for_workers(len(GATED), within_seconds=60 * TIMEOUT_FACTOR)
    report = await _until_settled(running.url, 0, len(GATED))
    assert (report["version"], report["path"]) == (0, None)
    async with ProxyClient(running.url) as client:
        _, export = await asyncio.wait_for(_turns(client, n=1, seed=61), 20 * TIMEOUT_FACTOR)
        assert _versions(export) == {0}
        assert check_fidelity(export, scorers[tiny_model_dir].score).max_abs_error <= 1e-4
        with pytest.raises(ProxyRequestError) as failed:
            await client.update_weights(1, str(checkpoints[0]))
        assert (failed.value.status, failed.value.code) == (502, "commit_failed")
        assert (await client.update_weights(2, str(checkpoints[0])))["version"] == 2


async def test_the_sdk_asks_again_when_the_connection_drops(
    gated: tuple[RunningProxy, Gates], checkpoints: list[Path]
) -> None:
    """ProxyClient.update_weights whose connection is cut while the workers load asks
    again and gets the update's answer; the workers load the checkpoint once."""
    from tests.e2e.link import Link

    running, gates = gated
    link = Link(int(running.url.rsplit(":", 1)[1]))
    await link.start()
    link.plans = ["before"]  # the first connection is cut once the request is in
    try:
        async with ProxyClient(f"http://127.0.0.1:{link.port}") as client:
            update = asyncio.create_task(client.update_weights(1, str(checkpoints[0])))
            await _until_updating(running.url, "loading")
            gates.loading.set()
            report = await asyncio.wait_for(update, 120 * TIMEOUT_FACTOR)
        assert [(w["version"], w["state"]) for w in report["workers"]] == [(1, "serving")] * 2
        assert gates.loads == len(GATED)
        assert link.plans == []  # the cut connection was used
    finally:
        await link.stop()
