"""A ``TaskServer`` that drives a real Harbor through the launcher inside ``harbor view``.

Targets Harbor 0.24.0 (PyPI ``harbor``, Python >= 3.12; 0.25.0 does not install on this
project's reference machine). Start the launcher next to the tasks::

    HARBOR_TELEMETRY=0 harbor view <jobs dir> --jobs --host 127.0.0.1 --port 8091 --no-build

Each submission is one Harbor job with one trial: ``POST /api/run`` with a JobConfig
(agent by ``name``, or by ``import_path`` when the agent contains ``:``; the trial's
endpoint in the agent's ``env``; the task by ``path``, which must exist on the Harbor
host); ``GET /api/run/{job}/status`` while it runs; then the trial's result
(``GET /api/jobs/{job}/trials`` and ``/trials/{trial}``, a TrialResult): rewards from
``verifier_result.rewards``, the error from ``exception_info``. ``DELETE /api/run/{job}``
cancels. A launch that fails before any trial (no container runtime, an unknown agent)
is FAILED with the end of Harbor's log as the error.

``agent_settings`` keys: ``env`` (more agent environment), ``kwargs`` (agent kwargs),
``model_name`` (default: the spec's model), ``environment`` (a Harbor EnvironmentConfig,
default the server's), ``override_timeout_sec``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import shortuuid

from sdk.exceptions import TaskServerError, TaskServerTimeoutError
from sdk.http import HttpClient
from sdk.taskserver.base import Fault, RunHandle, RunId, RunResult, RunSpec, RunStatus

HARBOR_VERSION = "0.24.0"
_POLL_SECONDS = 1.0
_LOG_TAIL_LINES = 12


def trial_environment(spec: RunSpec) -> dict[str, str]:
    """The trial's endpoint under the names Harbor's agents read (OpenAI-style agents take
    the ``/v1`` base URL; Claude Code appends ``/v1/messages`` itself; OpenHands reads
    ``LLM_*``; mini-swe-agent ``MSWEA_API_KEY``)."""
    anthropic_base = spec.base_url.rstrip("/").removesuffix("/v1")
    return {
        "OPENAI_BASE_URL": spec.base_url,
        "OPENAI_API_BASE": spec.base_url,
        "OPENAI_API_KEY": spec.api_key,
        "ANTHROPIC_BASE_URL": anthropic_base,
        "ANTHROPIC_API_KEY": spec.api_key,
        "LLM_BASE_URL": spec.base_url,
        "LLM_API_KEY": spec.api_key,
        "MSWEA_API_KEY": spec.api_key,
    }


def job_config(spec: RunSpec, job_name: str, environment: Mapping[str, Any]) -> dict[str, Any]:
    """The JobConfig (as JSON) of one trial of ``spec``."""
    settings = dict(spec.agent_settings)
    agent: dict[str, Any] = (
        {"import_path": spec.agent} if ":" in spec.agent else {"name": spec.agent}
    )
    agent["model_name"] = str(settings.get("model_name", spec.model))
    agent["env"] = {**trial_environment(spec), **dict(settings.get("env", {}))}
    if settings.get("kwargs"):
        agent["kwargs"] = dict(settings["kwargs"])
    agent["override_timeout_sec"] = float(
        settings.get("override_timeout_sec", spec.timeout_seconds)
    )
    return {
        "job_name": job_name,
        "n_attempts": 1,
        "n_concurrent_trials": 1,
        "quiet": True,
        "agents": [agent],
        "environment": dict(settings.get("environment", environment)),
        "tasks": [{"path": str(spec.task)}],
    }


# Harbor's exception types (a TrialResult's ``exception_info.exception_type``, the class
# name) by whose doing they are. Running out of time, the agent's or the tests' on what it
# left, is the policy's; so is an agent that failed by itself or whose context or reply
# outgrew the model's limits. Anything else is not the policy's doing: the model API
# failing (Harbor's other ``ApiError`` kinds), the sandbox or the agent's set-up (their
# timeouts included), the verifier's reward file, and a type this list does not know.
HARBOR_TIMEOUTS = frozenset({"AgentTimeoutError", "VerifierTimeoutError"})
HARBOR_AGENT_FAULTS = frozenset(
    {
        "NonZeroAgentExitCodeError",
        "ContextWindowExceededError",
        "OutputTokenExceededError",
        "AgentSafetyRefusalError",
        "ContextLengthExceededError",
        "OutputLengthExceededError",
    }
)


def result_from_trial(run_id: RunId, trial: Mapping[str, Any], logs: str | None) -> RunResult:
    """A RunResult from Harbor's TrialResult JSON: a reward the verifier gave what the
    agent left counts where the agent's own doing ended the run, never where the
    infrastructure's did (that run FAILED, ``Fault.INFRA``, to be retried)."""
    verifier = trial.get("verifier_result") or {}
    raw = verifier.get("rewards") or {}
    rewards = {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float)}
    exception = trial.get("exception_info") or None
    if not exception:
        if rewards:
            return RunResult(run_id, RunStatus.SUCCEEDED, rewards, logs=logs)
        error = "Harbor's verifier produced no reward"
        return RunResult(run_id, RunStatus.FAILED, error=error, logs=logs, fault=Fault.INFRA)
    kind = str(exception.get("exception_type", ""))
    error = f"{kind}: {exception.get('exception_message')}"
    if kind in HARBOR_TIMEOUTS:
        return RunResult(run_id, RunStatus.TIMED_OUT, rewards, error, logs)
    if kind in HARBOR_AGENT_FAULTS:  # its reward, if any: the verifier's of what it left
        return RunResult(run_id, RunStatus.FAILED, rewards, error, logs, fault=Fault.AGENT)
    return RunResult(run_id, RunStatus.FAILED, rewards, error, logs, fault=Fault.INFRA)


