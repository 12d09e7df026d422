"""verl adapter: ``RemoteAgentLoop``, registered as verl agent loop ``remote_agent``.

verl (``verl.experimental.agent_loop``) builds one loop object per sample and calls
``run(sampling_params, **row)``. This loop runs the row's task through
``sdk.agent_loop.RemoteAgentLoop`` (a real agent on a task server, against the proxy) and
returns verl's ``AgentLoopOutput`` for ONE trajectory of the session:

* ``prompt_ids`` / ``response_ids`` / ``response_mask`` / ``response_logprobs``: the exact
  ids and logprobs the policy sampled. A response over ``rollout.response_length`` is cut
  at its end (``response_truncated``). A prompt over ``rollout.prompt_length`` is cut to
  fit and the whole sample is loss-masked (``prompt_truncated``): its logprobs were
  computed on the whole prompt, so it must not train;
* ``reward_score``: the task server's reward; ``num_turns``: model calls in the trajectory;
* ``extra_fields``: ``min_global_steps`` / ``max_global_steps`` (verl's own names) and
  ``policy_versions`` (per turn), ``trial_id``, ``attempts``;
* ``metrics.generate_sequences``: seconds the agent run took;
* ``multi_modal_data``: for a vision-language episode, ``{"images": [PIL images]}``, every
  image inside the ids in order (decoded as the worker decoded it: first frame, RGB). verl's
  agent loop runs its processor over them for ``pixel_values`` / ``image_grid_thw`` and
  builds its 4-row position ids (text positions over the three M-RoPE rows) from them. The
  ids hold each image's placeholders already expanded; before answering, each image's span
  is checked against the token count verl's processor gives it, and an episode with images
  is refused when verl gave the loop no processor (verl would train the ids without their
  pixels).

* ``routed_experts`` (with the setting ``routed_experts: true``, for rollout routing
  replay, R3): the experts the proxy's engine routed each token to at every MoE layer, the
  field verl's own agent loops fill from vLLM/SGLang (``AgentLoopOutput.routed_experts``):
  an ``int16`` array ``[len(prompt_ids + response_ids) - 1, layers, top_k]``, row ``i``
  for position ``i`` of the unpadded ids (verl shifts it past the prompt's left padding and
  pads the rest with zeros; its R3 replay leaves the last position unforced). Each trial
  asks the proxy to record routing; a turn sampled after a row the engine could not give is
  left out as an undelivered one is (``sdk.samples``). Train with verl's
  ``actor_rollout_ref.rollout.enable_rollout_routing_replay=True`` and
  ``actor_rollout_ref.actor.router_replay.mode=R3``: every output of the batch then carries
  rows (the empty output of ``on_failure: empty`` zeros, shaped from the model).

verl expects one output per sample, so the branch policy is ``longest`` (default) or
``last`` (see ``sdk.samples``). verl (0.9) takes exactly one ``AgentLoopOutput`` per row,
so the loop returns ``sdk.samples.main_sample``'s: the main agent's chain that ends in its
answer. An episode the main agent started over in (a new root after a compaction: several
segments, see ``sdk.segments``) trains its last segment only; ``extra_fields["segment"]``
is its root turn and ``extra_fields["untrained_segments"]`` counts the earlier segments
left out.

Configuration comes from verl's config, never from the environment: the entry of the
agent-loop YAML (``actor_rollout_ref.rollout.agent.agent_loop_config_path``) may carry the
settings as keys next to ``name`` and ``_target_``; keys missing there are read from a
``remote_agent`` section of the trainer config (``+remote_agent.proxy_url=...``). See
``examples/verl/`` for a PPO/GRPO run.

Settings: ``proxy_url`` (required), ``admin_token``, ``task_server`` (``{"factory":
"module:callable", ...keyword arguments}``; the callable returns a ``TaskServer``),
``agent``, ``model``, ``timeout_seconds``, ``max_attempts``, ``branch_policy``,
``reward_key``, ``keep_undelivered`` (also train replies the agent never received),
``max_staleness`` (default 1; null: no limit) and ``stale`` (``mask`` or ``drop``),
``retry_backoff_seconds``, ``routed_experts``, ``agent_settings``, ``task_field`` (the row's ``extra_info`` key holding
the task directory, default ``task_path``), ``max_tokens_per_call``, ``serve_rollout`` with ``worker_url`` / ``worker_token`` /
``served_model`` (the job's own rollout replicas serve the proxy through a worker with the
``verl`` backend, started once per process; the policy version of each turn is then verl's
``global_steps``), ``on_failure``
(``raise``, or ``empty``: a fully masked output with reward 0 and
``extra_fields["remote_agent_failed"] = True``).

Staleness: a sampled token more than ``max_staleness`` versions older than the current
policy version is masked (or, with ``stale: drop``, the sample trains nothing), see
``sdk.samples``. verl does not tell an agent loop its step, so the current version is the
one the proxy's workers serve when the episode is collected (``GET /weights``: what the
trainer last pushed or stamped), and never older than the newest version among the
episode's own tokens (with ``serve_rollout``, verl's ``global_steps`` of its last reply).

Failures: a task whose every attempt fails (the agent, the task server, or the network
on the way: a dropped connection, a timeout, an HTML error page) raises
``RemoteAgentLoopError`` (``on_failure: raise``) or gives the empty output
(``on_failure: empty``); no other exception leaves ``run``.

verl builds a new loop object per sample, so the proxy client, the task server and the
core loop are built once per process (and event loop) and shared by every instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    _agent_loop_registry,
    register,
)

from sdk.agent_loop import AgentLoopConfig, RolloutResult
from sdk.agent_loop import RemoteAgentLoop as AgentLoopCore
from sdk.client import ProxyClient
from sdk.exceptions import ImageSpanError, RemoteAgentLoopError
from sdk.images import decode, forward_inputs
from sdk.samples import (
    DEFAULT_MAX_STALENESS,
    AgentSelection,
    BranchPolicy,
    OverlongPrompt,
    Sample,
    StaleTokens,
    main_sample,
    untrained_segments,
)
from sdk.taskserver.base import TaskServer

AGENT_NAME = "remote_agent"
CONFIG_SECTION = "remote_agent"


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


@dataclass(slots=True, frozen=True)
class RemoteAgentSettings:
    proxy_url: str
    task_server: Mapping[str, Any]
    agent: str
    admin_token: str | None = None
    model: str = "policy"
    timeout_seconds: float = 1800.0
    max_attempts: int = 2
    branch_policy: str = "longest"
    reward_key: str | None = None
    agent_settings: Mapping[str, Any] = field(default_factory=dict)
    task_field: str = "task_path"
    max_tokens_per_call: int | None = None
    on_failure: str = "raise"
    # Serve the proxy from this job's own rollout replicas: a worker with the ``verl``
    # backend around verl's rollout client dials ``worker_url`` (once per process).
    serve_rollout: bool = False
    worker_url: str | None = None
    worker_token: str = ""
    served_model: str | None = None
    keep_undelivered: bool = False
    max_staleness: int | None = DEFAULT_MAX_STALENESS
    stale: str = "mask"
    retry_backoff_seconds: float = 0.5
    # R3: record each token's experts and return them as AgentLoopOutput.routed_experts.
    routed_experts: bool = False
    # verl takes one output per row: the main agent's trajectory by default ("all": the
    # first kept of every agent's); kinds to keep (None: all).
    agents: str = "main"
    agent_kinds: list[str] | None = None

    @classmethod
    def from_sources(cls, kwargs: Mapping[str, Any], section: Any) -> RemoteAgentSettings:
        merged: dict[str, Any] = dict(_plain(section) or {})
        merged.update({k: _plain(v) for k, v in kwargs.items()})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(merged) - known)
        if unknown:
            raise ValueError(f"{AGENT_NAME}: unknown settings {unknown}")
        missing = [k for k in ("proxy_url", "task_server", "agent") if not merged.get(k)]
        if missing:
            raise ValueError(
                f"{AGENT_NAME}: set {missing} in the agent-loop YAML entry or in the "
                f"trainer config section `{CONFIG_SECTION}`"
            )
        settings = cls(**merged)
        if BranchPolicy(settings.branch_policy) is BranchPolicy.ALL:
            raise ValueError(
                f"{AGENT_NAME}: verl takes one trajectory per sample; use longest or last"
            )
        StaleTokens(settings.stale)  # a ValueError names the bad value
        if settings.on_failure not in {"raise", "empty"}:
            raise ValueError(f"{AGENT_NAME}: on_failure must be 'raise' or 'empty'")
        if settings.serve_rollout and not settings.worker_url:
            raise ValueError(f"{AGENT_NAME}: serve_rollout needs worker_url (ws://proxy/ws/worker)")
        return settings

    def key(self) -> str:
        return json.dumps(
            {k: getattr(self, k) for k in self.__dataclass_fields__}, sort_keys=True, default=str
        )


def build_task_server(spec: Mapping[str, Any]) -> TaskServer:
    """``{"factory": "module:callable", **kwargs}`` → ``callable(**kwargs)``."""
    options = dict(spec)
    factory = options.pop("factory", None)
    if not isinstance(factory, str) or ":" not in factory:
        raise ValueError(f"{AGENT_NAME}: task_server.factory must be 'module:callable'")
    module, _, attr = factory.partition(":")
    server: TaskServer = getattr(importlib.import_module(module), attr)(**options)
    return server


@dataclass(slots=True)
class _Shared:
    proxy: ProxyClient
    task_server: TaskServer
    settings: RemoteAgentSettings
    worker: asyncio.Task[None] | None = None
    # (layers, top_k) of the routing rows, once known (R3's empty outputs need it).
    routing_shape: tuple[int, int] | None = None


# One proxy client and task server per (settings, event loop) in this process.
_SHARED: dict[tuple[str, int], _Shared] = {}


def _shared(settings: RemoteAgentSettings) -> _Shared:
    key = (settings.key(), id(asyncio.get_running_loop()))
    found = _SHARED.get(key)
    if found is None:
        found = _Shared(
            ProxyClient(settings.proxy_url, admin_token=settings.admin_token),
            build_task_server(settings.task_server),
            settings,
        )
        _SHARED[key] = found
    return found


async def close_shared() -> None:
    """Close the clients this process built (end of training, or tests)."""
    loop = id(asyncio.get_running_loop())
    for key in [k for k in _SHARED if k[1] == loop]:
        shared = _SHARED.pop(key)
        if shared.worker is not None:
            shared.worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await shared.worker
        await shared.task_server.aclose()
        await shared.proxy.aclose()


def trial_sampling(
    sampling_params: Mapping[str, Any], response_length: int | None, cap: int | None
) -> dict[str, Any]:
    """verl's per-sample sampling (temperature, top_p, top_k with -1 = off) as the trial's."""
    sampling: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if sampling_params.get(key) is not None:
            sampling[key] = float(sampling_params[key])
    top_k = sampling_params.get("top_k")
    if top_k is not None and int(top_k) > 0:
        sampling["top_k"] = int(top_k)
    limits = [v for v in (response_length, cap) if v]
    if limits:
        sampling["max_tokens"] = int(min(limits))
    return sampling


def multi_modal_data(sample: Sample, processor: Any) -> dict[str, Any] | None:
    """verl's ``multi_modal_data`` for ``sample`` (None: it has no image), after checking
    its images against verl's processor: each span holds the tokens the processor gives
    its image, and every image token of the ids belongs to an image."""
    if not sample.images:
        return None
    if processor is None:
        raise ImageSpanError(
            f"{AGENT_NAME}: trial {sample.trial_id} has {len(sample.images)} image(s) but verl "
            "gave the agent loop no processor: train a vision-language model with its "
            "processor, or its ids would train without their pixels"
        )
    image_processor = getattr(processor, "image_processor", None) or processor
    forward_inputs(
        sample, image_processor, image_token_id=getattr(processor, "image_token_id", None)
    )
    return {"images": [decode(image) for image in sample.images]}


def verl_routed_experts(rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A sample's routing rows as verl holds them: ``int16`` (its ``DataProto`` field and
    the dtype its agent loop casts the engines' rows to), writable, C-order."""
    return np.array(rows, dtype=np.int16, order="C", copy=True)


