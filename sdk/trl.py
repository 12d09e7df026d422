"""TRL adapter: ``trl.GRPOTrainer(rollout_func=RelayRollout(...), reward_funcs=relay_reward)``.

TRL (1.16) calls ``rollout_func(prompts, trainer)`` once per generation batch, with every
prompt already repeated ``num_generations`` times in a row, and expects one completion per
element of ``prompts``, in order. ``RelayRollout`` answers with one agent episode per
prompt, run through ``sdk.agent_loop.RemoteAgentLoop`` (a task server, or an in-process
agent callable through ``sdk.taskserver.inprocess``) against the proxy:

* ``prompt_ids`` / ``completion_ids`` / ``logprobs``: the exact ids and logprobs the worker
  sampled (the first prompt, then every turn and the context between turns);
* ``env_mask``: the response mask (1 = sampled by the policy, 0 = tool results and other
  context between turns); TRL trains only where it is 1;
* ``relay_reward``: the episode's reward, for the reward function ``relay_reward`` (TRL
  forwards every extra key to the reward functions as a keyword argument);
* ``relay_versions``: per completion token, the weights version that sampled it (-1 where
  the mask is 0); ``relay_trial_id``: the trial each completion came from;
  ``relay_agent`` and ``relay_agent_kind``: the agent whose trajectory it is (TRL takes
  one completion per prompt: the main agent's where the trial has sub-agents).

One completion per prompt: GRPOTrainer scores and groups exactly ``len(prompts)``
completions, so each episode gives ``sdk.samples.main_sample``'s, the main agent's chain
that ends in its answer. An episode the main agent started over in (a new root after a
compaction: several segments, see ``sdk.segments``) trains its last segment only; the
earlier ones are not trained, counted in ``RolloutBatch.untrained_segments`` and logged as
a warning. Sub-agents' samples are not trained either. Train every segment through a
trainer that takes several samples per episode (``build_samples`` gives one per segment).

The prompt is a task reference: ``task_of(prompt)`` gives the task handed to the agent
loop (by default the prompt itself, a task directory). TRL passes nothing but the prompts
to a ``rollout_func``, so the dataset's ``prompt`` column names the task.

Weights: the worker must sample step N's batch with the weights of step N. The first call
asks the proxy which version it serves (``GET /weights``); at the start of every call,
when ``trainer.state.global_step`` has moved past the served version, the
trainer's model is saved to ``<checkpoint_dir>/step-<N>`` (a fresh directory, written
atomically) and the proxy is told to serve it (``POST /weights`` with version N) before
anything is sampled. Version 0 is the weights the workers started with, which must be the
trainer's initial model. With one generation batch per optimizer step (TRL's default:
``steps_per_generation`` equal to ``gradient_accumulation_steps``) every sampled token of
step N then carries version N; ``RolloutBatch`` lets a caller check it, and measures the
on-policy gap (recorded logprobs against the trainer's own teacher forcing).

TRL's ``rollout_func`` is synchronous and called from inside ``trainer.train()``, while the
SDK is asyncio code whose connections (and possibly the proxy and worker themselves) must
live between calls: ``BackgroundLoop`` runs one event loop on a daemon thread for all of
it, and the rollout blocks on it. The trainer waits while episodes run and the worker
idles while the trainer steps, so the two do not compete for the CPU.

TRL's own weight sync (``VLLMClient``) needs NCCL and CUDA; this one needs only storage the
workers can read. With ``use_vllm=False`` TRL takes the ratio's old logprobs from its own
forward pass; the recorded ones serve ``off_policy_mask_threshold`` and the gap check.

Staleness: every episode's samples are built against the version this rollout last made
the workers serve (the step), so a token more than the agent loop's ``max_staleness``
(default 1) versions older is masked out of ``env_mask`` (see ``sdk.samples``).

Several processes (``accelerate launch``): TRL calls the rollout in every process with its
own share of the prompts, so each process runs its own episodes (its own
``BackgroundLoop`` and proxy client). The weights are pushed once: every process takes
part in ``accelerator.get_state_dict`` (which gathers the full weights under ZeRO-3 and
FSDP), the main process alone saves them and tells the proxy, and every process waits for
it (``accelerator.wait_for_everyone``) before sampling; a process other than the main one
then checks with the proxy that the version is served. Every process decides from the
same facts (the step, and the version the proxy served before anyone pushed), so they all
take the same path.

Not with TRL's own tools: given ``tools=`` (or ``environment_factory``), GRPOTrainer runs
its own tool loop over what the rollout returns (parsing tool calls out of the completion,
calling the tools, generating again) and ignores ``env_mask``, so tool results would be
trained as the policy's own tokens. The agent does its tool calls through the proxy
instead; the rollout refuses a trainer with tools.

Images: not with a vision-language episode. TRL 1.16's ``rollout_func`` returns ids,
logprobs and per-completion extras (forwarded to the reward functions only); the pixels of
its forward come from the dataset's ``image``/``images`` columns run through its processor
with the dataset prompt, never from what the rollout returns. The images an agent sent
during an episode cannot reach TRL's forward, which would train their placeholder tokens
without their pixels: ``rollout_output`` refuses a sample with images
(``VisionRolloutError``). Train vision-language agents through the verl adapter.

Routing replay (R3, a mixture-of-experts policy): with an agent loop whose config asks
for ``routed_experts``, every episode's sample carries the experts the worker's engine
routed each token to, and the rollout installs ``sdk.routing.BatchReplay`` on the
trainer's model (once) and registers each batch's sequences with their rows. Every
forward TRL then runs (the old logprobs and the loss, padded, shuffled and chunked as TRL
likes, recomputed under gradient checkpointing) has its routers forced to the recorded
experts of the sequences it runs; the gate weights of those experts, and their gradients,
still come from the trainer. Nothing of TRL is patched: a forward pre-hook on the model
finds each sequence by its ids. ``measure_gap`` then measures the gap both with the
model's own routing and replayed (``RolloutBatch.gap`` / ``gap_r3``, and their means).

Memory: ``history`` keeps the last ``keep_batches`` batches (default 1), for inspection and
``on_batch``; a caller that needs every step's figures records them in ``on_batch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sdk.agent_loop import RemoteAgentLoop, RolloutResult
from sdk.client import ProxyClient
from sdk.exceptions import RoutingReplayError, VisionRolloutError
from sdk.routing import BatchReplay
from sdk.samples import BranchPolicy, Sample, main_sample, untrained_segments

log = logging.getLogger(__name__)

T = TypeVar("T")

REWARD_KEY = "relay_reward"
# Each episode's agent (the trial's main agent, "main", or a sub-agent) and its kind.
AGENT_KEY = "relay_agent"
AGENT_KIND_KEY = "relay_agent_kind"
VERSIONS_KEY = "relay_versions"
TRIAL_KEY = "relay_trial_id"
CHECKPOINT_PREFIX = "step-"


class BackgroundLoop:
    """An asyncio event loop on a daemon thread; ``run(coro)`` blocks until it is done."""

    def __init__(self, name: str = "relay-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<BackgroundLoop {self._thread.name} running={self.loop.is_running()}>"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result (its exception is raised here)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BackgroundLoop.run called from its own thread would deadlock")
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def needs_push(served_version: int, global_step: int) -> bool:
    """Whether the trainer's weights moved since the version the workers serve."""
    if global_step < served_version:
        raise ValueError(
            f"the trainer is at step {global_step} but the workers serve version "
            f"{served_version}: versions only increase (a resumed run must start from the "
            "served version or later)"
        )
    return global_step != served_version