class HarborLauncherTaskServer(HttpClient):
    """Client of one ``harbor view`` launcher; share one per process."""

    def __init__(
        self,
        url: str,
        *,
        environment: Mapping[str, Any] | None = None,
        request_timeout_seconds: float = 60.0,
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.environment = dict(environment or {"type": "docker"})
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_seconds)
        super().__init__(http)
        self._cancelled: set[RunId] = set()

    def __repr__(self) -> str:
        return f"<HarborLauncherTaskServer {self.url}>"

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=self._timeout)

    async def _request(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        try:
            async with self._session().request(
                method, f"{self.url}{path}", json=payload
            ) as response:
                body = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TaskServerError(
                f"Harbor launcher {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = body.decode(errors="replace")
        return status, data

    @staticmethod
    def _detail(data: Any) -> str:
        if isinstance(data, dict) and "detail" in data:
            return str(data["detail"])
        return str(data)[:500]

    async def submit(self, spec: RunSpec) -> RunHandle:
        job_name = f"rr-{shortuuid.uuid()[:12]}"
        status, data = await self._request(
            "POST", "/api/run", job_config(spec, job_name, self.environment)
        )
        if status >= 400:
            raise TaskServerError(f"Harbor refused the run ({status}): {self._detail(data)}")
        if not isinstance(data, dict) or not isinstance(data.get("job_name"), str):
            raise TaskServerError(f"Harbor launcher {self.url}: no job_name in the answer")
        return RunHandle(RunId(data["job_name"]), self.url)

    async def status(self, handle: RunHandle) -> RunResult:
        """The run now: RUNNING while ``harbor run`` is alive, then the trial's result."""
        job = handle.run_id
        code, launch = await self._request("GET", f"/api/run/{job}/status")
        if code >= 400 or not isinstance(launch, dict):
            raise TaskServerError(f"Harbor launcher: status of {job}: {self._detail(launch)}")
        logs = f"{self.url}/api/jobs/{job}"
        if launch.get("running"):
            return RunResult(run_id=job, status=RunStatus.RUNNING, logs=logs)
        if job in self._cancelled:
            return RunResult(run_id=job, status=RunStatus.CANCELLED, error="cancelled", logs=logs)
        trial = await self._trial(job)
        if trial is not None:
            return result_from_trial(job, trial, logs)
        tail = str(launch.get("log_tail") or "").strip().splitlines()[-_LOG_TAIL_LINES:]
        returncode = launch.get("returncode")
        if returncode is None and not launch.get("job_ready"):
            raise TaskServerError(f"Harbor launcher does not know the run {job}")
        return RunResult(
            run_id=job,
            status=RunStatus.FAILED,
            error=f"harbor run exited with code {returncode} before a trial result: "
            + (" | ".join(tail) or "(no log)"),
            logs=logs,
            fault=Fault.INFRA,
        )

    async def _trial(self, job: str) -> dict[str, Any] | None:
        code, listing = await self._request("GET", f"/api/jobs/{job}/trials")
        if code == 404 or not isinstance(listing, dict):
            return None
        items = listing.get("items") or []
        if not items:
            return None
        name = items[0].get("name")
        code, trial = await self._request("GET", f"/api/jobs/{job}/trials/{name}")
        return trial if code == 200 and isinstance(trial, dict) else None

    async def wait(self, handle: RunHandle, *, timeout_seconds: float | None = None) -> RunResult:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_seconds is None else loop.time() + timeout_seconds
        while True:
            result = await self.status(handle)
            if result.status.finished:
                return result
            if deadline is not None and loop.time() >= deadline:
                raise TaskServerTimeoutError(
                    f"Harbor job {handle.run_id} not finished after {timeout_seconds:g}s"
                )
            pause = (
                _POLL_SECONDS if deadline is None else min(_POLL_SECONDS, deadline - loop.time())
            )
            await asyncio.sleep(max(pause, 0.0))

    async def cancel(self, handle: RunHandle) -> None:
        code, data = await self._request("DELETE", f"/api/run/{handle.run_id}")
        if code == 200:
            self._cancelled.add(handle.run_id)
        elif code != 404:  # 404: not running (finished or unknown): nothing to stop
            raise TaskServerError(f"Harbor launcher: cancel {handle.run_id}: {self._detail(data)}")
