"""What the proxy costs beside what a user would run instead: the same multi-turn agent
workload against ``vllm serve`` directly and through the proxy with a ``vllm`` worker, one
after the other in one run, on the same real engine (vLLM's CPU build from
``.cache/vllm-venv``, made by ``scripts/vllm-env.sh``) and the tiny model with heads 32 wide.

The direct side is what a team that wants token ids and logprobs does without the proxy:
its agent keeps the conversation as token ids (the chat template rendered once, each later
message appended as the template's tokens), sends them to ``/v1/completions`` and asks for
the sampled ids (``return_token_ids``) and their logprobs. That bookkeeping runs in the
agent's own process; its CPU is reported apart (``client``). The proxy side sends chat
messages and the proxy does the same bookkeeping (template, tokens, trajectory) itself.

Each side starts its engine with the same settings (float32, eager, one context window),
takes one untimed turn (vLLM compiles its logprobs step on the first request) and then
the measured turns. CPU per turn is every process of the side: ``vllm serve`` (its API
server and its engine core), or the proxy and the worker (the worker's own process and its
engine core). Only one engine runs at a time: two on two cores would measure each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.agents import Call, LoadResult, Target, client_session, percentile, run_load, words
from bench.processes import (
    AUTH_ENV,
    REPO,
    Proc,
    Processes,
    _scheduled_seconds,
    free_port,
    wait_http,
)

VLLM_VENV = REPO / ".cache" / "vllm-venv"
VLLM_MODEL = REPO / ".cache" / "vllm-models" / "text-hd32"
MODEL_NAME = "bench"
SYSTEM_WORDS, ADD_WORDS = 60, 40  # as the other sections' agents
ENGINE_START_SECONDS = 900.0  # a busy two-core machine can take minutes


def missing() -> str | None:
    """Why the section cannot run here, or None."""
    if not (VLLM_VENV / ".vllm-env.stamp").is_file():
        return (
            f"vLLM's side environment is missing ({VLLM_VENV}; scripts/vllm-env.sh, "
            "as `make test-vllm` makes it)"
        )
    return None


def engine_env() -> dict[str, str]:
    """What both sides' engines start with: a small KV cache, the compile caches that the
    real-engine tests keep under .cache/."""
    cache = REPO / ".cache" / "vllm-compile"
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
    }


def vllm_model() -> Path:
    """The shipped tiny model with heads 32 wide (vLLM's CPU attention takes no narrower
    ones), written once, where the real-engine tests keep it."""
    if not (VLLM_MODEL / "model.safetensors").is_file():
        from worker_client.tiny_model import SHIPPED_TINY_MODEL, widen_heads

        widen_heads(SHIPPED_TINY_MODEL, VLLM_MODEL)
    return VLLM_MODEL


def engine_args(max_model_len: int) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len)]


# ---------------------------------------------------------------- the direct agent


@dataclass(frozen=True, slots=True)
class ChatTokens:
    """How the agent extends a conversation of token ids by one user message: after the
    sampled reply (which ends in ``eos`` unless it was cut), ``between + text + after``."""

    eos: int
    between: str
    after: str


def chat_tokens(tokenizer: Any) -> ChatTokens:
    """The template's text around a later user message, read off one rendering."""
    reply, message = "REPLY-SAMPLED-HERE", "NEXT-MESSAGE-HERE"
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": message},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    end, start = text.index(reply) + len(reply), text.index(message)
    between = text[end:start]
    eos_text = tokenizer.eos_token
    if not between.startswith(eos_text):
        raise ValueError(f"the template does not close a reply with {eos_text!r}")
    return ChatTokens(
        tokenizer.convert_tokens_to_ids(eos_text),
        between[len(eos_text) :],
        text[start + len(message) :],
    )


