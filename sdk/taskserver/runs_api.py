"""A ``TaskServer`` that speaks the run-submission API (``POST /api/v1/runs``): the
embedded ``rollout-relay task-server`` and existing deployments of the same API.

The task directory is shipped as a tar.gz in every submission; archives are cached per
directory (keyed by the files' sizes and modification times), since a training step submits
the same task many times. ``wait`` long-polls ``GET /api/v1/runs/{id}?wait=S``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import aiohttp

from sdk.exceptions import TaskDefinitionError, TaskServerError, TaskServerTimeoutError
from sdk.http import HttpClient
from sdk.taskserver.base import Fault, RunHandle, RunId, RunResult, RunSpec, RunStatus
from sdk.taskserver.tasks import pack_task

_ARCHIVE_CACHE_ENTRIES = 64
_POLL_SECONDS = 30.0  # one long-poll; the server holds the answer at most 60 s


def _signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    entries = []
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = Path(root) / name
            stat = full.lstat()
            entries.append((str(full.relative_to(path)), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(entries))


class RunsApiTaskServer(HttpClient):
    """Client of one run-submission API server; share one per process."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        request_timeout_seconds: float = 120.0,
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._request_timeout = request_timeout_seconds
        super().__init__(http)
        self._archives: OrderedDict[Path, tuple[tuple[Any, ...], bytes]] = OrderedDict()

    def __repr__(self) -> str:
        return f"<RunsApiTaskServer {self.url}>"

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers=self._headers)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        data: Any = None,
        timeout_seconds: float | None = None,
    ) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_seconds or self._request_timeout)
        try:
            async with self._session().request(
                method, f"{self.url}{path}", data=data, timeout=timeout, headers=self._headers
            ) as response:
                body = await response.read()
                status = response.status
                reason = response.reason
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TaskServerError(
                f"task server {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        payload: Any = None
        if body:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
        if status >= 400:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            message = str(error.get("message") or reason or "error")
            code = error.get("code")
            cls = TaskDefinitionError if code == "invalid_task" else TaskServerError
            raise cls(f"task server {self.url}: {status} {code or ''}: {message}".strip())
        return payload

    # ------------------------------------------------------------ archives

    def _archive(self, task: Path) -> bytes:
        key = task.resolve()
        signature = _signature(key) if key.is_dir() else ()
        cached = self._archives.get(key)
        if cached is not None and cached[0] == signature:
            self._archives.move_to_end(key)
            return cached[1]
        archive = pack_task(key)
        self._archives[key] = (signature, archive)
        while len(self._archives) > _ARCHIVE_CACHE_ENTRIES:
            self._archives.popitem(last=False)
        return archive

    # ------------------------------------------------------------ protocol

    async def submit(self, spec: RunSpec) -> RunHandle:
        archive = await asyncio.to_thread(self._archive, Path(spec.task))
        body = {
            "agent": spec.agent,
            "model": spec.model,
            "base_url": spec.base_url,
            "api_key": spec.api_key,
            "timeout_seconds": spec.timeout_seconds,
            "agent_settings": dict(spec.agent_settings),
        }
        form = aiohttp.FormData()
        form.add_field("spec", json.dumps(body), content_type="application/json")
        form.add_field(
            "task",
            archive,
            filename=f"{Path(spec.task).name}.tar.gz",
            content_type="application/gzip",
        )
        data = await self._request("POST", "/api/v1/runs", data=form)
        if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
            raise TaskServerError(f"task server {self.url}: no run_id in the answer")
        return RunHandle(RunId(data["run_id"]), self.url)

    async def status(self, handle: RunHandle, *, wait_seconds: float = 0.0) -> RunResult:
        """The run as it is now (or once finished, if that comes within ``wait_seconds``)."""
        query = f"?wait={wait_seconds:g}" if wait_seconds > 0 else ""
        data = await self._request(
            "GET",
            f"/api/v1/runs/{handle.run_id}{query}",
            timeout_seconds=self._request_timeout + wait_seconds,
        )
        return self._result(handle, data)

    async def wait(self, handle: RunHandle, *, timeout_seconds: float | None = None) -> RunResult:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_seconds is None else loop.time() + timeout_seconds
        while True:
            left = _POLL_SECONDS if deadline is None else deadline - loop.time()
            result = await self.status(handle, wait_seconds=max(0.0, min(_POLL_SECONDS, left)))
            if result.status.finished:
                return result
            if deadline is not None and loop.time() >= deadline:
                raise TaskServerTimeoutError(
                    f"run {handle.run_id} on {self.url} not finished after {timeout_seconds:g}s "
                    f"(still {result.status.value})"
                )

    async def cancel(self, handle: RunHandle) -> None:
        await self._request("POST", f"/api/v1/runs/{handle.run_id}/cancel")

    async def logs(self, handle: RunHandle, part: str | None = None) -> str:
        """The run's logs as text (``part``: "agent" or "verifier"; default both)."""
        query = f"?part={part}" if part else ""
        timeout = aiohttp.ClientTimeout(total=self._request_timeout)
        try:
            async with self._session().get(
                f"{self.url}/api/v1/runs/{handle.run_id}/logs{query}",
                timeout=timeout,
                headers=self._headers,
            ) as response:
                text = await response.text()
                if response.status >= 400:
                    raise TaskServerError(f"task server {self.url}: {response.status}: {text}")
                return text
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TaskServerError(f"task server {self.url} unreachable: {exc}") from exc

    async def forget(self, handle: RunHandle) -> None:
        """Stop the run if needed and delete it and its directory on the server."""
        await self._request("DELETE", f"/api/v1/runs/{handle.run_id}")

    def _result(self, handle: RunHandle, data: Any) -> RunResult:
        if not isinstance(data, dict):
            raise TaskServerError(f"task server {self.url}: the run is not a JSON object")
        try:
            status = RunStatus(data.get("status"))
        except ValueError:
            raise TaskServerError(
                f"task server {self.url}: unknown run status {data.get('status')!r}"
            ) from None
        rewards_raw = data.get("rewards") or {}
        if not isinstance(rewards_raw, dict):
            raise TaskServerError(f"task server {self.url}: rewards is not an object")
        try:
            rewards = {str(k): float(v) for k, v in rewards_raw.items()}
        except (TypeError, ValueError):
            raise TaskServerError(f"task server {self.url}: a reward is not a number") from None
        error = data.get("error")
        try:  # a server that does not say (or says something else) leaves it unknown
            fault = Fault(data.get("fault"))
        except ValueError:
            fault = None
        return RunResult(
            run_id=handle.run_id,
            status=status,
            rewards=rewards,
            error=None if error is None else str(error),
            logs=f"{self.url}/api/v1/runs/{handle.run_id}/logs",
            fault=fault,
        )
