"""The ``rollout-relay train`` run: TRL's GRPOTrainer trains a policy through real agents.

A toy task an agent works through the proxy: the user asks what a file of a scratch
workspace says, and the agent (the official ``openai`` client in a tool loop, run
in-process by ``sdk.taskserver.inprocess``) may call the four tools the tiny model knows
(``bash``, ``read_file``, ``search``, ``write_file``). The reward is what the agent did
through the API: 1.0 when it called ``read_file``, the tool made for the question, 0.0
otherwise. The untrained tiny model calls one of the offered tools about half the time,
``read_file`` in about four episodes out of ten; GRPO on those episodes teaches it to
pick it (about nine out of ten after 40 steps).

Each step: the trainer's weights are pushed (``POST /weights``, version = step), one
episode per prompt runs through the proxy, the recorded logprobs of every sampled token
are compared with the trainer's own teacher forcing (the on-policy gap) and the tokens'
versions with the step, then TRL takes one optimizer step. The figures per step go to
``<out>/train.json`` and a plot to ``<out>/train.png``. (``rollout_relay.train`` starts the proxy
and the worker this runs against.)

A mixture-of-experts policy with rollout routing replay (``routed_experts``): every
session asks the proxy to record which experts each token was routed to, and the
trainer's forward passes replay them (``sdk.trl``, ``sdk.routing.BatchReplay``); each
step then reports the gap with the trainer's own routing and with the recorded one
(``gap`` / ``gap_mean`` and ``gap_r3`` / ``gap_r3_mean``), and the run is on-policy when the
replayed gap is within the limit.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from sdk.agent_loop import AgentLoopConfig, RemoteAgentLoop
from sdk.client import ProxyClient
from sdk.demo import TOOLS as DEMO_TOOLS
from sdk.demo import Workspace
from sdk.samples import BranchPolicy
from sdk.taskserver.base import RunSpec
from sdk.taskserver.inprocess import InProcessTaskServer
from sdk.trl import BackgroundLoop, RelayRollout, RolloutBatch, relay_reward

Say = Callable[[str], None]

REWARDED_TOOL = "read_file"
GAP_LIMIT = 1e-4

TOOLS: list[dict[str, Any]] = [
    *DEMO_TOOLS,
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the workspace for a word.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]

QUESTIONS = {
    "main-py": "What does main.py print? Look at the file and tell me.",
    "readme": "What is this project? The README.md says it.",
}


def write_tasks(root: Path) -> list[Path]:
    """The toy tasks as directories holding their ``instruction.md``."""
    tasks = []
    for name, question in QUESTIONS.items():
        task = root / name
        task.mkdir(parents=True, exist_ok=True)
        (task / "instruction.md").write_text(question + "\n")
        tasks.append(task)
    return tasks


def episode_reward(tools_called: list[str]) -> float:
    """1.0 when the agent called the tool made for the question, else 0.0."""
    return 1.0 if REWARDED_TOOL in tools_called else 0.0


@dataclass(slots=True, frozen=True)
class AgentSettings:
    turns: int = 2  # model calls per episode at most (a reply without tool calls ends it)
    max_tokens: int = 48  # per model call


async def tool_agent(spec: RunSpec, settings: AgentSettings) -> Mapping[str, float]:
    """One episode: the question, then model calls with tools until a plain reply or
    ``settings.turns`` calls; the tools run on a scratch workspace that is only read."""
    question = (spec.task / "instruction.md").read_text().strip()
    # One timeout for connecting too: the client's default 5 s to connect is short for a
    # loopback on two cores shared with the trainer.
    client = AsyncOpenAI(
        base_url=spec.base_url, api_key=spec.api_key, max_retries=0, timeout=spec.timeout_seconds
    )
    called: list[str] = []
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant with tools."},
        {"role": "user", "content": question},
    ]
    try:
        with tempfile.TemporaryDirectory() as scratch:
            workspace = Workspace(Path(scratch))
            for _ in range(settings.turns):
                response = await client.chat.completions.create(
                    model=spec.model,
                    messages=messages,  # type: ignore[arg-type]
                    tools=TOOLS,  # type: ignore[arg-type]
                    max_tokens=settings.max_tokens,
                )
                message = response.choices[0].message
                calls = [
                    c
                    for c in message.tool_calls or []
                    if isinstance(c, ChatCompletionMessageFunctionToolCall)
                ]
                if not calls:
                    break
                messages.append(message.model_dump(exclude_none=True))
                for call in calls:
                    called.append(call.function.name)
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            "content": workspace.run(call.function.name, call.function.arguments),
                        }
                    )
    finally:
        await client.close()
    return {"reward": episode_reward(called)}


@dataclass(slots=True, frozen=True)
class TrainSettings:
    """The run's knobs; the defaults are the measured ``make train`` run."""

    steps: int = 40
    prompts_per_step: int = 2
    generations: int = 8  # completions per prompt (the GRPO group)
    learning_rate: float = 1e-3
    seed: int = 0
    agent: AgentSettings = field(default_factory=AgentSettings)
    max_concurrent: int = 16
    routed_experts: bool = False  # R3: record the rollout's routing and replay it
    # The workers' engine backend, for the record and the plot (None: the workers of a
    # proxy the run did not start).
    backend: str | None = "hf"