def token_versions(sample: Sample) -> list[int]:
    """Per response token, the weights version that sampled it (-1 where the mask is 0)."""
    return list(sample.response_versions)


def off_step_tokens(sample: Sample, step: int) -> int:
    """How many trained tokens (mask 1) of ``sample`` were not sampled by version ``step``."""
    return sum(
        1
        for v, m in zip(token_versions(sample), sample.response_mask, strict=True)
        if m and v != step
    )


def teacher_forced_logprobs(
    model: Any, prompt_ids: Sequence[int], response_ids: Sequence[int]
) -> list[float]:
    """The model's logprob of each response id given everything before it, in float32."""
    import torch

    ids = torch.tensor([[*prompt_ids, *response_ids]], dtype=torch.long, device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt_ids) - 1
    scores = torch.log_softmax(logits[start : start + len(response_ids)], dim=-1)
    target = ids[0, len(prompt_ids) :].unsqueeze(-1)
    return [float(x) for x in scores.gather(-1, target).squeeze(-1)]


@dataclass(slots=True, frozen=True)
class Gap:
    """|recorded − teacher-forced| logprob over the sampled (mask 1) tokens."""

    largest: float
    mean: float
    tokens: int


def gap_of(model: Any, samples: Sequence[Sample]) -> Gap:
    """The on-policy gap of ``samples`` under ``model`` as it runs (with its routers
    forced, when a ``BatchReplay`` is installed on it and not paused)."""
    was_training = bool(model.training)
    model.eval()  # no dropout: the same function the worker sampled from
    try:
        worst, total, tokens = 0.0, 0.0, 0
        for sample in samples:
            scored = teacher_forced_logprobs(model, sample.prompt_ids, sample.response_ids)
            for m, recorded, actual in zip(
                sample.response_mask, sample.response_logprobs, scored, strict=True
            ):
                if m:
                    error = abs(recorded - actual)
                    worst, total, tokens = max(worst, error), total + error, tokens + 1
        return Gap(worst, total / tokens if tokens else 0.0, tokens)
    finally:
        model.train(was_training)


