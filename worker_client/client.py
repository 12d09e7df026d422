"""The worker process's connection to the proxy.

The worker dials OUT (GPU nodes take no inbound traffic), announces its models together
with their tokenizer files, then serves generate requests concurrently, streaming token
deltas back as the engine produces them. When the connection drops it aborts what was
running (the proxy re-dispatches those requests elsewhere) and reconnects with jittered
exponential backoff. A refusal (bad token, protocol version) is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import socket
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shortuuid
import websockets
from websockets.asyncio.client import ClientConnection, connect

from relay import protocol
from relay.exceptions import ProtocolError
from worker_client.engine import Engine, ImageSpan, PromptScorer, SamplingParams
from worker_client.exceptions import (
    ConnectionRefusedByProxy,
    EngineError,
    PromptTooLongError,
    WeightsBusyError,
    WeightsError,
)
from worker_client.outbox import Outbox
from worker_client.policy import VersionedEngine, WorkerPolicy

log = logging.getLogger(__name__)

# Files a tokenizer (and its chat template) may consist of. Weights are never shipped.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    # A vision-language model's image processor: the proxy counts each image's tokens
    # with it (its patch, merge and pixel bounds).
    "preprocessor_config.json",
    "generation_config.json",
    "config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def collect_tokenizer_files(
    model_dir: str | Path, chat_template: str | Path | None = None
) -> dict[str, bytes]:
    """Read the tokenizer-related files of a Hugging Face model directory. A given
    ``chat_template`` file (e.g. a tool-aware one for a model whose own template ignores
    tools) replaces the model's template: it is shipped as ``chat_template.jinja``, which
    the proxy's loader prefers to a template inside ``tokenizer_config.json``."""
    root = Path(model_dir)
    files = {
        name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()
    }
    if chat_template is not None:
        files.pop("chat_template.json", None)
        files["chat_template.jinja"] = Path(chat_template).read_bytes()
    if (
        "tokenizer.json" not in files
        and "tokenizer.model" not in files
        and "vocab.json" not in files
    ):
        raise EngineError(f"no tokenizer files found in {root}")
    return files


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{shortuuid.uuid()[:8]}"


def client_ssl_context(ca_file: str | Path | None = None) -> ssl.SSLContext:
    """A context that verifies the proxy's certificate, against ``ca_file`` (PEM; e.g. the
    CA of a self-signed deployment) when given, else against the system's trusted CAs."""
    return ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))


def backoff_delay(
    attempt: int, *, base: float = 0.5, cap: float = 30.0, rng: random.Random
) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    return rng.uniform(0.0, min(cap, base * (2 ** min(attempt, 30))))


@dataclass(slots=True)
class ServedModel:
    """A model this worker serves. Its engine is wrapped in a ``VersionedEngine`` (pause,
    load weights, resume on a new version) unless it is one already. ``teacher``: it is
    announced as a teacher (``--teacher``: it scores, and agents reach it only by its
    exact name); its engine must score (``PromptScorer``)."""

    engine: VersionedEngine
    tokenizer_dir: Path
    chat_template: Path | None = None  # replaces the model's own template (--chat-template)
    teacher: bool = False

    def __init__(
        self,
        engine: Engine | VersionedEngine,
        tokenizer_dir: Path,
        chat_template: Path | None = None,
        *,
        teacher: bool = False,
    ) -> None:
        self.engine = engine if isinstance(engine, VersionedEngine) else VersionedEngine(engine)
        self.tokenizer_dir = Path(tokenizer_dir)
        self.chat_template = chat_template
        inner = self.engine.engine
        if teacher and not isinstance(inner, PromptScorer):
            raise EngineError(
                f"the {inner.card.backend} backend cannot score: it cannot serve a teacher"
            )
        self.teacher = teacher