def model_routing_shape(model_path: str) -> tuple[int, int]:
    """(MoE layers, experts per token) of the model at ``model_path``, read from its
    routers on a model built from its config on the meta device (no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from worker_client.routing import routing_shape

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    shape = routing_shape(model)
    if shape is None:
        raise ValueError(
            f"{AGENT_NAME}: routed_experts is set but {model_path} has no mixture-of-experts "
            "routers"
        )
    return (shape.layers, shape.top_k)


def to_output(sample: Sample, result: RolloutResult, processor: Any = None) -> AgentLoopOutput:
    # verl's staleness fields (its trainer logs trajectory_staleness from them, its replay
    # buffer bounds them): the oldest and newest weights that sampled a trained token.
    extra = {
        "trial_id": result.trial_id,
        "attempts": len(result.attempts),
        "policy_versions": sample.policy_versions,
        "min_global_steps": sample.min_version,
        "max_global_steps": sample.max_version,
        "prompt_truncated": sample.prompt_truncated,
        "response_truncated": sample.response_truncated,
        "stale_tokens": sample.stale_tokens,
        "current_version": result.current_version,
        "agent_id": sample.agent_id,
        "agent_kind": sample.agent_kind,
        "outcome": sample.outcome,
        # One output per row: the segment it trains, and the agent's segments it leaves.
        "segment": sample.segment,
        "untrained_segments": untrained_segments(result.samples, sample),
    }
    # Only set when there are images: verl's as_dict leaves unset fields out.
    images = multi_modal_data(sample, processor)
    media: dict[str, Any] = {} if images is None else {"multi_modal_data": images}
    if sample.routed_experts is not None:
        media["routed_experts"] = verl_routed_experts(sample.routed_experts)
    return AgentLoopOutput(
        prompt_ids=sample.prompt_ids,
        response_ids=sample.response_ids,
        response_mask=sample.response_mask,
        response_logprobs=sample.response_logprobs,
        reward_score=sample.reward,
        num_turns=sample.num_turns,
        metrics=AgentLoopMetrics(generate_sequences=result.timings.get("agent_run", 0.0)),
        extra_fields=extra,
        **media,
    )


class RemoteAgentLoop(AgentLoopBase):  # type: ignore[misc,unused-ignore]
    """verl agent loop ``remote_agent`` (see the module docstring)."""

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        dataset_cls: Any,
        data_config: Any,
        hf_model_type: str | None = None,
        **kwargs: Any,
    ) -> None:
        # verl passes ``tools``; the YAML entry's ``name`` arrives as a keyword too.
        self._tokenizer: Any = tokenizer
        settings_kwargs = {
            k: v for k, v in kwargs.items() if k not in {"tools", "name"} and not k.startswith("_")
        }
        super().__init__(
            trainer_config,
            server_manager,
            tokenizer,
            processor,
            dataset_cls,
            data_config,
            hf_model_type=hf_model_type,
        )
        self.settings = RemoteAgentSettings.from_sources(
            settings_kwargs, self.config.get(CONFIG_SECTION)
        )

    async def _serve_rollout(self, shared: _Shared) -> None:
        """Start (once per process) a worker that serves the proxy with verl's replicas."""
        if shared.worker is not None:
            if shared.worker.done():
                shared.worker.result()  # surface why it stopped
            return
        from worker_client.backends.verl import VerlEngine
        from worker_client.client import ServedModel, WorkerClient

        model_path = str(self.config.actor_rollout_ref.model.path)
        window = int(self.rollout_config.get("max_model_len") or 0) or int(
            self.rollout_config.prompt_length + self.rollout_config.response_length
        )
        eos = self._tokenizer.eos_token_id
        engine = VerlEngine(
            self.server_manager,
            name=self.settings.served_model or self.settings.model,
            max_model_len=window,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )
        client = WorkerClient(
            str(self.settings.worker_url),
            {engine.card.name: ServedModel(engine, Path(model_path))},
            token=self.settings.worker_token,
        )
        shared.worker = asyncio.get_running_loop().create_task(client.run())
        waiter = asyncio.ensure_future(client.connected.wait())
        await asyncio.wait(
            {waiter, shared.worker}, timeout=120.0, return_when=asyncio.FIRST_COMPLETED
        )
        if not waiter.done():
            waiter.cancel()
            if shared.worker.done():
                shared.worker.result()
            raise RuntimeError(f"{AGENT_NAME}: the rollout worker did not reach the proxy")

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        settings = self.settings
        shared = _shared(settings)
        if settings.serve_rollout:
            await self._serve_rollout(shared)
        extra_info = _plain(kwargs.get("extra_info")) or {}
        task = extra_info.get(settings.task_field) or kwargs.get(settings.task_field)
        if not task:
            raise ValueError(f"{AGENT_NAME}: the row has no extra_info.{settings.task_field}")
        prompt_length = int(self.rollout_config.prompt_length)
        response_length = int(self.rollout_config.response_length)
        core = AgentLoopCore(
            shared.proxy,
            shared.task_server,
            AgentLoopConfig(
                agent=settings.agent,
                model=settings.model,
                timeout_seconds=settings.timeout_seconds,
                max_attempts=settings.max_attempts,
                branch_policy=BranchPolicy(settings.branch_policy),
                reward_key=settings.reward_key,
                max_prompt_tokens=prompt_length,
                max_response_tokens=response_length,
                # verl needs one output per row: an overlong prompt trains nothing instead.
                overlong_prompt=OverlongPrompt.MASK,
                sampling=trial_sampling(
                    sampling_params, response_length, settings.max_tokens_per_call
                ),
                agent_settings=dict(settings.agent_settings),
                keep_undelivered=settings.keep_undelivered,
                max_staleness=settings.max_staleness,
                stale=StaleTokens(settings.stale),
                retry_backoff_seconds=settings.retry_backoff_seconds,
                routed_experts=settings.routed_experts,
                agents=AgentSelection(settings.agents),
                agent_kinds=frozenset(settings.agent_kinds) if settings.agent_kinds else None,
            ),
        )
        metadata = {"index": _plain(kwargs.get("index")), "data_source": kwargs.get("data_source")}
        try:
            result = await core.run(task, metadata={k: v for k, v in metadata.items() if v})
        except RemoteAgentLoopError as exc:
            if settings.on_failure == "raise":
                raise
            return self._failed_output(kwargs, exc, shared)
        sample = main_sample(result.samples)
        if sample.routed_experts is not None:
            shared.routing_shape = (
                int(sample.routed_experts.shape[1]),
                int(sample.routed_experts.shape[2]),
            )
        return to_output(sample, result, self.processor)

    def _failed_output(
        self, row: Mapping[str, Any], error: RemoteAgentLoopError, shared: _Shared | None = None
    ) -> AgentLoopOutput:
        """A sample that trains nothing: the dataset prompt, one masked pad token (and,
        with ``routed_experts``, rows of zeros: verl batches the field only when every
        output has it)."""
        raw_prompt = _plain(row.get("raw_prompt")) or []
        text = (
            self._tokenizer.apply_chat_template(
                raw_prompt, tokenize=False, add_generation_prompt=True
            )
            if raw_prompt
            else ""
        )
        ids = list(self._tokenizer.encode(text, add_special_tokens=False)) if text else []
        prompt_ids = ids[-int(self.rollout_config.prompt_length) :]
        pad = self._tokenizer.pad_token_id or self._tokenizer.eos_token_id or 0
        routing: dict[str, Any] = {}
        if self.settings.routed_experts:
            shape = shared.routing_shape if shared is not None else None
            if shape is None:
                shape = model_routing_shape(str(self.config.actor_rollout_ref.model.path))
                if shared is not None:
                    shared.routing_shape = shape
            routing["routed_experts"] = np.zeros((len(prompt_ids), *shape), np.int16)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=[int(pad)],
            response_mask=[0],
            response_logprobs=[0.0],
            reward_score=0.0,
            num_turns=0,
            metrics=AgentLoopMetrics(),
            extra_fields={"remote_agent_failed": True, "error": str(error)[:500]},
            **routing,
        )


# Registered only when absent: an entry from the agent-loop YAML (with its settings) must
# survive this import, which happens when verl instantiates the loop for the first time.
if AGENT_NAME not in _agent_loop_registry:
    register(AGENT_NAME)(RemoteAgentLoop)
