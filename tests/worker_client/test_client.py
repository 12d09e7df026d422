"""The worker's connection to a real proxy on loopback: backoff, tokenizer files, hello
and refusal, reconnection, and cancellation reaching the engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from proxy.appkeys import POOL, WEIGHTS
from proxy.config import ProxyConfig
from relay import protocol
from relay.exceptions import RelayError, UpdateFailedError, WorkerFailedError
from relay.pool import (
    FinishedEvent,
    RelayCall,
    RestartedEvent,
    ResumedEvent,
    TokensEvent,
    WorkerId,
    WorkerPool,
)
from rollout_relay.embedded import RunningProxy, start_proxy
from worker_client.backends.hf import HFEngine
from worker_client.backends.instant import InstantEngine
from worker_client.checkpoints import perturbed_checkpoint
from worker_client.client import (
    TOKENIZER_FILES,
    ServedModel,
    WorkerClient,
    backoff_delay,
    collect_tokenizer_files,
)
from worker_client.exceptions import ConnectionRefusedByProxy, EngineError
from worker_client.policy import PolicyState, UpdateState

TOKEN = "t"

# ---------------------------------------------------------------------------- pure helpers


def test_backoff_delay_is_bounded_full_jitter() -> None:
    """Every delay lies in [0, min(cap, base * 2**attempt)], and the delays spread over
    that whole range (full jitter)."""
    rng = random.Random(1234)
    for base, cap in ((0.5, 30.0), (0.1, 2.0)):
        for attempt in range(0, 16):
            bound = min(cap, base * 2**attempt)
            delays = [backoff_delay(attempt, base=base, cap=cap, rng=rng) for _ in range(300)]
            assert all(0.0 <= d <= bound for d in delays), (base, cap, attempt)
            assert min(delays) < 0.1 * bound
            assert max(delays) > 0.9 * bound
    assert 0.0 <= backoff_delay(10_000, rng=rng) <= 30.0


def test_backoff_delay_grows_with_attempts() -> None:
    """The mean delay doubles with each attempt until it reaches the cap."""
    rng = random.Random(99)
    means = [
        statistics.fmean(backoff_delay(a, base=0.5, cap=30.0, rng=rng) for _ in range(2000))
        for a in range(9)
    ]
    for a in range(6):  # 0.5 * 2**6 = 32 > 30: capped from attempt 6 on
        assert means[a + 1] > 1.6 * means[a], means
    assert abs(means[7] - 15.0) < 1.5
    assert abs(means[8] - 15.0) < 1.5


def test_backoff_delay_is_reproducible_with_a_seeded_rng() -> None:
    """The jitter comes only from the given rng."""
    a = [backoff_delay(n, rng=random.Random(5)) for n in range(10)]
    b = [backoff_delay(n, rng=random.Random(5)) for n in range(10)]
    assert a == b


def test_collect_tokenizer_files_reads_tokenizer_not_weights(tiny_model_dir: Path) -> None:
    """The tokenizer, its config, chat template and model configs are shipped byte for
    byte; the weights are not."""
    files = collect_tokenizer_files(tiny_model_dir)
    expected = {
        p.name for p in tiny_model_dir.iterdir() if p.is_file() and p.name in TOKENIZER_FILES
    }
    assert set(files) == expected
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(files)
    assert "model.safetensors" not in files
    for name, data in files.items():
        assert data == (tiny_model_dir / name).read_bytes()


def test_a_given_chat_template_replaces_the_models_own(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``--chat-template FILE``: the file is shipped as ``chat_template.jinja`` (which a
    loader prefers to the template in ``tokenizer_config.json``), a ``chat_template.json``
    is left out, every other file is unchanged, and the proxy's tokenizer has the new
    template."""
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.is_file() and path.name in TOKENIZER_FILES:
            (model / path.name).write_bytes(path.read_bytes())
    (model / "chat_template.json").write_text('{"chat_template": "old"}')
    own = collect_tokenizer_files(model)
    files = collect_tokenizer_files(model, template)
    assert files["chat_template.jinja"] == template.read_bytes()
    assert "chat_template.json" not in files
    assert {k: v for k, v in files.items() if k != "chat_template.jinja"} == {
        k: v for k, v in own.items() if k not in ("chat_template.jinja", "chat_template.json")
    }
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name, data in files.items():
        (shipped / name).write_bytes(data)
    loaded = AutoTokenizer.from_pretrained(str(shipped))
    assert loaded.chat_template == template.read_text()