def on_policy_gap(model: Any, samples: Sequence[Sample]) -> float:
    """The largest |recorded − teacher-forced| logprob over the sampled (mask 1) tokens."""
    return gap_of(model, samples).largest


def relay_reward(
    completions: Sequence[Any], relay_reward: Sequence[float | None], **_: Any
) -> list[float | None]:
    """The reward function for ``GRPOTrainer(reward_funcs=...)``: each episode's reward as
    ``RelayRollout`` forwarded it (None, for an unrewarded episode, becomes NaN in TRL)."""
    if len(relay_reward) != len(completions):
        raise ValueError(f"{len(relay_reward)} rewards for {len(completions)} completions")
    return [None if r is None else float(r) for r in relay_reward]


@dataclass(slots=True, frozen=True)
class WeightPush:
    version: int
    path: Path
    seconds: float  # saving plus POST /weights until every worker served it
    answer: Mapping[str, Any]  # the proxy's answer: {"version", "path", "workers"}


@dataclass(slots=True)
class RolloutBatch:
    """One call of the rollout: the step it sampled for and what came back."""

    step: int  # trainer.state.global_step when sampled: the weights version pushed for it
    results: list[RolloutResult]
    samples: list[Sample]  # one per prompt, in TRL's order
    seconds: float  # running the episodes
    push: WeightPush | None = None
    gap: float | None = None  # on_policy_gap under the trainer's model of this step
    gap_seconds: float = 0.0
    gap_mean: float | None = None  # the mean |recorded − teacher-forced| over sampled tokens
    # The same with the routers forced to the recorded experts (R3; None: no routing).
    gap_r3: float | None = None
    gap_r3_mean: float | None = None
    # Segments of the main agent's episodes left untrained (one completion per prompt:
    # the last segment of an episode that started over after a compaction trains).
    untrained_segments: int = 0

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    @property
    def mean_reward(self) -> float:
        values = [r for r in self.rewards if r is not None]
        return sum(values) / len(values) if values else float("nan")

    @property
    def versions(self) -> list[int]:
        """Every distinct version among the trained tokens, sorted."""
        return sorted(
            {
                v
                for s in self.samples
                for v, m in zip(token_versions(s), s.response_mask, strict=True)
                if m
            }
        )

    @property
    def off_step_tokens(self) -> int:
        return sum(off_step_tokens(s, self.step) for s in self.samples)

    @property
    def sampled_tokens(self) -> int:
        return sum(s.sampled_tokens for s in self.samples)


