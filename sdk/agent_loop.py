"""``RemoteAgentLoop``: one task, run by a real agent on a task server, turned into samples.

Framework-neutral: training-framework adapters (``sdk.verl``) wrap it. One call to
``RemoteAgentLoop.run(task)`` does, per attempt:

1. register a fresh trial on the proxy (``ProxyClient.create_session``);
2. submit the agent run to the task server with the trial's base URL and API key;
3. wait for it, at most ``timeout_seconds`` (then the run is cancelled);
4. on a run the policy ended (it succeeded, timed out or its agent failed): complete the
   session with the run's reward and outcome, fetch the trajectories, build samples with
   the configured branch policy and length limits;
5. delete the session, whatever happened.

A run's end is typed (``run_outcome``) as the trial's outcome. A run that timed out or whose
agent failed by itself is the policy's outcome: its trial is completed as ``timeout`` or
``agent_error`` (``budget_exhausted`` where the trial's budget was spent) with the reward the
verifier gave what the agent left, else ``failure_reward``, and its samples train. Without
either it is retried (a missing reward is never a zero), or with ``retry_without_reward``
off kept unrewarded. A run the infrastructure ended (the set-up, the sandbox, the model API,
the verifier, a cancel, a failure the task server does not explain) is retried, never
graded; so is a timeout or an agent failure on a trial whose requests the proxy answered
with a server error (its ``server_errors``: no worker, a worker lost): the agent may have
failed for want of the model.

A run retried is retried at most ``max_attempts`` times in all, each time on a NEW trial:
turns sampled during a failed attempt are deleted with its session and never
leak into the samples of the next one. A network fault on the way counts the same: the
proxy or a task server refusing the connection, dropping it, timing out or answering with
something that is not its API (a load balancer's HTML error page). Before each retry the
loop waits ``retry_backoff_seconds`` doubled per failed attempt, at most
``retry_backoff_max_seconds``, times a random factor in [0.5, 1] (episodes that failed
together do not come back together). When every attempt fails, ``RemoteAgentLoopError``
carries the attempts; no other exception leaves ``run`` (but cancellation).

Staleness: tokens sampled more than ``max_staleness`` versions (default 1) before the
current policy version are masked (``stale="mask"``) or drop their sample
(``stale="drop"``), see ``sdk.samples``. The current version is the one ``run`` is given
(a trainer that pushes its weights knows it), else the one the proxy's workers serve when
the samples are built (``GET /weights``); never older than the newest version among the
episode's own tokens. ``max_staleness=None`` turns the limit off.

Images: a vision-language episode's samples carry their images (``Sample.images``) with
their bytes, fetched from the proxy before the session is deleted.

Policy versions: a worker that reports the weights version it sampled with (turn
``extra["policy_version"]``, see ``worker_client.policy``) makes every sample carry the
versions of its turns (``Sample.policy_versions``).
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from sdk.client import ProxyClient, TrialSession
from sdk.exceptions import (
    ProxyRequestError,
    RemoteAgentLoopError,
    SdkError,
    SessionNotFoundError,
    TaskServerTimeoutError,
)
from sdk.samples import (
    DEFAULT_MAX_STALENESS,
    AgentSelection,
    BranchPolicy,
    InfraErrors,
    OverlongPrompt,
    Sample,
    SharedTurns,
    StaleTokens,
    build_samples,
    newest_version,
)
from sdk.taskserver.base import Fault, RunHandle, RunResult, RunSpec, RunStatus, TaskServer


class AttemptState(enum.Enum):
    """Where one attempt is. Moves forward only; ``DELETED`` is reached in all cases."""

    CREATED = "created"
    REGISTERED = "registered"  # a trial exists on the proxy
    SUBMITTED = "submitted"  # the task server accepted the run
    FINISHED = "finished"  # the run ended (any status)
    COLLECTED = "collected"  # reward posted, trajectories fetched, samples built
    DELETED = "deleted"  # the session is gone from the proxy


_ORDER = list(AttemptState)

# What an attempt may meet that is a failure of that attempt, not of the program: the SDK's
# own errors and, from a task server implemented elsewhere, the network's.
_ATTEMPT_FAULTS = (SdkError, aiohttp.ClientError, TimeoutError, ConnectionError)


def run_outcome(result: RunResult) -> str:
    """The trial outcome a finished run gives its episode: ``completed``; ``timeout`` (the
    agent, or the tests on what it left, ran out of time); ``agent_error`` (the agent failed
    by itself); else ``infra_error`` (a cancelled run, or a failure the task server lays on
    the infrastructure or does not explain)."""
    if result.status is RunStatus.SUCCEEDED:
        return "completed"
    if result.status is RunStatus.TIMED_OUT:
        return "timeout"
    if result.status is RunStatus.FAILED and result.fault is Fault.AGENT:
        return "agent_error"
    return "infra_error"


def retry_delay(failed: int, base: float, cap: float, jitter: float) -> float:
    """Seconds to wait after ``failed`` failed attempts: ``base`` doubled per failure
    after the first, at most ``cap``, times ``jitter`` (drawn in [0.5, 1])."""
    if failed < 1:
        return 0.0
    return float(min(cap, base * 2.0 ** (failed - 1)) * jitter)


@dataclass(slots=True, frozen=True)
class AgentLoopConfig:
    """How each task is run and turned into samples.

    ``agent``/``model``/``agent_settings`` go to the task server; ``sampling`` (temperature,
    top_p, top_k, seed, max_tokens) is the trial's sampling on the proxy, which overrides
    what the agent asks for. ``branch_policy``, ``shared_turns``, ``max_prompt_tokens`` /
    ``max_response_tokens``, ``overlong_prompt``, ``keep_undelivered`` (train replies
    the agent never received too), ``max_staleness`` (None: no limit) and ``stale``: see
    ``sdk.samples``. ``max_attempts`` and the ``retry_backoff_*`` settings: see the
    module docstring. ``routed_experts``: each trial records the experts a
    mixture-of-experts policy routed every token to (R3), and every sample carries them
    (``Sample.routed_experts``); an export without them fails the attempt. ``agents``,
    ``agent_kinds``, ``infra_error`` and ``failure_reward``: which agents' trajectories
    become samples and what an episode's outcome does (see ``sdk.samples``); an
    ``infra_error`` episode dropped fails the attempt, so it is retried. ``budget``: the
    trial's turn and token budget on the proxy (``{"turns": N, "tokens": M}``).
    """

    agent: str
    model: str = "policy"
    timeout_seconds: float = 1800.0
    max_attempts: int = 2
    branch_policy: BranchPolicy = BranchPolicy.ALL
    reward_key: str | None = None
    max_prompt_tokens: int | None = None
    max_response_tokens: int | None = None
    shared_turns: SharedTurns = SharedTurns.ONCE
    overlong_prompt: OverlongPrompt = OverlongPrompt.DROP
    sampling: Mapping[str, Any] | None = None
    agent_settings: Mapping[str, Any] = field(default_factory=dict)
    # A finished run without any reward: retry it (True) or keep its samples unrewarded.
    retry_without_reward: bool = True
    keep_undelivered: bool = False
    max_staleness: int | None = DEFAULT_MAX_STALENESS
    stale: StaleTokens = StaleTokens.MASK
    retry_backoff_seconds: float = 0.5
    retry_backoff_max_seconds: float = 8.0
    routed_experts: bool = False
    agents: AgentSelection = AgentSelection.ALL
    agent_kinds: frozenset[str] | None = None
    infra_error: InfraErrors = InfraErrors.DROP
    failure_reward: float | None = None
    budget: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be positive")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be at least 0 (or None: no limit)")
        if self.retry_backoff_seconds < 0 or self.retry_backoff_max_seconds < 0:
            raise ValueError("retry backoff seconds must not be negative")
        object.__setattr__(self, "branch_policy", BranchPolicy(self.branch_policy))
        object.__setattr__(self, "stale", StaleTokens(self.stale))
        object.__setattr__(self, "shared_turns", SharedTurns(self.shared_turns))
        object.__setattr__(self, "overlong_prompt", OverlongPrompt(self.overlong_prompt))


@dataclass(slots=True)
class Attempt:
    """One try at a task on its own trial."""

    number: int
    state: AttemptState = AttemptState.CREATED
    trial_id: str | None = None
    run: RunHandle | None = None
    result: RunResult | None = None
    error: str | None = None
    outcome: str | None = None  # how its run ended, as a trial outcome (``run_outcome``)
    started_at: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    def __repr__(self) -> str:
        return f"<Attempt {self.number} {self.state.value} trial={self.trial_id}>"

    def advance(self, state: AttemptState) -> None:
        if _ORDER.index(state) <= _ORDER.index(self.state):
            raise RuntimeError(f"attempt cannot go from {self.state.value} to {state.value}")
        self.state = state


@dataclass(slots=True)
class RolloutResult:
    """The outcome of one task: the samples of the successful attempt, and every attempt."""

    task: Path
    trial_id: str
    samples: list[Sample]
    reward: float | None
    rewards: Mapping[str, float]
    attempts: list[Attempt]
    timings: dict[str, float]  # seconds: "agent_run", "collect", "total"
    # The policy version staleness was measured against (None: no limit applied).
    current_version: int | None = None
    # How the episode ended (the trial's outcome): ``completed``, ``timeout``,
    # ``agent_error`` or ``budget_exhausted``.
    outcome: str = "completed"

    @property
    def policy_versions(self) -> list[int]:
        """Every distinct version among the samples' turns, sorted."""
        return sorted({v for s in self.samples for v in s.policy_versions if v is not None})