@dataclass(slots=True, frozen=True)
class StepFigures:
    step: int
    mean_reward: float
    gap: float  # max |recorded − teacher-forced| logprob over the sampled tokens
    versions: list[int]  # distinct versions among the sampled tokens
    off_step_tokens: int  # sampled tokens whose version is not the step
    sampled_tokens: int
    episodes: int
    rollout_seconds: float
    push_seconds: float
    gap_mean: float = float("nan")  # mean |recorded − teacher-forced| over sampled tokens
    # The same with the routers forced to the recorded experts (R3; NaN: not replayed).
    gap_r3: float = float("nan")
    gap_r3_mean: float = float("nan")

    @property
    def trained_gap(self) -> float:
        """The gap of what the trainer computes: replayed when it replays routing."""
        return self.gap if self.gap_r3 != self.gap_r3 else self.gap_r3


def _figure(value: float | None) -> float:
    return float("nan") if value is None else value


def step_figures(batch: RolloutBatch) -> StepFigures:
    return StepFigures(
        step=batch.step,
        mean_reward=batch.mean_reward,
        gap=batch.gap if batch.gap is not None else float("nan"),
        versions=batch.versions,
        off_step_tokens=batch.off_step_tokens,
        sampled_tokens=batch.sampled_tokens,
        episodes=len(batch.samples),
        rollout_seconds=round(batch.seconds, 3),
        push_seconds=round(batch.push.seconds if batch.push is not None else 0.0, 3),
        gap_mean=_figure(batch.gap_mean),
        gap_r3=_figure(batch.gap_r3),
        gap_r3_mean=_figure(batch.gap_r3_mean),
    )


@dataclass(slots=True)
class TrainReport:
    steps: list[StepFigures]
    seconds: float  # the training part: trainer.train() from the first rollout to the end
    settings: TrainSettings
    # The last step's batch (the rollout keeps one: a long run stays flat in memory); every
    # step's figures are in ``steps``.
    batches: list[RolloutBatch] = field(default_factory=list)

    @property
    def max_gap(self) -> float:
        """The largest gap of what the trainer computed (replayed, with R3)."""
        return max(s.trained_gap for s in self.steps)

    @property
    def on_policy(self) -> bool:
        """Every step's gap (replayed, with R3) within GAP_LIMIT and every sampled token
        of its version."""
        return all(s.trained_gap <= GAP_LIMIT and s.off_step_tokens == 0 for s in self.steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "seconds": round(self.seconds, 1),
            "max_gap": self.max_gap,
            "on_policy": self.on_policy,
            "steps": [asdict(s) for s in self.steps],
        }


def describe_step(figures: StepFigures) -> str:
    gap = f"gap {figures.gap:.1e} (mean {figures.gap_mean:.1e})"
    if figures.gap_r3 == figures.gap_r3:  # not NaN: routing replayed
        gap += f", R3 {figures.gap_r3:.1e} (mean {figures.gap_r3_mean:.1e})"
    return (
        f"step {figures.step:3d}: reward {figures.mean_reward:.2f}  {gap}  "
        f"versions {figures.versions}  ({figures.sampled_tokens} sampled tokens, "
        f"{figures.off_step_tokens} off-step; rollout {figures.rollout_seconds:.1f}s, "
        f"weights {figures.push_seconds:.2f}s)"
    )