@dataclass(slots=True)
class RelayRollout:
    """TRL's ``rollout_func``: one agent episode per prompt, the weights pushed per step.

    ``loop`` runs the SDK's coroutines; ``proxy`` needs the admin token when the proxy has
    one (``POST /weights``). ``checkpoint_dir`` must be readable by every worker at the
    same path; ``keep_checkpoints`` of them are kept (the served one always).
    ``measure_gap`` teacher-forces every batch with the trainer's model (a forward pass
    over the batch) and records ``RolloutBatch.gap``; ``on_batch`` sees each batch.
    """

    loop: BackgroundLoop
    proxy: ProxyClient
    agent_loop: RemoteAgentLoop
    checkpoint_dir: Path
    task_of: Callable[[Any], str | Path] = str
    max_concurrent: int = 16
    keep_checkpoints: int = 2
    measure_gap: bool = False
    on_batch: Callable[[RolloutBatch], None] | None = None
    # The version the workers serve; None until the proxy has been asked (first call).
    served_version: int | None = None
    keep_batches: int = 1
    # The last ``keep_batches`` batches, newest last.
    history: deque[RolloutBatch] = field(default_factory=deque)
    # R3: installed on the trainer's model at the first batch when the agent loop asks
    # for routing (see the module docstring).
    replay: BatchReplay | None = None

    def __post_init__(self) -> None:
        if self.agent_loop.config.branch_policy is BranchPolicy.ALL:
            raise ValueError(
                "TRL takes one completion per prompt: use branch_policy longest or last"
            )
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be at least 1")
        if self.keep_batches < 0:
            raise ValueError("keep_batches must be at least 0")
        self.history = deque(self.history, maxlen=self.keep_batches)

    def __repr__(self) -> str:
        return f"<RelayRollout version={self.served_version} batches={len(self.history)}>"

    # ------------------------------------------------------------------ weights

    def sync_weights(self, trainer: Any) -> WeightPush | None:
        """Push the trainer's weights when its step moved since the served version (in
        every process together: see the module docstring)."""
        accelerator = trainer.accelerator
        step = int(trainer.state.global_step)
        if self.served_version is None:
            # A proxy that already serves a later version (another run's) refuses this
            # run's versions rather than sampling with weights the trainer never had.
            self.served_version = self._proxy_version()
            # Nobody pushes before every process has read the version: they all decide
            # the same below.
            accelerator.wait_for_everyone()
        if not needs_push(self.served_version, step):
            return None
        started = time.monotonic()
        # A collective under ZeRO-3 and FSDP: every process takes part.
        state_dict = accelerator.get_state_dict(trainer.model)
        push: WeightPush | None = None
        try:
            if accelerator.is_main_process:
                path = self._save(trainer, step, state_dict)
                # A 200 means every worker the update started with serves it: a worker
                # that could not commit makes it an error (ProxyRequestError, raised here).
                answer = self.loop.run(self.proxy.update_weights(step, path=str(path)))
                served = int(answer["version"])
                if served != step:
                    raise RuntimeError(
                        f"the proxy answered version {served} to an update to {step}"
                    )
                self._prune(keep=path)
                push = WeightPush(step, path, time.monotonic() - started, answer)
                log.info("weights version %d (%s) served after %.2fs", step, path, push.seconds)
        finally:
            # Released even when the main process failed: the others then find the
            # version not served and fail too, rather than wait for ever.
            accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            served = self._proxy_version()
            if served != step:
                raise RuntimeError(
                    f"the main process did not push step {step}: the proxy serves {served}"
                )
        self.served_version = step
        return push

    def _proxy_version(self) -> int:
        return int(self.loop.run(self.proxy.weights())["version"])

    def _save(self, trainer: Any, step: int, state_dict: Mapping[str, Any] | None) -> Path:
        from worker_client.tiny_model import save_atomically

        model = trainer.accelerator.unwrap_model(trainer.model)
        return save_atomically(
            self.checkpoint_dir / f"{CHECKPOINT_PREFIX}{step}",
            model,
            trainer.processing_class,
            state_dict=state_dict,
        )

    def _prune(self, keep: Path) -> None:
        steps = sorted(
            (int(p.name.removeprefix(CHECKPOINT_PREFIX)), p)
            for p in self.checkpoint_dir.glob(f"{CHECKPOINT_PREFIX}*")
            if p.name.removeprefix(CHECKPOINT_PREFIX).isdigit()
        )
        for _, path in steps[: -self.keep_checkpoints]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ rollout

    async def _episodes(self, prompts: Sequence[Any], version: int) -> list[RolloutResult]:
        """One episode per prompt; a task that fails every attempt fails the batch, and
        the episodes still running are cancelled (their agents with them)."""
        slots = asyncio.Semaphore(self.max_concurrent)

        async def one(prompt: Any) -> RolloutResult:
            async with slots:
                return await self.agent_loop.run(self.task_of(prompt), current_version=version)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(p)) for p in prompts]
        except ExceptionGroup as errors:  # the first failure, as agent_loop.run raised it
            raise errors.exceptions[0] from None
        return [task.result() for task in tasks]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        refuse_trl_tools(trainer)
        push = self.sync_weights(trainer)
        assert self.served_version is not None  # sync_weights asked the proxy
        started = time.monotonic()
        results = self.loop.run(self._episodes(prompts, self.served_version))
        samples = [main_sample(result.samples) for result in results]
        refuse_images(samples)  # before anything else sees the batch
        batch = RolloutBatch(
            step=self.served_version,
            results=results,
            samples=samples,
            seconds=time.monotonic() - started,
            push=push,
            untrained_segments=sum(
                untrained_segments(r.samples, s) for r, s in zip(results, samples, strict=True)
            ),
        )
        if batch.untrained_segments:
            log.warning(
                "%d earlier segment(s) of the agents' episodes (before a compaction) are not "
                "trained: TRL takes one completion per prompt, the segment that ends in the "
                "agent's answer",
                batch.untrained_segments,
            )
        replay = self.agent_loop.config.routed_experts
        if replay or self.measure_gap:
            model = trainer.accelerator.unwrap_model(trainer.model)
        if replay:
            self.replay_batch(model, samples)
        if self.measure_gap:
            gap_started = time.monotonic()
            self.measure(model, batch)
            batch.gap_seconds = time.monotonic() - gap_started
        self.history.append(batch)
        if self.on_batch is not None:
            self.on_batch(batch)
        return rollout_output(samples)

    def replay_batch(self, model: Any, samples: Sequence[Sample]) -> BatchReplay:
        """Force ``model``'s routers, in every forward until the next batch, to the
        recorded experts of ``samples`` (installing the replay at the first batch)."""
        if self.replay is None:
            self.replay = BatchReplay(model).install()
        elif self.replay.model is not model:
            raise RoutingReplayError("the trainer's model changed between batches")
        self.replay.clear()
        for sample in samples:
            if sample.routed_experts is None:
                raise RoutingReplayError(
                    f"trial {sample.trial_id} has no routing: the proxy recorded none"
                )
            self.replay.add([*sample.prompt_ids, *sample.response_ids], sample.routed_experts)
        return self.replay

    def measure(self, model: Any, batch: RolloutBatch) -> None:
        """The batch's on-policy gap with the model's own routing, and replayed (R3)."""
        own: contextlib.AbstractContextManager[None] = (
            self.replay.paused() if self.replay is not None else contextlib.nullcontext()
        )
        with own:
            gap = gap_of(model, batch.samples)
        batch.gap, batch.gap_mean = gap.largest, gap.mean
        if self.replay is not None:
            replayed = gap_of(model, batch.samples)
            batch.gap_r3, batch.gap_r3_mean = replayed.largest, replayed.mean


