"""The embedded task server (``rollout-relay task-server``): the run-submission API over
aiohttp, running Harbor-format tasks as local processes (``sdk.taskserver.local``).

Routes (JSON errors as ``{"error": {"message", "type", "code"}}``)::

    POST   /api/v1/runs                multipart: ``spec`` (JSON) + ``task`` (tar.gz) → 201 run
    GET    /api/v1/runs                the runs held, newest first
    GET    /api/v1/runs/{run_id}       the run; ``?wait=S`` holds the answer up to S seconds
                                       (at most 60) until it is finished
    POST   /api/v1/runs/{run_id}/cancel  stop it (idempotent; a finished run stays as it was)
    DELETE /api/v1/runs/{run_id}       stop it and forget it with its directory
    GET    /api/v1/runs/{run_id}/logs  ``?part=agent|verifier`` (default both), text
    GET    /healthz

A run: ``{"run_id", "status", "phase", "task", "agent", "rewards", "error",
"agent_exit_code", "verifier_exit_code", "created_at", "started_at", "finished_at"}``.

The ``spec`` part: ``{"agent", "model", "base_url", "api_key", "timeout_seconds"?,
"agent_settings"?: {"command"?: str, "env"?: {str: str}}}``.

A task archive runs code (its ``tests/test.sh``) on this machine, so the server is for the
trainer only: bind it to loopback or a private network and give it a ``--token``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import shortuuid
from aiohttp import BodyPartReader, web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sdk.exceptions import TaskDefinitionError
from sdk.taskserver.base import Fault, RunId, RunStatus
from sdk.taskserver.local import (
    LocalRun,
    LocalRunSpec,
    RunnerSettings,
    agent_command,
    execute,
    write_result,
)
from sdk.taskserver.tasks import unpack_task

log = logging.getLogger(__name__)

MAX_WAIT_SECONDS = 60.0
_MAX_SPEC_BYTES = 1024 * 1024


@dataclass(slots=True, frozen=True)
class TaskServerConfig:
    host: str = "127.0.0.1"
    port: int = 8090
    runs_dir: Path | None = None  # where run directories go (default: a temporary one)
    max_concurrent_runs: int = 2
    agents: Mapping[str, str] = field(default_factory=dict)  # name → shell command line
    token: str | None = None  # bearer token the API requires (None: open)
    max_archive_bytes: int = 64 * 1024 * 1024
    max_unpacked_bytes: int = 512 * 1024 * 1024
    keep_finished: int = 1000  # finished runs held; older ones are forgotten with their dirs
    kill_grace_seconds: float = 5.0


class AgentSettingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    command: str | None = Field(default=None, min_length=1)
    env: dict[str, str] = Field(default_factory=dict)


class RunSpecBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent: str = Field(min_length=1)
    model: str = Field(min_length=1)
    base_url: str = Field(min_length=1)
    api_key: str
    timeout_seconds: float = Field(default=1800.0, gt=0, le=7 * 24 * 3600)
    agent_settings: AgentSettingsBody = Field(default_factory=AgentSettingsBody)


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, error_type: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type or (
            "invalid_request_error" if status < 500 else "server_error"
        )


def _error(status: int, message: str, code: str, error_type: str = "") -> web.Response:
    exc = ApiError(status, message, code, error_type)
    return web.json_response(
        {"error": {"message": exc.message, "type": exc.error_type, "code": exc.code}},
        status=status,
    )


class TaskServer:
    """The runs held by one server process, and their execution."""

    def __init__(self, config: TaskServerConfig) -> None:
        if config.max_concurrent_runs < 1:
            raise ValueError("max_concurrent_runs must be at least 1")
        self.config = config
        self._own_dir: tempfile.TemporaryDirectory[str] | None = None
        if config.runs_dir is None:
            self._own_dir = tempfile.TemporaryDirectory(prefix="rollout-relay-runs-")
            self.runs_dir = Path(self._own_dir.name)
        else:
            self.runs_dir = config.runs_dir
            self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.runs: OrderedDict[RunId, LocalRun] = OrderedDict()
        self._tasks: dict[RunId, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(config.max_concurrent_runs)
        self._settings = RunnerSettings(
            agents=dict(config.agents), kill_grace_seconds=config.kill_grace_seconds
        )

    def __repr__(self) -> str:
        running = sum(run.status is RunStatus.RUNNING for run in self.runs.values())
        return f"<TaskServer runs={len(self.runs)} running={running} dir={self.runs_dir}>"

    # ------------------------------------------------------------ lifecycle of runs

    async def submit(self, spec: RunSpecBody, archive: bytes) -> LocalRun:
        run_id = RunId(shortuuid.uuid()[:16])
        run_dir = self.runs_dir / run_id
        try:
            task = await asyncio.to_thread(
                unpack_task,
                archive,
                run_dir / "task",
                max_unpacked_bytes=self.config.max_unpacked_bytes,
            )
        except TaskDefinitionError:
            await asyncio.to_thread(shutil.rmtree, run_dir, True)
            raise
        run = LocalRun(
            run_id=run_id,
            spec=LocalRunSpec(
                agent=spec.agent,
                model=spec.model,
                base_url=spec.base_url,
                api_key=spec.api_key,
                timeout_seconds=spec.timeout_seconds,
                command=spec.agent_settings.command,
                env=dict(spec.agent_settings.env),
            ),
            task=task,
            run_dir=run_dir,
        )
        try:
            agent_command(run, self._settings.agents)  # an unknown agent is refused now
        except TaskDefinitionError:
            await asyncio.to_thread(shutil.rmtree, run_dir, True)
            raise
        self.runs[run_id] = run
        self._tasks[run_id] = asyncio.get_running_loop().create_task(self._drive(run))
        self._evict_finished()
        log.info("run %s queued: task %s, agent %s", run_id, task.name, spec.agent)
        return run

    async def _drive(self, run: LocalRun) -> None:
        try:
            async with self._slots:
                if run.status.finished:  # cancelled while queued
                    return
                run.transition(RunStatus.RUNNING)
                await execute(run, self._settings)
        except asyncio.CancelledError:
            if not run.status.finished:
                run.error = run.error or "cancelled"
                run.transition(RunStatus.CANCELLED)
        except Exception as exc:  # a bug or an OS failure must not leave the run hanging
            log.exception("run %s failed unexpectedly", run.run_id)
            if not run.status.finished:
                run.error = f"task server error: {type(exc).__name__}: {exc}"
                run.fail(Fault.INFRA)
        finally:
            self._tasks.pop(run.run_id, None)
            if run.status.finished:
                write_result(run)
                log.info(
                    "run %s %s rewards=%s error=%s",
                    run.run_id,
                    run.status.value,
                    run.rewards,
                    run.error,
                )

    async def cancel(self, run: LocalRun) -> None:
        if run.status.finished:
            return
        if run.status is RunStatus.QUEUED:
            run.error = "cancelled"
            run.transition(RunStatus.CANCELLED)
        task = self._tasks.get(run.run_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.wait({task}))

    async def forget(self, run: LocalRun) -> None:
        await self.cancel(run)
        self.runs.pop(run.run_id, None)
        await asyncio.to_thread(shutil.rmtree, run.run_dir, True)

    def _evict_finished(self) -> None:
        finished = [run for run in self.runs.values() if run.status.finished]
        for run in finished[: max(0, len(finished) - self.config.keep_finished)]:
            self.runs.pop(run.run_id, None)
            shutil.rmtree(run.run_dir, ignore_errors=True)

    async def aclose(self) -> None:
        for run in list(self.runs.values()):
            await self.cancel(run)
        if self._own_dir is not None:
            await asyncio.to_thread(self._own_dir.cleanup)

    # ------------------------------------------------------------ logs

    def logs(self, run: LocalRun, part: str | None) -> str:
        parts = {
            "agent": run.run_dir / "logs" / "agent" / "output.txt",
            "verifier": run.run_dir / "logs" / "verifier" / "test-output.txt",
        }
        chosen = [part] if part else list(parts)
        out = []
        for name in chosen:
            path = parts[name]
            text = path.read_text(errors="replace") if path.is_file() else ""
            out.append(text if part else f"===== {name} =====\n{text}")
        return "\n".join(out)


TASK_SERVER = web.AppKey("task_server", TaskServer)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    config = request.app[TASK_SERVER].config
    if config.token and request.path != "/healthz":
        header = request.headers.get("Authorization", "")
        given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), config.token.encode()):
            return _error(401, "missing or wrong bearer token", "unauthorized", "auth_error")
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc.status, exc.message, exc.code, exc.error_type)
    except TaskDefinitionError as exc:
        return _error(400, str(exc), "invalid_task")
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _error(exc.status, exc.reason, "http_error")
        raise
    except Exception:
        log.exception("task server: unexpected error on %s %s", request.method, request.path)
        return _error(500, "internal error in the task server", "internal_error")


def _run_of(request: web.Request) -> LocalRun:
    run_id = RunId(request.match_info["run_id"])
    run = request.app[TASK_SERVER].runs.get(run_id)
    if run is None:
        raise ApiError(404, f"no run {run_id!r}", "run_not_found")
    return run


async def _read_part(part: BodyPartReader, limit: int, what: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(256 * 1024):
        data.extend(chunk)
        if len(data) > limit:
            raise ApiError(413, f"{what} is larger than {limit} bytes", "payload_too_large")
    return bytes(data)


async def create_run(request: web.Request) -> web.Response:
    server = request.app[TASK_SERVER]
    if not request.content_type.startswith("multipart/"):
        raise ApiError(
            400,
            "expected multipart/form-data with a `spec` (JSON) part and a `task` (tar.gz) part",
            "invalid_content_type",
        )
    spec_bytes: bytes | None = None
    archive: bytes | None = None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise ApiError(400, "nested multipart is not supported", "invalid_multipart")
            if part.name == "spec":
                spec_bytes = await _read_part(part, _MAX_SPEC_BYTES, "the spec part")
            elif part.name == "task":
                archive = await _read_part(part, server.config.max_archive_bytes, "the task")
            else:
                await part.release()
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise ApiError(400, f"malformed multipart body: {exc}", "invalid_multipart") from None
    if spec_bytes is None:
        raise ApiError(400, "the `spec` part (JSON) is missing", "missing_spec")
    if archive is None:
        raise ApiError(400, "the `task` part (a tar.gz of the task) is missing", "missing_task")
    try:
        spec = RunSpecBody.model_validate_json(spec_bytes)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        raise ApiError(400, f"invalid spec: {where}: {first['msg']}", "invalid_spec") from None
    run = await server.submit(spec, archive)
    return web.json_response(run.to_json(), status=201)


async def list_runs(request: web.Request) -> web.Response:
    runs = list(request.app[TASK_SERVER].runs.values())[::-1]
    return web.json_response({"runs": [run.to_json() for run in runs]})


async def get_run(request: web.Request) -> web.Response:
    run = _run_of(request)
    wait_text = request.query.get("wait")
    if wait_text is not None:
        try:
            wait = float(wait_text)
        except ValueError:
            raise ApiError(400, "wait must be a number of seconds", "invalid_wait") from None
        if not 0 <= wait < float("inf"):
            raise ApiError(400, "wait must be a number of seconds >= 0", "invalid_wait")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.finished.wait(), min(wait, MAX_WAIT_SECONDS))
    return web.json_response(run.to_json())


async def cancel_run(request: web.Request) -> web.Response:
    run = _run_of(request)
    await request.app[TASK_SERVER].cancel(run)
    return web.json_response(run.to_json())


async def delete_run(request: web.Request) -> web.Response:
    run = _run_of(request)
    await request.app[TASK_SERVER].forget(run)
    return web.Response(status=204)


async def run_logs(request: web.Request) -> web.Response:
    run = _run_of(request)
    part = request.query.get("part")
    if part not in {None, "agent", "verifier"}:
        raise ApiError(400, "part must be agent or verifier", "invalid_part")
    text = await asyncio.to_thread(request.app[TASK_SERVER].logs, run, part)
    return web.Response(text=text, content_type="text/plain")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(server: TaskServer) -> web.Application:
    app = web.Application(middlewares=[_errors])
    app[TASK_SERVER] = server
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/api/v1/runs", create_run)
    app.router.add_get("/api/v1/runs", list_runs)
    app.router.add_get("/api/v1/runs/{run_id}", get_run)
    app.router.add_post("/api/v1/runs/{run_id}/cancel", cancel_run)
    app.router.add_delete("/api/v1/runs/{run_id}", delete_run)
    app.router.add_get("/api/v1/runs/{run_id}/logs", run_logs)

    async def _close(app: web.Application) -> None:
        await app[TASK_SERVER].aclose()

    app.on_cleanup.append(_close)
    return app


@dataclass(slots=True)
class RunningTaskServer:
    runner: web.AppRunner
    url: str
    server: TaskServer

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_task_server(config: TaskServerConfig) -> RunningTaskServer:
    """Start the task server in this event loop (``port=0`` picks a free port)."""
    server = TaskServer(config)
    runner = web.AppRunner(build_app(server), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = config.port
    if port == 0:
        sockets = getattr(site._server, "sockets", None)
        assert sockets
        port = sockets[0].getsockname()[1]
    return RunningTaskServer(runner, f"http://{config.host}:{port}", server)


async def serve_forever(config: TaskServerConfig) -> None:
    """``rollout-relay task-server``: serve until SIGINT/SIGTERM, then cancel what runs."""
    import signal

    running = await start_task_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Before saying it listens: whoever waits for that line may signal at once.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"rollout-relay task server listening on {running.url}", flush=True)
    print(f"  runs in {running.server.runs_dir}", flush=True)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await running.stop()


def parse_agents(items: list[str]) -> dict[str, str]:
    """``NAME=COMMAND`` pairs (``--agent``) as a table; ValueError names a bad one."""
    agents = {}
    for item in items:
        name, sep, command = item.partition("=")
        if not sep or not name.strip() or not command.strip():
            raise ValueError(f"--agent {item!r}: expected NAME=COMMAND")
        agents[name.strip()] = command.strip()
    return agents