def build_trainer(
    model_dir: Path,
    rollout: RelayRollout,
    tasks: list[Path],
    settings: TrainSettings,
    out_dir: Path,
) -> Any:
    """TRL's GRPOTrainer on CPU in float32, its generation replaced by ``rollout``."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    batch = settings.prompts_per_step * settings.generations
    rows = settings.steps * settings.prompts_per_step
    dataset = Dataset.from_dict({"prompt": [str(tasks[i % len(tasks)]) for i in range(rows)]})
    config = GRPOConfig(
        output_dir=str(out_dir / "trainer"),
        use_cpu=True,
        bf16=False,
        beta=0.0,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=settings.generations,
        max_steps=settings.steps,
        temperature=1.0,
        seed=settings.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=relay_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    # One line per step comes from the rollout (describe_step); TRL's dict of logs per
    # step stays in trainer.state.log_history.
    trainer.remove_callback(PrinterCallback)
    return trainer


def train(
    proxy_url: str,
    model_dir: Path,
    out_dir: Path,
    *,
    loop: BackgroundLoop,
    admin_token: str | None = None,
    settings: TrainSettings | None = None,
    say: Say = print,
) -> TrainReport:
    """Train the model the workers serve (``model_dir``, their version 0) for
    ``settings.steps`` GRPO steps through the proxy at ``proxy_url``."""
    settings = settings or TrainSettings()
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(out_dir / "tasks")
    proxy = ProxyClient(proxy_url, admin_token=admin_token)
    server = InProcessTaskServer(lambda spec: tool_agent(spec, settings.agent))
    agent_loop = RemoteAgentLoop(
        proxy,
        server,
        AgentLoopConfig(
            agent="tool-agent",
            max_attempts=2,  # a failed episode is run again on a fresh trial
            branch_policy=BranchPolicy.LONGEST,
            reward_key="reward",
            retry_without_reward=False,
            sampling={"temperature": 1.0, "top_p": 1.0},
            timeout_seconds=300.0,
            routed_experts=settings.routed_experts,
        ),
    )
    figures: list[StepFigures] = []

    def on_batch(batch: RolloutBatch) -> None:
        figures.append(step_figures(batch))
        say(describe_step(figures[-1]))

    rollout = RelayRollout(
        loop,
        proxy,
        agent_loop,
        out_dir / "checkpoints",
        max_concurrent=settings.max_concurrent,
        measure_gap=True,
        on_batch=on_batch,
    )
    trainer = build_trainer(model_dir, rollout, tasks, settings, out_dir)
    started = time.monotonic()
    try:
        trainer.train()
    finally:
        loop.run(proxy.aclose())
    report = TrainReport(figures, time.monotonic() - started, settings, list(rollout.history))
    (out_dir / "train.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    plot(report, out_dir / "train.png")
    return report


def plot(report: TrainReport, path: Path) -> Path:
    """Mean reward per step (left axis) and the on-policy gap (right axis, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in report.steps]
    fig, reward_axis = plt.subplots(figsize=(7.5, 4.0), dpi=120)
    (reward_line,) = reward_axis.plot(
        steps, [s.mean_reward for s in report.steps], "o-", color="tab:blue", markersize=4
    )
    reward_axis.set_xlabel("optimizer step (= the weights version that sampled its batch)")
    reward_axis.set_ylabel(f"mean reward (the agent called {REWARDED_TOOL})", color="tab:blue")
    reward_axis.set_ylim(-0.05, 1.05)
    gap_axis = reward_axis.twinx()
    gaps = [max(s.trained_gap, 1e-9) for s in report.steps]
    (gap_line,) = gap_axis.semilogy(steps, gaps, "s--", color="tab:red", markersize=3)
    limit = gap_axis.axhline(GAP_LIMIT, color="tab:red", linewidth=0.8, linestyle=":")
    gap_axis.set_ylabel("on-policy gap (logprob)", color="tab:red")
    gap_axis.set_ylim(1e-8, 1e-2)
    reward_axis.legend(
        [reward_line, gap_line, limit],
        [
            "mean reward of the step's episodes",
            "max |recorded − trainer's teacher-forced| over sampled tokens",
            f"gap limit {GAP_LIMIT:.0e}",
        ],
        loc="lower right",
        fontsize=7,
    )
    model = "tiny MoE, routing replayed" if report.settings.routed_experts else "tiny model"
    served = "vLLM worker (CPU build), " if report.settings.backend == "vllm" else ""
    fig.suptitle(f"GRPO (TRL) through rollout-relay: {model}, {served}2 CPU cores")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