def refuse_trl_tools(trainer: Any) -> None:
    """GRPOTrainer given ``tools=`` or ``environment_factory`` runs its own tool loop over
    the rollout's completions and ignores ``env_mask`` (TRL 1.16, ``_generate``)."""
    tools = getattr(trainer, "tools", None)
    environments = getattr(trainer, "environment_factories", None)
    if tools or environments:
        raise ValueError(
            "RelayRollout cannot train with GRPOTrainer's own tools (tools= or "
            "environment_factory): TRL would run its tool loop over the agent's episodes "
            "and ignore env_mask, training tool results as the policy's tokens. Give the "
            "tools to the agent, which calls them through the proxy, and none to the trainer."
        )


def refuse_images(samples: Sequence[Sample]) -> None:
    """TRL (1.16) takes no images from a ``rollout_func``: see the module docstring."""
    with_images = [s for s in samples if s.images]
    if with_images:
        first = with_images[0]
        raise VisionRolloutError(
            f"{len(with_images)} of {len(samples)} episodes hold images (trial "
            f"{first.trial_id}: {len(first.images)}): TRL's rollout_func cannot pass images "
            "to the trainer's forward, which would train their placeholder tokens without "
            "their pixels. Train vision-language agents with the verl adapter (sdk.verl)."
        )


def rollout_output(samples: Sequence[Sample]) -> dict[str, list[Any]]:
    """The dict TRL's ``rollout_func`` returns, one entry per sample, in order; a sample
    with images is refused (``VisionRolloutError``)."""
    refuse_images(samples)
    return {
        "prompt_ids": [list(s.prompt_ids) for s in samples],
        "completion_ids": [list(s.response_ids) for s in samples],
        "logprobs": [list(s.response_logprobs) for s in samples],
        "env_mask": [list(s.response_mask) for s in samples],
        REWARD_KEY: [s.reward for s in samples],
        VERSIONS_KEY: [token_versions(s) for s in samples],
        TRIAL_KEY: [s.trial_id for s in samples],
        AGENT_KEY: [s.agent_id for s in samples],
        AGENT_KIND_KEY: [s.agent_kind for s in samples],
    }