class RemoteAgentLoop:
    """Runs tasks through a task server against a proxy; share one per process."""

    def __init__(self, proxy: ProxyClient, task_server: TaskServer, config: AgentLoopConfig):
        self.proxy = proxy
        self.task_server = task_server
        self.config = config

    def __repr__(self) -> str:
        return f"<RemoteAgentLoop agent={self.config.agent} proxy={self.proxy.proxy_url}>"

    async def run(
        self,
        task: str | Path,
        *,
        metadata: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        current_version: int | None = None,
    ) -> RolloutResult:
        """Run ``task`` until one attempt succeeds (see the module docstring).

        ``sampling`` overrides the configured trial sampling for this task only;
        ``current_version`` is the policy version the trainer is at (None: ask the proxy).
        Raises ``RemoteAgentLoopError`` when every attempt failed.
        """
        cfg = self.config
        task_path = Path(task)
        started = time.monotonic()
        attempts: list[Attempt] = []
        for number in range(1, cfg.max_attempts + 1):
            if number > 1:
                await asyncio.sleep(
                    retry_delay(
                        number - 1,
                        cfg.retry_backoff_seconds,
                        cfg.retry_backoff_max_seconds,
                        random.uniform(0.5, 1.0),
                    )
                )
            attempt = Attempt(number)
            attempts.append(attempt)
            outcome = await self._attempt(attempt, task_path, metadata, sampling, current_version)
            if outcome is not None:
                samples, rewards, reward, timings, version = outcome
                timings["total"] = time.monotonic() - started
                assert attempt.trial_id is not None
                assert attempt.outcome is not None
                return RolloutResult(
                    task_path,
                    attempt.trial_id,
                    samples,
                    reward,
                    rewards,
                    attempts,
                    timings,
                    version,
                    attempt.outcome,
                )
        raise RemoteAgentLoopError(
            f"{task_path}: all {len(attempts)} attempts failed: "
            + "; ".join(f"#{a.number}: {a.error}" for a in attempts),
            attempts,
        )

    async def _attempt(
        self,
        attempt: Attempt,
        task: Path,
        metadata: Mapping[str, Any] | None,
        sampling: Mapping[str, Any] | None,
        current_version: int | None,
    ) -> (
        tuple[list[Sample], Mapping[str, float], float | None, dict[str, float], int | None] | None
    ):
        cfg = self.config
        trial: TrialSession | None = None
        try:
            trial = await self.proxy.create_session(
                metadata={**(metadata or {}), "task": str(task), "attempt": attempt.number},
                sampling=dict(sampling or cfg.sampling or {}) or None,
                model=None,
                routed_experts=cfg.routed_experts,
                budget=dict(cfg.budget) if cfg.budget else None,
            )
            attempt.trial_id = trial.trial_id
            attempt.advance(AttemptState.REGISTERED)
            spec = RunSpec(
                task=task,
                agent=cfg.agent,
                model=cfg.model,
                base_url=trial.base_url,
                api_key=trial.api_key,
                timeout_seconds=cfg.timeout_seconds,
                agent_settings=dict(cfg.agent_settings),
            )
            run_started = time.monotonic()
            attempt.run = await self.task_server.submit(spec)
            attempt.advance(AttemptState.SUBMITTED)
            result = await self._wait(attempt.run)
            attempt.result = result
            attempt.advance(AttemptState.FINISHED)
            agent_seconds = time.monotonic() - run_started
            ended = run_outcome(result)
            rewards = dict(result.rewards)
            why = f"run {result.status.value}: {result.error or 'no detail'}"
            spent = False  # the trial's budget (the proxy's outcome then)
            if ended != "completed" and ended != "infra_error":
                summary = await self.proxy.get_session(trial.trial_id)
                if summary.get("server_errors"):
                    ended = "infra_error"
                    why += (
                        f", after the proxy answered {summary['server_errors']} of the "
                        "trial's requests with a server error"
                    )
                spent = summary.get("outcome") == "budget_exhausted"
            attempt.outcome = ended
            if ended == "infra_error":
                attempt.error = f"{why} (not the policy's doing)"
                return None
            if ended == "completed" and not rewards and cfg.retry_without_reward:
                attempt.error = "the run produced no reward"
                return None
            if (
                ended != "completed"
                and not rewards
                and cfg.failure_reward is None
                and cfg.retry_without_reward
            ):
                attempt.error = f"{why}; no reward to train it with (see failure_reward)"
                return None
            collect_started = time.monotonic()
            given = None if ended == "completed" or spent else ended
            await self.proxy.complete(trial.trial_id, rewards or None, outcome=given)
            export = await self.proxy.trajectories(trial.trial_id)
            attempt.outcome = str(export.get("outcome") or ended)
            version = await self._current_version(export, current_version)
            samples = build_samples(
                export,
                policy=cfg.branch_policy,
                reward_key=cfg.reward_key,
                max_prompt_tokens=cfg.max_prompt_tokens,
                max_response_tokens=cfg.max_response_tokens,
                shared_turns=cfg.shared_turns,
                overlong_prompt=cfg.overlong_prompt,
                keep_undelivered=cfg.keep_undelivered,
                current_version=version,
                max_staleness=cfg.max_staleness or 0,
                stale=cfg.stale,
                agents=cfg.agents,
                kinds=cfg.agent_kinds,
                infra_error=cfg.infra_error,
                failure_reward=cfg.failure_reward,
            )
            if not samples:
                attempt.error = _why_no_samples(export, cfg, version)
                return None
            if cfg.routed_experts and any(s.routed_experts is None for s in samples):
                attempt.error = (
                    "the session asked for routed_experts but the export has none: the "
                    "proxy or its worker's engine does not record routing"
                )
                return None
            # The images' bytes, before the session (and its images) is deleted.
            await self.proxy.fill_images(trial.trial_id, samples)
            attempt.advance(AttemptState.COLLECTED)
            timings = {
                "agent_run": agent_seconds,
                "collect": time.monotonic() - collect_started,
            }
            return samples, rewards, samples[0].reward, timings, version
        except _ATTEMPT_FAULTS as exc:
            attempt.error = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            attempt.seconds = time.monotonic() - attempt.started_at
            if trial is not None:
                await self._delete(trial.trial_id, attempt)

    async def _current_version(self, export: dict[str, Any], given: int | None) -> int | None:
        """The version staleness is measured against (None: no limit): the one given, or
        the one the workers serve now; never below the newest of the episode's tokens,
        which some worker served already (versions only increase)."""
        if self.config.max_staleness is None:
            return None
        known = given
        if known is None:
            try:
                known = int((await self.proxy.weights())["version"])
            except ProxyRequestError:
                known = None  # a proxy without the weights API: the tokens say it
        newest = newest_version(export)
        candidates = [v for v in (known, newest) if v is not None]
        return max(candidates) if candidates else None

    async def _wait(self, handle: RunHandle) -> RunResult:
        try:
            return await self.task_server.wait(handle, timeout_seconds=self.config.timeout_seconds)
        except TaskServerTimeoutError:
            await self.task_server.cancel(handle)
            return RunResult(
                handle.run_id,
                RunStatus.TIMED_OUT,
                error=f"no result within {self.config.timeout_seconds:g}s; cancelled",
            )
        except asyncio.CancelledError:
            # The caller gave up (e.g. the trainer stopped): stop the agent too.
            await asyncio.shield(self.task_server.cancel(handle))
            raise

    async def _delete(self, trial_id: str, attempt: Attempt) -> None:
        try:
            await asyncio.shield(self.proxy.delete(trial_id))
        except SessionNotFoundError:
            pass  # already gone: the goal is reached
        except ProxyRequestError as exc:
            if not (exc.status == 409 and "deleted" in exc.message):
                attempt.error = attempt.error or f"delete failed: {exc}"
                return
        except (*_ATTEMPT_FAULTS, OSError) as exc:
            if attempt.error is None:
                attempt.error = f"delete failed: {exc}"
            return
        attempt.advance(AttemptState.DELETED)