class WorkerClient:
    """Connects one worker process (with one or more engines) to a proxy."""

    def __init__(
        self,
        proxy_url: str,
        models: Mapping[str, ServedModel],
        *,
        token: str = "",
        worker_id: str | None = None,
        max_concurrency: int = 8,
        max_frame_bytes: int = 256 * 1024 * 1024,
        ssl_context: ssl.SSLContext | None = None,
        connect_host: str | None = None,
        admission: Mapping[str, asyncio.Semaphore] | None = None,
        policy: WorkerPolicy | None = None,
    ) -> None:
        """``connect_host``: the address to connect to instead of the URL's host (one
        replica behind a name that resolves to several; the URL's host still names the
        server for TLS). ``admission``: per model, the limit on requests running on its
        engine, shared by every connection of this worker process (``WorkerFleet``); by
        default this connection's own, ``max_concurrency`` each. ``policy``: the weights
        of this worker process, likewise shared (by default this connection's own)."""
        if not models:
            raise ValueError("a worker needs at least one model")
        self.proxy_url = proxy_url
        self.models = dict(models)
        self.token = token
        self.worker_id = worker_id or default_worker_id()
        self.max_concurrency = max_concurrency
        self.max_frame_bytes = max_frame_bytes
        # For wss:// only; None there means the system's trusted CAs.
        self.ssl_context = ssl_context
        self.connect_host = connect_host
        self.admission = (
            dict(admission)
            if admission is not None
            else {name: asyncio.Semaphore(max_concurrency) for name in models}
        )
        self.policy = policy or WorkerPolicy([m.engine for m in self.models.values()])
        self.connected = asyncio.Event()
        self._rng = random.Random()
        # Requests generating that record routing, with their engine: stopped by the proxy,
        # they are ended through the engine so that their Done brings the rows.
        self._routing: dict[str, Engine] = {}
        self._aborts: set[asyncio.Task[None]] = set()
        self._hello_models = [
            protocol.ModelInfo(
                name=name,
                max_model_len=served.engine.card.max_model_len,
                logprobs_mode=served.engine.card.logprobs_mode.value,
                backend=served.engine.card.backend,
                tokenizer_files=collect_tokenizer_files(served.tokenizer_dir, served.chat_template),
                image_token_id=served.engine.card.image_token_id,
                routing=served.engine.card.routing,
                engine=dict(served.engine.card.engine),
                routing_unavailable=served.engine.card.routing_unavailable,
                teacher=served.teacher,
            )
            for name, served in self.models.items()
        ]

    def __repr__(self) -> str:
        state = "connected" if self.connected.is_set() else "disconnected"
        via = f" via {self.connect_host}" if self.connect_host else ""
        return f"<WorkerClient {self.worker_id} {state} {self.proxy_url}{via}>"

    async def run(self, *, max_attempts: int | None = None) -> None:
        """Connect and serve until cancelled; reconnect after every drop."""
        attempt = 0
        while True:
            try:
                async with connect(
                    self.proxy_url,
                    max_size=self.max_frame_bytes,
                    ping_interval=20,
                    ping_timeout=20,
                    open_timeout=10,
                    compression=None,
                    ssl=self._ssl(),
                    **self._connect_kwargs(),
                ) as ws:
                    attempt = 0
                    await self._serve(ws)
            except ConnectionRefusedByProxy:
                raise
            except (OSError, websockets.exceptions.WebSocketException, TimeoutError) as exc:
                log.warning("worker %s: connection to proxy lost: %s", self.worker_id, exc)
            finally:
                self.connected.clear()
            attempt += 1
            if max_attempts is not None and attempt >= max_attempts:
                raise ConnectionError(f"could not reach the proxy at {self.proxy_url}")
            await asyncio.sleep(backoff_delay(attempt, rng=self._rng))

    def _connect_kwargs(self) -> dict[str, Any]:
        # A replica's own address behind a name that resolves to several.
        return {"host": self.connect_host} if self.connect_host else {}

    def _ssl(self) -> ssl.SSLContext | bool | None:
        # websockets wants no ssl argument for ws://, and True (the default context) or a
        # context for wss://.
        if not self.proxy_url.startswith("wss://"):
            return None
        return self.ssl_context or True

    async def _serve(self, ws: ClientConnection) -> None:
        endpoint = protocol.WorkerEndpoint()
        hello = protocol.Hello(
            protocol_version=protocol.PROTOCOL_VERSION,
            worker_id=self.worker_id,
            token=self.token,
            models=self._hello_models,
            max_concurrency=self.max_concurrency,
            policy_version=self.policy.version,
            weights_path=self.policy.path,
        )
        await ws.send(endpoint.hello(hello))
        first = endpoint.receive(_as_bytes(await ws.recv()))
        if isinstance(first, protocol.Error):
            raise ConnectionRefusedByProxy(f"{first.code}: {first.message}")
        self.connected.set()
        log.info("worker %s connected to %s", self.worker_id, self.proxy_url)
        running: dict[str, asyncio.Task[None]] = {}
        images: dict[str, bytes] = {}  # what the proxy sent and has not dropped, by sha256
        outbox = Outbox(endpoint)
        sender = asyncio.create_task(outbox.run(ws.send), name=f"{self.worker_id}-sender")
        sender.add_done_callback(functools.partial(_close_on_failure, ws))
        updates = _UpdateDriver(self.policy, endpoint, outbox)
        stop_listening = self.policy.listen(updates.announce)
        try:
            async for data in ws:
                try:
                    message = endpoint.receive(_as_bytes(data))
                except ProtocolError as exc:
                    log.error("worker %s: protocol error from proxy: %s", self.worker_id, exc)
                    return
                if isinstance(message, protocol.Generate | protocol.Score):
                    rid = message.request_id
                    spans = self._spans(outbox, message, images)
                    if spans is None:
                        continue
                    task = asyncio.create_task(
                        self._run_request(outbox, message, spans)
                        if isinstance(message, protocol.Generate)
                        else self._run_score(outbox, message, spans)
                    )
                    running[rid] = task
                    task.add_done_callback(functools.partial(_forget, running, rid))
                elif isinstance(message, protocol.Cancel):
                    # Cancelling the task covers a request whose task has not started yet
                    # as well as one mid-stream (_run_request then aborts the engine).
                    pending = running.get(message.request_id)
                    closing = self._routing.get(message.request_id)
                    if pending is not None and closing is not None:
                        # Stopped by the proxy (a stop string) mid-generation: the engine
                        # ends the request, and its Done brings the routing rows of what it
                        # sampled, which the proxy waits for.
                        abort = asyncio.create_task(
                            _abort_keeping_rows(closing, message.request_id, pending)
                        )
                        self._aborts.add(abort)
                        abort.add_done_callback(self._aborts.discard)
                    elif pending is not None:
                        pending.cancel()
                elif isinstance(message, protocol.Image):
                    images[message.sha256] = message.data
                elif isinstance(message, protocol.ImageDrop):
                    for sha in message.sha256s:
                        images.pop(sha, None)
                elif isinstance(message, protocol.Ping):
                    outbox.control(protocol.encode(protocol.Pong(message.nonce)))
                elif isinstance(message, protocol.Error):
                    log.warning("proxy reported: %s: %s", message.code, message.message)
                elif isinstance(
                    message, protocol.Pause | protocol.Load | protocol.Commit | protocol.Rollback
                ):
                    updates.start(message)
        finally:
            stop_listening()
            await updates.close()
            for task in list(running.values()):
                task.cancel()
            for task in list(running.values()):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    def _spans(
        self,
        outbox: Outbox,
        message: protocol.Generate | protocol.Score,
        images: Mapping[str, bytes],
    ) -> list[ImageSpan] | None:
        """The request's images with their bytes, taken now (a later drop cannot reach
        it); None when one is not held: the request fails alone and the proxy sends its
        images again."""
        missing = [ref.sha256 for ref in message.images if ref.sha256 not in images]
        if missing:
            rid = message.request_id
            log.warning("worker %s: %s uses an image it lacks", self.worker_id, rid)
            outbox.finish(
                protocol.Error(protocol.IMAGE_MISSING, f"image {missing[0][:12]} not held", rid)
            )
            return None
        return [
            ImageSpan(ref.sha256, images[ref.sha256], ref.start, ref.end) for ref in message.images
        ]

    async def _run_score(
        self, outbox: Outbox, message: protocol.Score, images: Sequence[ImageSpan]
    ) -> None:
        """Teacher forcing of a ``Score`` request: its ``Done`` carries the scored ids
        with their logprobs (``relay.protocol``)."""
        rid = message.request_id
        served = self.models.get(message.model)
        if served is None or not served.teacher:
            outbox.finish(protocol.Error("unknown_model", f"no teacher {message.model!r}", rid))
            return
        ids = protocol.unpack_id_array(message.ids)
        try:
            async with self.admission[message.model]:
                logprobs = await served.engine.prompt_logprobs(rid, ids, message.start, images)
            if len(logprobs) != len(ids) - message.start:
                raise EngineError(f"{len(logprobs)} logprobs for {len(ids) - message.start} ids")
        except asyncio.CancelledError:
            outbox.discard(rid)
            raise
        except PromptTooLongError as exc:
            outbox.finish(protocol.Error("prompt_too_long", str(exc), rid))
        except Exception as exc:  # any engine failure fails this request, never hangs it
            log.exception("engine failed to score %s", rid)
            outbox.finish(protocol.Error("engine_error", f"{type(exc).__name__}: {exc}", rid))
        else:
            scored = protocol.pack_ids(ids[message.start :])
            done = protocol.Done(rid, protocol.SCORED, scored, protocol.pack_logprobs(logprobs))
            outbox.finish(done)

    async def _run_request(
        self, outbox: Outbox, message: protocol.Generate, images: Sequence[ImageSpan] = ()
    ) -> None:
        rid = message.request_id
        served = self.models.get(message.model)
        if served is None:
            outbox.finish(protocol.Error("unknown_model", f"model {message.model!r}", rid))
            return
        s = message.sampling
        sampling = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=tuple(s.stop_token_ids),
        )
        prompt = protocol.unpack_id_array(message.prompt_ids)
        finished = started = False
        try:
            # One admission limit per engine, whichever proxy the request came from.
            async with self.admission[message.model]:
                started = True
                if message.routed_experts_from is not None:
                    self._routing[rid] = served.engine
                try:
                    await self._generate(
                        outbox, served, rid, prompt, sampling, images, message.routed_experts_from
                    )
                finally:
                    self._routing.pop(rid, None)
                finished = True
        except asyncio.CancelledError:
            outbox.discard(rid)
            if started and not finished:  # an engine keeps nothing of a finished request
                await served.engine.abort(rid)
            raise
        except PromptTooLongError as exc:
            outbox.finish(protocol.Error("prompt_too_long", str(exc), rid))
        except Exception as exc:  # any engine failure fails this request, never hangs it
            log.exception("engine failed on %s", rid)
            outbox.finish(protocol.Error("engine_error", f"{type(exc).__name__}: {exc}", rid))

    async def _generate(
        self,
        outbox: Outbox,
        served: ServedModel,
        rid: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> None:
        """Stream one request's tokens; returns once its Done is queued (with the routing
        rows the engine gave, when they were asked for)."""
        # aclosing: however this ends, the engine's generator is finalized now (an engine
        # may hold a lock across its yields), not whenever it is collected.
        stream = served.engine.generate(
            rid, prompt, sampling, images, routed_experts_from=routed_experts_from
        )
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if chunk.finish_reason is None:
                    outbox.tokens(rid, chunk.token_ids, chunk.logprobs)
                    continue
                outbox.finish(
                    protocol.Done(
                        rid,
                        chunk.finish_reason.value,
                        protocol.pack_ids(chunk.token_ids),
                        protocol.pack_logprobs(chunk.logprobs),
                        dict(chunk.extra),
                        chunk.routed_experts if routed_experts_from is not None else None,
                    )
                )
                return
        raise EngineError("engine stream ended without a finish reason")


class _UpdateDriver:
    """One connection's side of weight updates: each phase the proxy asks for runs as its
    own task (a pause waits for running requests, which this connection keeps serving)
    and is answered with an ``UpdateAck``. The update this connection started is rolled
    back if the connection ends before it is committed."""

    def __init__(
        self, policy: WorkerPolicy, endpoint: protocol.WorkerEndpoint, outbox: Outbox
    ) -> None:
        self.policy = policy
        self.endpoint = endpoint
        self.outbox = outbox
        self.tasks: set[asyncio.Task[None]] = set()
        self.started: set[str] = set()  # updates begun on this connection

    def start(self, message: protocol.UpdateMessage) -> None:
        task = asyncio.create_task(self._run(message))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, message: protocol.UpdateMessage) -> None:
        update_id = message.update_id
        phase: protocol.UpdatePhase
        try:
            if isinstance(message, protocol.Pause):
                phase = protocol.UpdatePhase.PAUSED
                self.started.add(update_id)
                await self.policy.pause(update_id, message.mode)
                version = self.policy.version
            elif isinstance(message, protocol.Load):
                phase = protocol.UpdatePhase.LOADED
                await self.policy.load(update_id, message.version, message.path)
                version = message.version
            elif isinstance(message, protocol.Commit):
                phase = protocol.UpdatePhase.COMMITTED
                version = await self.policy.commit(update_id)
                self.started.discard(update_id)
            else:
                phase = protocol.UpdatePhase.ROLLED_BACK
                self.started.discard(update_id)
                await self.policy.rollback(update_id)
                version = self.policy.version
        except Exception as exc:  # answered, never raised: the proxy decides what follows
            if self._finished(update_id, phase):
                return
            if not isinstance(exc, WeightsError):
                log.exception("weight update %s failed", update_id)
            code = protocol.ACK_BUSY if isinstance(exc, WeightsBusyError) else ""
            self._send(
                protocol.UpdateAck(update_id, phase, False, self.policy.version, str(exc), code)
            )
            return
        if not self._finished(update_id, phase):
            self._send(protocol.UpdateAck(update_id, phase, True, version))

    def _finished(self, update_id: str, phase: protocol.UpdatePhase) -> bool:
        """Whether a pause ended after its update was rolled back (the proxy gave up
        waiting for it): the proxy has forgotten the update, so an answer would be a
        protocol error."""
        return phase is protocol.UpdatePhase.PAUSED and update_id not in self.started

    def _send(self, message: protocol.UpdateAck | protocol.Weights) -> None:
        if self.endpoint.state is protocol.ConnectionState.OPEN:
            self.outbox.control(self.endpoint.control(message))

    def announce(self, version: int, path: str | None) -> None:
        """The engines serve a new version (committed through any connection): every
        proxy this worker serves hears of it."""
        if self.endpoint.version >= protocol.WEIGHTS_VERSION:
            self._send(protocol.Weights(version, path))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for update_id in self.started:
            # The proxy that paused us is gone: serve the old weights again.
            await self.policy.rollback(update_id)


def _close_on_failure(ws: ClientConnection, sender: asyncio.Task[None]) -> None:
    """A sender that cannot write ends the connection, so the worker reconnects."""
    if not sender.cancelled() and sender.exception() is not None:
        log.warning("worker connection could not send: %s", sender.exception())
        ws.transport.abort()


# How long an engine asked to stop a request that records routing may take to end it (its
# Done brings the rows) before the request is cancelled outright.
_ABORT_SECONDS = 10.0


async def _abort_keeping_rows(engine: Engine, rid: str, task: asyncio.Task[None]) -> None:
    """End a running request through its engine, so that it finishes with a Done (and its
    routing rows) rather than being cut off without one."""
    try:
        await engine.abort(rid)
        await asyncio.wait({task}, timeout=_ABORT_SECONDS)
    finally:
        if not task.done():
            task.cancel()


def _forget(running: dict[str, asyncio.Task[None]], rid: str, task: object) -> None:
    # Only this task: a request continued after a weight update reuses its id.
    if running.get(rid) is task:
        del running[rid]


def _as_bytes(data: str | bytes) -> bytes:
    if isinstance(data, str):
        raise ProtocolError("expected a binary frame")
    return data