def test_collect_tokenizer_files_refuses_a_directory_without_a_tokenizer(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A directory with configs and weights but no tokenizer raises EngineError; so does a
    missing directory."""
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(EngineError):
        collect_tokenizer_files(tmp_path)
    with pytest.raises(EngineError):
        collect_tokenizer_files(tmp_path / "missing")


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
async def engine(tiny_model_dir: Path) -> AsyncIterator[HFEngine]:
    loaded = HFEngine.load(tiny_model_dir, name="tiny")
    yield loaded
    await loaded.close()


@pytest.fixture
async def endless(engine: HFEngine) -> AsyncIterator[HFEngine]:
    """The same weights without eos tokens: a generation only ends at max_tokens (or the
    131072-token window), so a request that is not aborted runs for many minutes. A fresh
    engine per test: no abort state leaks from one test into the next."""
    e = HFEngine(engine.model, name="endless", max_model_len=131072, eos_token_ids=())
    yield e
    await e.close()


@pytest.fixture(scope="module")
def prompt(tiny_model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids: list[int] = tokenizer.encode(
        "<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    return ids


@pytest.fixture
def models(engine: HFEngine, endless: HFEngine, tiny_model_dir: Path) -> dict[str, ServedModel]:
    return {
        "tiny": ServedModel(engine, tiny_model_dir),
        "endless": ServedModel(endless, tiny_model_dir),
    }


def _config(
    tmp_path: Path, port: int = 0, wait: float = 30.0, heartbeat: float = 10.0
) -> ProxyConfig:
    return ProxyConfig(
        port=port,
        cache_dir=tmp_path / "proxy-cache",
        worker_token=TOKEN,
        worker_wait_seconds=wait,
        heartbeat_seconds=heartbeat,
    )


# Stopping a proxy while a worker is connected takes about 1.5 heartbeats (nothing closes
# the worker sockets on shutdown; see test_stopping_the_proxy_drops_its_workers_promptly),
# so tests that stop a proxy under a connected worker use a short heartbeat.
_SHORT_HEARTBEAT = 1.0


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[RunningProxy]:
    running = await start_proxy(_config(tmp_path))
    yield running
    await running.stop()


@contextlib.asynccontextmanager
async def _running(client: WorkerClient) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(client.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _collect(call: RelayCall) -> tuple[list[int], list[float], FinishedEvent]:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for event in call.events():
        if isinstance(event, TokensEvent):
            tokens += event.token_ids
            logprobs += event.logprobs
        elif isinstance(event, RestartedEvent):
            tokens, logprobs = [], []
        elif isinstance(event, ResumedEvent):
            continue  # another worker goes on from the tokens already received
        else:
            return tokens, logprobs, event
    raise AssertionError("events ended without FinishedEvent")


async def _generate(
    pool: WorkerPool, model: str, prompt_ids: Sequence[int], **sampling: Any
) -> tuple[list[int], list[float], FinishedEvent]:
    call = await pool.start(model, prompt_ids, protocol.Sampling(**sampling))
    return await asyncio.wait_for(_collect(call), 20)


async def _first_tokens(call: RelayCall, count: int) -> None:
    """Wait until the call has streamed ``count`` tokens."""
    received = 0
    async with contextlib.aclosing(call.events()) as events:
        async for event in events:
            assert isinstance(event, TokensEvent)
            received += len(event.token_ids)
            if received >= count:
                return


async def _until_disconnected(client: WorkerClient) -> None:
    """Until the client noticed its proxy went away (10 s at most)."""
    for _ in range(200):
        if not client.connected.is_set():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the worker client did not notice its proxy was gone")


def _port(running: RunningProxy) -> int:
    return int(running.url.rsplit(":", 1)[1])


# ---------------------------------------------------------------------------- with a proxy


async def test_connects_and_pool_lists_its_models(
    proxy: RunningProxy, models: dict[str, ServedModel], engine: HFEngine, prompt: list[int]
) -> None:
    """The worker connects, the pool lists its models with their card and tokenizer files,
    and a request relayed through the pool returns the engine's exact tokens and
    logprobs."""
    client = WorkerClient(proxy.worker_url, models, token=TOKEN, worker_id="w-connect")
    async with _running(client) as task:
        await asyncio.wait_for(client.connected.wait(), 30)
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        assert set(pool.workers) == {"w-connect"}
        served = pool.served_models()
        assert set(served) == {"tiny", "endless"}
        assert served["tiny"].max_model_len == 131072
        assert served["tiny"].backend == "hf"
        assert served["tiny"].logprobs_mode == "raw"
        assert "model.safetensors" not in served["tiny"].tokenizer_files
        assert "tokenizer.json" in served["tiny"].tokenizer_files
        assert pool.workers["w-connect"].max_concurrency == client.max_concurrency

        tokens, logprobs, finished = await _generate(pool, "tiny", prompt, max_tokens=8, seed=3)
        assert finished.worker_id == "w-connect"
        assert finished.finish_reason in ("length", "stop")
        assert 1 <= len(tokens) <= 8
        scored = engine.score(prompt, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, scored, strict=True)) < 1e-4
        assert not task.done()


async def test_engine_errors_are_relayed_per_request(
    proxy: RunningProxy, models: dict[str, ServedModel], prompt: list[int]
) -> None:
    """A prompt too long for the window and an empty prompt fail only their own request
    (prompt_too_long / engine_error); the worker stays connected and serves the next."""
    client = WorkerClient(proxy.worker_url, models, token=TOKEN, worker_id="w-errors")
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        with pytest.raises(WorkerFailedError) as info:
            await _generate(pool, "tiny", [5] * 131072, max_tokens=4)
        assert info.value.code == "prompt_too_long"
        with pytest.raises(WorkerFailedError) as info:
            await _generate(pool, "tiny", [], max_tokens=4)
        assert info.value.code == "engine_error"
        tokens, _, finished = await _generate(pool, "endless", prompt, max_tokens=3, seed=1)
        assert (len(tokens), finished.finish_reason) == (3, "length")
        assert set(pool.workers) == {"w-errors"}


async def test_wrong_token_is_refused_promptly(
    proxy: RunningProxy, models: dict[str, ServedModel]
) -> None:
    """A worker with a wrong token gets ConnectionRefusedByProxy from run() at once (no
    retry loop) and never joins the pool."""
    client = WorkerClient(proxy.worker_url, models, token="wrong", worker_id="w-bad")
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedByProxy, match="unauthorized"):
        await asyncio.wait_for(client.run(), 10)
    assert time.monotonic() - started < 5
    assert not client.connected.is_set()
    assert proxy.app[POOL].workers == {}


async def test_reconnects_to_a_restarted_proxy_on_the_same_port(
    tmp_path: Path, models: dict[str, ServedModel], prompt: list[int]
) -> None:
    """When the proxy goes away and a new one listens on the same port, the worker
    reconnects by itself and serves a request on the new proxy."""
    first = await start_proxy(_config(tmp_path, heartbeat=_SHORT_HEARTBEAT))
    port = _port(first)
    client = WorkerClient(first.worker_url, models, token=TOKEN, worker_id="w-again")
    second: RunningProxy | None = None
    try:
        async with _running(client) as task:
            await first.wait_for_workers(1, within_seconds=30)
            await first.stop()
            await _until_disconnected(client)
            assert not task.done()

            second = await start_proxy(_config(tmp_path, port))
            assert _port(second) == port
            await second.wait_for_workers(1, within_seconds=30)
            pool = second.app[POOL]
            assert set(pool.workers) == {"w-again"}
            tokens, _, finished = await _generate(pool, "endless", prompt, max_tokens=5, seed=2)
            assert (len(tokens), finished.finish_reason) == (5, "length")
            assert finished.worker_id == "w-again"
            assert not task.done()
    finally:
        if second is not None:
            await second.stop()


async def test_cancelling_a_call_mid_generation_aborts_the_engine(
    proxy: RunningProxy, models: dict[str, ServedModel], prompt: list[int]
) -> None:
    """RelayCall.cancel() during streaming makes the worker abort the engine's request
    (which would otherwise run for minutes): the worker's next request on the same
    single-request engine completes at once."""
    client = WorkerClient(proxy.worker_url, models, token=TOKEN, worker_id="w-cancel")
    async with _running(client) as task:
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        call = await pool.start("endless", prompt, protocol.Sampling(max_tokens=100_000, seed=1))
        await _first_tokens(call, 3)
        await call.cancel()
        assert pool.in_flight == 0

        tokens, _, finished = await asyncio.wait_for(
            _generate(pool, "endless", prompt, max_tokens=4, seed=2), 10
        )
        assert (len(tokens), finished.finish_reason) == (4, "length")
        assert not task.done()
        assert set(pool.workers) == {"w-cancel"}


async def test_cancelling_a_call_right_after_start_aborts_the_engine(
    proxy: RunningProxy, models: dict[str, ServedModel], prompt: list[int]
) -> None:
    """RelayCall.cancel() immediately after pool.start() (the agent disconnected at once)
    still aborts the engine's request: the next request completes at once."""
    client = WorkerClient(proxy.worker_url, models, token=TOKEN, worker_id="w-cancel-early")
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        call = await pool.start("endless", prompt, protocol.Sampling(max_tokens=100_000, seed=1))
        await call.cancel()
        tokens, _, finished = await asyncio.wait_for(
            _generate(pool, "endless", prompt, max_tokens=4, seed=2), 8
        )
        assert (len(tokens), finished.finish_reason) == (4, "length")


async def test_restarted_proxy_request_ids_are_not_aborted_by_stale_state(
    tmp_path: Path, models: dict[str, ServedModel], prompt: list[int]
) -> None:
    """A worker that lost its proxy in the middle of a generation serves the new proxy's
    requests normally, even though the new pool numbers its requests from req-1 again."""
    first = await start_proxy(_config(tmp_path, wait=0.5, heartbeat=_SHORT_HEARTBEAT))
    port = _port(first)
    client = WorkerClient(first.worker_url, models, token=TOKEN, worker_id="w-stale")
    second: RunningProxy | None = None
    try:
        async with _running(client):
            await first.wait_for_workers(1, within_seconds=30)
            call = await first.app[POOL].start(
                "endless", prompt, protocol.Sampling(max_tokens=100_000, seed=1)
            )
            assert call.request_id == "req-1"
            await _first_tokens(call, 2)
            await first.stop()
            # The lost call is re-dispatched, finds no worker and fails.
            with pytest.raises(RelayError):
                await asyncio.wait_for(_collect(call), 10)

            second = await start_proxy(_config(tmp_path, port))
            await second.wait_for_workers(1, within_seconds=30)
            call = await second.app[POOL].start(
                "endless", prompt, protocol.Sampling(max_tokens=4, seed=2)
            )
            assert call.request_id == "req-1"
            tokens, _, finished = await asyncio.wait_for(_collect(call), 10)
            assert (len(tokens), finished.finish_reason) == (4, "length")
    finally:
        if second is not None:
            await second.stop()


async def test_stopping_the_proxy_drops_its_workers_promptly(
    tmp_path: Path, models: dict[str, ServedModel]
) -> None:
    """RunningProxy.stop() with a connected (idle) worker returns within a couple of
    seconds and the worker notices the drop."""
    running = await start_proxy(_config(tmp_path, heartbeat=4.0))
    client = WorkerClient(running.worker_url, models, token=TOKEN, worker_id="w-stop")
    async with _running(client):
        await running.wait_for_workers(1, within_seconds=30)
        stopping = asyncio.create_task(running.stop())
        done, _ = await asyncio.wait({stopping}, timeout=2.0)
        await stopping  # let it finish either way
        assert done, "RunningProxy.stop() took longer than 2 s"
        assert not client.connected.is_set()


class _Exploding:
    """An engine whose generation raises something no engine should (a bug, a driver
    error): fault injection around the real engine's card."""

    def __init__(self, engine: HFEngine) -> None:
        self.card = engine.card

    async def generate(self, request_id: str, prompt_ids: Any, sampling: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield  # pragma: no cover - makes this an async generator

    async def abort(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_an_unexpected_engine_exception_fails_the_request_not_hangs_it(
    proxy: RunningProxy, engine: HFEngine, tiny_model_dir: Path, prompt: list[int]
) -> None:
    """Whatever an engine raises, the request ends at once with engine_error naming it,
    and the worker keeps serving."""
    broken = {"broken": ServedModel(_Exploding(engine), tiny_model_dir)}  # type: ignore[arg-type]
    client = WorkerClient(proxy.worker_url, broken, token=TOKEN, worker_id="w-broken")
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        for _ in range(2):
            with pytest.raises(WorkerFailedError) as info:
                await asyncio.wait_for(_generate(pool, "broken", prompt, max_tokens=4), 10)
            assert info.value.code == "engine_error"
            assert "RuntimeError: CUDA error" in str(info.value)
        assert set(pool.workers) == {"w-broken"}


async def test_an_update_whose_connection_ends_is_rolled_back(
    proxy: RunningProxy, tiny_model_dir: Path, prompt: list[int]
) -> None:
    """A proxy that paused the worker for an update and then went away leaves no paused
    worker behind: the connection's end rolls the update back, and the reconnected worker
    serves on the version it had."""
    instant = InstantEngine.load(tiny_model_dir, name="instant", reply_tokens=4)
    client = WorkerClient(
        proxy.worker_url,
        {"instant": ServedModel(instant, tiny_model_dir)},
        token=TOKEN,
        worker_id="w-update",
    )
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        handle = pool.workers[WorkerId("w-update")]
        await handle.link.send(handle.endpoint.update(protocol.Pause("u1")))
        engine = client.policy.engines[0]
        for _ in range(500):
            if engine.state is PolicyState.PAUSED:
                break
            await asyncio.sleep(0.01)
        assert (client.policy.state, client.policy.update_id) == (UpdateState.PAUSED, "u1")
        await handle.link.close("the proxy went away")
        for _ in range(500):
            if client.policy.state is UpdateState.IDLE:
                break
            await asyncio.sleep(0.01)
        assert client.policy.state is UpdateState.IDLE
        assert (engine.state, client.policy.version) == (PolicyState.SERVING, 0)
        await proxy.wait_for_workers(1, within_seconds=30)
        _, _, finished = await _generate(pool, "instant", prompt, max_tokens=4)
        assert finished.extra[protocol.POLICY_VERSION] == 0


async def test_a_pause_that_outlasts_its_update_stays_quiet_and_serving(
    proxy: RunningProxy, tiny_model_dir: Path, prompt: list[int]
) -> None:
    """A wait-mode pause that takes longer than the proxy waits is rolled back by the
    proxy; when the running request then finishes, the worker neither answers the
    forgotten update (a protocol error that would drop the connection) nor stays paused:
    the same connection serves the next request on the old version."""
    slow = InstantEngine.load(tiny_model_dir, name="slow", reply_tokens=12, tokens_per_second=8)
    client = WorkerClient(
        proxy.worker_url,
        {"slow": ServedModel(slow, tiny_model_dir)},
        token=TOKEN,
        worker_id="w-slow",
    )
    async with _running(client):
        await proxy.wait_for_workers(1, within_seconds=30)
        pool = proxy.app[POOL]
        handle = pool.workers[WorkerId("w-slow")]
        running = asyncio.create_task(_generate(pool, "slow", prompt, max_tokens=12))
        await asyncio.sleep(0.2)
        sync = proxy.app[WEIGHTS]
        sync.phase_seconds = 0.3
        with pytest.raises(UpdateFailedError) as failed:
            await sync.update(1)
        assert failed.value.code == "update_timeout"
        tokens, _, finished = await running
        assert (len(tokens), finished.finish_reason) == (12, "stop")
        await asyncio.sleep(0.3)  # time for a stray answer to arrive
        assert pool.workers.get(WorkerId("w-slow")) is handle
        engine = client.policy.engines[0]
        assert (client.policy.state, engine.state) == (UpdateState.IDLE, PolicyState.SERVING)
        _, _, again = await _generate(pool, "slow", prompt, max_tokens=2)
        assert again.extra[protocol.POLICY_VERSION] == 0
        assert pool.workers.get(WorkerId("w-slow")) is handle


async def test_a_stamped_version_stays_stamped_across_a_proxy_restart(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """After a checkpoint and then a stamp-only update, the worker tells a restarted proxy
    that no checkpoint holds its version: the trainer's retry of the stamp answers as a
    success (not ``version_not_newer``), and a late worker is not caught up by loading the
    old checkpoint under the stamped number: it never serves."""
    checkpoint = perturbed_checkpoint(tiny_model_dir, tmp_path / "step-1", seed=1)
    stamped = HFEngine.load(tiny_model_dir, name="tiny")
    late_engine = HFEngine.load(tiny_model_dir, name="tiny")
    first = await start_proxy(_config(tmp_path, heartbeat=_SHORT_HEARTBEAT))
    port = _port(first)
    worker = WorkerClient(
        first.worker_url,
        {"tiny": ServedModel(stamped, tiny_model_dir)},
        token=TOKEN,
        worker_id="w-stamped",
    )
    second: RunningProxy | None = None
    stopped = False
    try:
        async with _running(worker):
            await first.wait_for_workers(1, within_seconds=30)
            await first.app[WEIGHTS].update(1, str(checkpoint))
            assert (await first.app[WEIGHTS].update(2))["path"] is None
            await first.stop()
            stopped = True
            await _until_disconnected(worker)

            config = dataclasses.replace(_config(tmp_path, port), weights_phase_seconds=1.0)
            second = await start_proxy(config)
            await second.wait_for_workers(1, within_seconds=30)
            pool = second.app[POOL]
            assert (pool.version, pool.weights_path) == (2, None)
            report = await second.app[WEIGHTS].update(2)  # the retry of the stamp
            assert report["version"] == 2

            late = WorkerClient(
                second.worker_url,
                {"tiny": ServedModel(late_engine, tiny_model_dir)},
                token=TOKEN,
                worker_id="w-late",
            )
            async with _running(late):
                for _ in range(200):  # joins, waits a phase's time, is taken out of service
                    if pool.stats.out_of_service:
                        break
                    await asyncio.sleep(0.05)
                assert pool.stats.out_of_service == 1
                assert late.policy.version == 0
    finally:
        if not stopped:
            await first.stop()
        if second is not None:
            await second.stop()
        await stamped.close()
        await late_engine.close()