def _why_no_samples(export: dict[str, Any], cfg: AgentLoopConfig, version: int | None) -> str:
    if not export.get("trajectories"):
        return "the agent made no model call through the proxy"
    if export.get("outcome") == "infra_error" and cfg.infra_error is InfraErrors.DROP:
        return "the episode ended in an infra error (not the policy's doing): dropped"
    if not build_samples(export, agents=cfg.agents, kinds=cfg.agent_kinds):
        return f"no trajectory of the agents kept (agents={cfg.agents}, kinds={cfg.agent_kinds})"
    if not build_samples(export, keep_undelivered=cfg.keep_undelivered):
        return (
            "no reply reached the agent (every turn was undelivered or superseded by a "
            "retry), or every trajectory's first turn was sampled after a routing row the "
            "engine could not give"
        )
    if version is not None and not build_samples(
        export,
        keep_undelivered=cfg.keep_undelivered,
        current_version=version,
        max_staleness=cfg.max_staleness or 0,
        stale=cfg.stale,
    ):
        return (
            f"every trajectory holds a token more than max_staleness={cfg.max_staleness} "
            f"versions older than version {version} (dropped: stale=drop)"
        )
    return (
        f"every trajectory's prompt is over max_prompt_tokens="
        f"{cfg.max_prompt_tokens} (dropped: overlong_prompt=drop)"
    )