class TokenAgent:
    """One conversation kept as token ids against ``vllm serve``'s ``/v1/completions``,
    drawing the same words as ``bench.agents.Agent`` with the same seed. ``client_seconds``:
    CPU this process spent on its template and tokens."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        tokenizer: Any,
        chat: ChatTokens,
        *,
        seed: int,
        max_tokens: int,
    ) -> None:
        self.http, self.url, self.tokenizer, self.chat = http, url, tokenizer, chat
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self.turns = 0
        self.client_seconds = 0.0

    def new_session(self) -> None:
        started = time.process_time()
        messages = [
            {"role": "system", "content": words(self.rng, SYSTEM_WORDS)},
            {"role": "user", "content": words(self.rng, ADD_WORDS)},
        ]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        self.ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.turns = 0
        self.client_seconds += time.process_time() - started

    def observe(self) -> None:
        started = time.process_time()
        text = self.chat.between + words(self.rng, ADD_WORDS) + self.chat.after
        if not self.ids or self.ids[-1] != self.chat.eos:
            self.ids.append(self.chat.eos)  # a reply cut at max_tokens, closed
        self.ids += self.tokenizer.encode(text, add_special_tokens=False)
        self.client_seconds += time.process_time() - started

    async def turn(self) -> Call:
        body = {
            "model": MODEL_NAME,
            "prompt": self.ids,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
        }
        started = time.perf_counter()
        async with self.http.post(f"{self.url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            reply = await response.json()
        seconds = time.perf_counter() - started
        (choice,) = reply["choices"]
        sampled: list[int] = choice["token_ids"]
        logprobs = choice["logprobs"]["token_logprobs"]
        if len(logprobs) != len(sampled):
            raise RuntimeError("vllm serve returned a logprob per token only for some tokens")
        self.ids += sampled
        self.turns += 1
        usage = reply.get("usage") or {}
        return Call(
            seconds,
            None,
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", len(sampled))),
            turn=self.turns - 1,
        )


async def run_direct(
    url: str,
    tokenizer: Any,
    *,
    concurrency: int,
    conversations: int,
    turns_each: int,
    max_tokens: int,
    seed: int = 0,
) -> tuple[LoadResult, float]:
    """``conversations`` of ``turns_each`` turns, ``concurrency`` at a time, each agent
    seeded as ``run_load`` seeds its own; the result and the agents' CPU seconds."""
    chat = chat_tokens(tokenizer)
    result = LoadResult()
    queue = list(range(conversations))
    client = 0.0
    async with client_session(concurrency) as http:

        async def agent_loop(index: int) -> None:
            nonlocal client
            agent = TokenAgent(
                http, url, tokenizer, chat, seed=seed * 100_003 + index, max_tokens=max_tokens
            )
            while queue:
                queue.pop()
                agent.new_session()
                result.sessions += 1
                for turn in range(turns_each):
                    if turn:
                        agent.observe()
                    try:
                        result.calls.append(await agent.turn())
                    except (TimeoutError, aiohttp.ClientError, RuntimeError, KeyError) as exc:
                        result.errors += 1
                        result.first_error = result.first_error or repr(exc)[:300]
                        break
            client += agent.client_seconds

        started = time.perf_counter()
        await asyncio.gather(*(agent_loop(i) for i in range(concurrency)))
        result.wall_seconds = time.perf_counter() - started
    return result, client


# ------------------------------------------------------------- processes and figures


def split_cpu(proc: Proc) -> tuple[float, float]:
    """CPU seconds so far of ``proc``'s own process and of its children (vLLM's engine
    core), each counted as ``Proc.cpu_seconds`` counts them."""
    own = _scheduled_seconds(proc.popen.pid)
    if own is None:
        with contextlib.suppress(psutil.Error):
            times = proc.ps.cpu_times()
            own = times.user + times.system
    children = 0.0
    for child in proc.ps.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            children += times.user + times.system
    return own or 0.0, children


def stop_with_children(proc: Proc) -> int:
    """Stop ``proc``, then any of its children still running (an engine core its parent
    did not close); how many had to be killed."""
    try:
        children = proc.ps.children(recursive=True)
    except psutil.Error:
        children = []
    proc.stop()
    _, alive = psutil.wait_procs(children, timeout=15)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return len(alive)


def vllm_serve(procs: Processes, model: Path, max_model_len: int) -> Proc:
    """vLLM's OpenAI-compatible server, the one ``vllm serve`` runs. Started as its
    module: in vllm-cpu 0.32.0 the ``vllm`` command itself fails at start, looking up the
    version of a distribution named ``vllm`` (the CPU build's is ``vllm-cpu``)."""
    port = free_port()
    proc = procs.spawn(
        "vllm-serve",
        [
            str(VLLM_VENV / "bin" / "python"),
            *("-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(model)),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--served-model-name", MODEL_NAME),
            *engine_args(max_model_len),
        ],
        env=engine_env(),
    )
    proc.url = f"http://127.0.0.1:{port}"
    return proc


def vllm_worker(procs: Processes, proxy: Proc, model: Path, max_model_len: int) -> Proc:
    """``rollout-relay worker --backend vllm`` from the side environment, dialing ``proxy``."""
    return procs.spawn(
        "vllm-worker",
        [
            str(VLLM_VENV / "bin" / "python"),
            *("-m", "rollout_relay.cli", "--log-level", "WARNING", "worker"),
            *("--proxy", proxy.url.replace("http://", "ws://") + "/ws/worker"),
            *("--backend", "vllm", "--model", str(model), "--name", MODEL_NAME),
            *engine_args(max_model_len),
            *("--worker-id", "bench-vllm"),
        ],
        env={**AUTH_ENV, **engine_env()},
    )


def row(
    target: str,
    concurrency: int,
    result: LoadResult,
    cpu: dict[str, float],
    *,
    conversations: int,
    turns_each: int,
) -> dict[str, Any]:
    lat = result.latencies()
    n = max(len(result.calls), 1)
    return {
        "target": target,
        "concurrency": concurrency,
        "conversations": conversations,
        "turns_each": turns_each,
        "turns": len(result.calls),
        "errors": result.errors,
        "first_error": result.first_error,
        "turns_per_s": len(result.calls) / result.wall_seconds if result.wall_seconds else 0.0,
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "completion_tokens": sum(c.completion_tokens for c in result.calls),
        "prompt_tokens_max": max((c.prompt_tokens for c in result.calls), default=0),
        "cpu_ms_per_turn": {k: v / n * 1e3 for k, v in cpu.items()},
    }


def _print(r: dict[str, Any]) -> None:
    cpu = " ".join(f"{k}={v:.1f}" for k, v in r["cpu_ms_per_turn"].items())
    print(
        f"  {r['target']:6s} c={r['concurrency']:<3d} turns={r['turns']} err={r['errors']} "
        f"{r['turns_per_s']:.1f}/s p50={r['p50_ms']:.0f}ms p99={r['p99_ms']:.0f}ms "
        f"cpu ms/turn: {cpu}",
        flush=True,
    )


async def section_vllm(
    sizes: Any, proxy_args: list[str], durable: bool, log_dir: Path | None = None
) -> dict[str, Any]:
    """Both sides at each of ``sizes.vllm_concurrencies``; ``{"skipped": why}`` without
    the side environment."""
    why = missing()
    if why is not None:
        print(f"  skipped: {why}", flush=True)
        return {"skipped": why}
    from transformers import AutoTokenizer

    model = vllm_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    conversations, turns_each = sizes.vllm_conversations, sizes.vllm_turns_each
    max_tokens, window = sizes.vllm_max_tokens, sizes.vllm_max_model_len
    rows: list[dict[str, Any]] = []
    starts: dict[str, float] = {}
    leaks: dict[str, int] = {}
    with Processes(log_dir) as procs:
        # vllm serve, alone on the machine's engine core.
        started = time.perf_counter()
        server = vllm_serve(procs, model, window)
        wait_http(server, "/health", within=ENGINE_START_SECONDS)
        starts["direct"] = time.perf_counter() - started
        await run_direct(
            server.url, tokenizer, concurrency=1, conversations=1, turns_each=1, max_tokens=4
        )
        for concurrency in sizes.vllm_concurrencies:
            front, engine = split_cpu(server)
            result, client = await run_direct(
                server.url,
                tokenizer,
                concurrency=concurrency,
                conversations=conversations,
                turns_each=turns_each,
                max_tokens=max_tokens,
            )
            front_after, engine_after = split_cpu(server)
            cpu = {
                "vllm serve": front_after - front,
                "engine core": engine_after - engine,
                "client": client,
            }
            rows.append(
                row(
                    "direct",
                    concurrency,
                    result,
                    cpu,
                    conversations=conversations,
                    turns_each=turns_each,
                )
            )
            _print(rows[-1])
        leaks["direct"] = stop_with_children(server)

        # The proxy and a vllm worker, the same engine settings.
        started = time.perf_counter()
        proxy = procs.proxy(proxy_args, durable=durable, name="proxy-vllm")
        wait_http(proxy, "/healthz")
        worker = vllm_worker(procs, proxy, model, window)
        wait_http(proxy, "/readyz", within=ENGINE_START_SECONDS)
        starts["proxy"] = time.perf_counter() - started
        target = Target("proxy", proxy.url)
        await run_load(
            target, concurrency=1, total_turns=1, turns_per_session=1, stream=False, max_tokens=4
        )
        for concurrency in sizes.vllm_concurrencies:
            before = (proxy.cpu_seconds(), *split_cpu(worker))
            result = await run_load(
                target,
                concurrency=concurrency,
                total_turns=conversations * turns_each,
                turns_per_session=turns_each,
                stream=False,
                system_words=SYSTEM_WORDS,
                add_words=ADD_WORDS,
                max_tokens=max_tokens,
                model=MODEL_NAME,
            )
            after = (proxy.cpu_seconds(), *split_cpu(worker))
            names = ("proxy", "worker", "engine core")
            cpu = {k: a - b for k, a, b in zip(names, after, before, strict=True)}
            rows.append(
                row(
                    "proxy",
                    concurrency,
                    result,
                    cpu,
                    conversations=conversations,
                    turns_each=turns_each,
                )
            )
            _print(rows[-1])
        leaks["proxy"] = stop_with_children(worker)
        proxy.stop()
    return {
        "rows": rows,
        "engine_start_s": starts,
        "killed_after_stop": leaks,
        "model": str(model),
        "engine": " ".join(engine_args(window)),
        "python": sys.version.split()[0],
        "load_average": os.getloadavg(),
    }
