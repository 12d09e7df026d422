"""The benchmark sections. Each returns plain dicts that ``bench.report`` turns into
tables; ``run`` starts the processes, runs the sections asked for and stops everything."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.agents import (
    Agent,
    Call,
    LoadResult,
    Target,
    client_session,
    median,
    percentile,
    run_load,
    words,
)
from bench.processes import Proc, Processes, free_port, wait_http
from bench.vllm import section_vllm

SECTIONS = (
    "latency",
    "history",
    "stream",
    "inmemory",
    "context",
    "memory",
    "profile",
    "replicas",
    "vllm",
)


@dataclass(slots=True)
class Sizes:
    """How big each section is. ``quick()`` is for the harness's own test."""

    concurrencies: tuple[int, ...] = (1, 64, 512)
    turns_at: dict[int, int] = field(default_factory=lambda: {1: 300, 64: 1500, 512: 2048})
    litellm_turns_at: dict[int, int] = field(default_factory=lambda: {1: 100, 64: 400, 512: 1024})
    litellm_max_seconds: float | None = 45.0
    turns_per_session: int = 8
    reply_tokens: int = 16
    # The largest starts below 128k so that its measured turns end inside the tiny
    # model's 131,072-token window.
    context_tokens: tuple[int, ...] = (1024, 32768, 110000)
    context_turns: int = 40
    context_add_tokens: int = 300
    memory_sessions: int = 250
    memory_tokens: int = 32768
    idle_sessions: int = 2000
    profile_seconds: float = 8.0
    # Streaming at an engine's pace: a token for every stream per engine step, as a
    # batching GPU engine produces them.
    stream_concurrencies: tuple[int, ...] = (1, 32, 128)
    stream_turns_at: dict[int, int] = field(default_factory=lambda: {1: 24, 32: 256, 128: 512})
    stream_reply_tokens: int = 64
    stream_tokens_per_second: float = 50.0
    # A second proxy streaming in groups of this many tokens (--stream-interval; 0: none).
    stream_grouped_interval: int = 8
    # Streams at a pace above what the proxy carries (its CPU used up): how many, how fast
    # each (tokens/s), and how many turns in all (0 streams: no such run).
    stream_saturated: tuple[int, float] = (128, 400.0)
    stream_saturated_turns: int = 2048
    # Every stream run this many times, interleaved (this machine's speed moves).
    stream_rounds: int = 2
    # One proxy against two replicas: agents, turns, and streamed turns of each.
    replica_concurrency: int = 64
    replica_turns: int = 8192
    replica_stream_turns: int = 4096
    # Growing conversations, one session per agent for all its turns: (agents, turns each).
    history_runs: tuple[tuple[int, int], ...] = ((1, 300), (64, 30))
    history_edge_turns: int = 10  # "the first turns" and "the last turns" compared
    # One agent whose context is this many characters (a long system prompt, as a large
    # repository listing or tool output makes it), measured over this many turns after
    # its first (the first renders the whole context once; it is reported apart).
    history_large_chars: int = 250_000
    history_large_turns: int = 60
    # A py-spy profile of the proxy over the late turns of growing conversations: this
    # many agents, each grown to the first turn, profiled up to the second.
    history_profile_agents: int = 16
    history_profile_turns: tuple[int, int] = (250, 300)
    # The real engine, `vllm serve` beside the proxy and a vllm worker: conversations of
    # this many turns at each concurrency, replies of at most this many tokens.
    vllm_concurrencies: tuple[int, ...] = (1, 8)
    vllm_conversations: int = 8
    vllm_turns_each: int = 8
    vllm_max_tokens: int = 32
    vllm_max_model_len: int = 4096

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            concurrencies=(1, 4),
            turns_at={1: 6, 4: 12},
            litellm_turns_at={1: 4, 4: 8},
            turns_per_session=3,
            reply_tokens=8,
            context_tokens=(256, 1024),
            context_turns=3,
            context_add_tokens=40,
            memory_sessions=4,
            memory_tokens=512,
            idle_sessions=10,
            profile_seconds=1.0,
            litellm_max_seconds=None,
            stream_concurrencies=(1, 4),
            stream_turns_at={1: 3, 4: 8},
            stream_reply_tokens=8,
            stream_tokens_per_second=200.0,
            stream_grouped_interval=4,
            stream_saturated=(4, 2000.0),
            stream_saturated_turns=8,
            stream_rounds=1,
            replica_concurrency=4,
            replica_turns=12,
            replica_stream_turns=8,
            history_runs=((1, 12), (4, 4)),
            history_edge_turns=3,
            history_large_chars=20_000,
            history_large_turns=4,
            history_profile_agents=2,
            history_profile_turns=(4, 8),
            vllm_concurrencies=(2,),
            vllm_conversations=2,
            vllm_turns_each=2,
            vllm_max_tokens=8,
        )


@dataclass(slots=True)
class Stack:
    proxy: Proc
    workers: list[Proc]
    upstream: Proc
    litellm: Proc | None
    paced: Proc | None = None  # an instant worker pacing its tokens (model PACED_MODEL)
    volatile: Proc | None = None  # a second proxy without durability (its own worker)
    grouped: Proc | None = None  # a proxy with --stream-interval (the paced worker's too)
    stepwise: Proc | None = None  # a proxy with --stream-coalesce off (the paced worker's too)


PACED_MODEL = "bench-paced"
SATURATED_MODEL = "bench-paced-saturated"  # a paced worker as fast as Sizes.stream_saturated


def _words_for(tokens: int, tokens_per_word: float) -> int:
    return max(1, round(tokens / tokens_per_word))


def tokens_per_word(model_dir: Path) -> float:
    """How many tokens one word of the agents' text costs with this tokenizer."""
    from tokenizers import Tokenizer

    from bench.agents import words

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = words(random.Random(7), 2000)
    return len(tokenizer.encode(text, add_special_tokens=False).ids) / 2000


def _summary(result: LoadResult) -> dict[str, Any]:
    lat = result.latencies()
    ttft = result.ttfts()
    return {
        "turns": len(result.calls),
        "errors": result.errors,
        "first_error": result.first_error,
        "sessions": result.sessions,
        "wall_s": result.wall_seconds,
        "turns_per_s": len(result.calls) / result.wall_seconds if result.wall_seconds else 0.0,
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "ttft_p50_ms": percentile(ttft, 0.5) * 1e3 if ttft else None,
        "ttft_p99_ms": percentile(ttft, 0.99) * 1e3 if ttft else None,
        "completion_tokens": sum(c.completion_tokens for c in result.calls),
        "prompt_tokens_max": max((c.prompt_tokens for c in result.calls), default=0),
    }


async def section_latency(stack: Stack, sizes: Sizes) -> list[dict[str, Any]]:
    """Latency (and throughput, CPU) per target, concurrency and streaming mode."""
    rows: list[dict[str, Any]] = []
    targets = [Target("direct", stack.upstream.url), Target("proxy", stack.proxy.url)]
    if stack.litellm is not None:
        targets.append(Target("litellm", stack.litellm.url))
    watched: dict[str, Proc | None] = {
        "proxy": stack.proxy,
        "worker": stack.workers[0],
        "upstream": stack.upstream,
        "litellm": stack.litellm,
    }
    for concurrency in sizes.concurrencies:
        for stream in (False, True):
            for target in targets:
                turns = (sizes.litellm_turns_at if target.kind == "litellm" else sizes.turns_at)[
                    concurrency
                ]
                holder: dict[str, float] = {}

                async def on_start(holder: dict[str, float] = holder) -> None:
                    holder.update({k: p.cpu_seconds() for k, p in watched.items() if p})
                    holder["_t"] = time.perf_counter()

                result = await run_load(
                    target,
                    concurrency=concurrency,
                    total_turns=turns,
                    turns_per_session=sizes.turns_per_session,
                    stream=stream,
                    max_tokens=64,
                    on_start=on_start,
                    max_seconds=sizes.litellm_max_seconds if target.kind == "litellm" else None,
                )
                cpu = {k: p.cpu_seconds() - holder[k] for k, p in watched.items() if p}
                row = _summary(result)
                server = {"direct": "upstream", "proxy": "proxy", "litellm": "litellm"}[target.kind]
                n = max(len(result.calls), 1)
                row.update(
                    target=target.kind,
                    concurrency=concurrency,
                    stream=stream,
                    server_cpu_ms_per_turn=cpu.get(server, 0.0) / n * 1e3,
                    worker_cpu_ms_per_turn=(
                        cpu.get("worker", 0.0) / n * 1e3 if target.kind == "proxy" else None
                    ),
                )
                rows.append(row)
                print(
                    f"  {target.kind:8s} c={concurrency:<4d} stream={stream!s:5s} "
                    f"turns={row['turns']} err={row['errors']} p50={row['p50_ms']:.2f}ms "
                    f"p99={row['p99_ms']:.2f}ms {row['turns_per_s']:.0f}/s "
                    f"cpu={row['server_cpu_ms_per_turn']:.2f}ms/turn",
                    flush=True,
                )
    return rows


async def section_history(stack: Stack, sizes: Sizes) -> list[dict[str, Any]]:
    """Growing conversations (each agent keeps one session, its history two messages
    longer every turn, as an agent loop's is): CPU per turn of what serves them (the
    proxy and its worker; the bare upstream; LiteLLM) and the latency of the first turns
    against the last, side by side in one run."""
    rows: list[dict[str, Any]] = []
    targets = [Target("direct", stack.upstream.url), Target("proxy", stack.proxy.url)]
    if stack.litellm is not None:
        targets.append(Target("litellm", stack.litellm.url))
    serving: dict[str, list[Proc]] = {
        "direct": [stack.upstream],
        "proxy": [stack.proxy, stack.workers[0]],
        "litellm": [stack.litellm] if stack.litellm is not None else [],
    }
    edge = sizes.history_edge_turns
    for agents, turns in sizes.history_runs:
        for target in targets:
            procs = serving[target.kind]
            before: list[float] = []

            async def on_start(before: list[float] = before, procs: list[Proc] = procs) -> None:
                before[:] = [p.cpu_seconds() for p in procs]

            result = await run_load(
                target,
                concurrency=agents,
                total_turns=agents * turns,
                turns_per_session=turns,
                stream=False,
                max_tokens=64,
                on_start=on_start,
            )
            cpu = sum(p.cpu_seconds() - b for p, b in zip(procs, before, strict=True))
            first = [c.seconds * 1e3 for c in result.calls if c.turn < edge]
            last = [c.seconds * 1e3 for c in result.calls if c.turn >= turns - edge]
            n = max(len(result.calls), 1)
            row: dict[str, Any] = {
                "target": target.kind,
                "agents": agents,
                "turns_each": turns,
                "turns": len(result.calls),
                "errors": result.errors,
                "cpu_ms_per_turn": cpu / n * 1e3,
                "turns_per_s": len(result.calls) / result.wall_seconds
                if result.wall_seconds
                else 0.0,
                "p50_first_ms": median(first) if first else None,
                "p50_last_ms": median(last) if last else None,
                "prompt_tokens_last": max((c.prompt_tokens for c in result.calls), default=0),
            }
            rows.append(row)
            _print_history(row)
    for target in targets:
        row = await _large_context(target, serving[target.kind], sizes)
        rows.append(row)
        _print_history(row)
    return rows


def _print_history(row: dict[str, Any]) -> None:
    print(
        f"  {row['target']:8s} {row['agents']}x{row['turns_each']} turns={row['turns']} "
        f"err={row['errors']} cpu={row['cpu_ms_per_turn']:.2f}ms/turn "
        f"p50 first={_fmt(row['p50_first_ms'])}ms last={_fmt(row['p50_last_ms'])}ms",
        flush=True,
    )


async def _large_context(target: Target, procs: list[Proc], sizes: Sizes) -> dict[str, Any]:
    """One agent whose context starts at ``history_large_chars`` characters: its first
    turn (the whole context is new: rendered and tokenized once) is timed apart, then
    CPU per turn over ``history_large_turns`` more, each adding a tool output and the
    reply."""
    turns = sizes.history_large_turns
    edge = min(sizes.history_edge_turns, max(turns // 2, 1))
    calls: list[Call] = []
    errors = 0
    async with client_session(1) as http:
        agent = Agent(
            http,
            target,
            seed=7,
            system_words=60,
            add_words=40,
            max_tokens=64,
            stream=False,
        )
        system = ""
        while len(system) < sizes.history_large_chars:
            system += words(agent.rng, 1000) + "\n"
        await agent.new_session(system=system[: sizes.history_large_chars])
        started = time.perf_counter()
        first = await agent.turn()
        first_seconds = time.perf_counter() - started
        before = [p.cpu_seconds() for p in procs]
        for _ in range(turns):
            agent.observe()
            try:
                calls.append(await agent.turn())
            except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
                errors += 1
                print(f"  {target.kind}: {exc}", flush=True)
                break
    cpu = sum(p.cpu_seconds() - b for p, b in zip(procs, before, strict=True))
    early = [c.seconds * 1e3 for c in calls[:edge]]
    late = [c.seconds * 1e3 for c in calls[-edge:]]
    return {
        "target": target.kind,
        "agents": 1,
        "turns_each": turns,
        "context_chars": sizes.history_large_chars,
        "turns": len(calls),
        "errors": errors,
        "cpu_ms_per_turn": cpu / max(len(calls), 1) * 1e3,
        "turns_per_s": len(calls) / sum(c.seconds for c in calls) if calls else 0.0,
        "first_turn_ms": first_seconds * 1e3,
        "p50_first_ms": median(early) if early else None,
        "p50_last_ms": median(late) if late else None,
        "prompt_tokens_last": max((c.prompt_tokens for c in [first, *calls]), default=0),
    }


async def _proxy_load(proxy: Proc, **load: Any) -> tuple[LoadResult, float]:
    """``run_load`` against ``proxy``, and the CPU seconds the proxy spent meanwhile."""
    before = proxy.cpu_seconds()
    result = await run_load(Target("proxy", proxy.url), **load)
    return result, proxy.cpu_seconds() - before


@dataclass(slots=True, frozen=True)
class _StreamRun:
    concurrency: int
    stream: bool
    mode: str  # "adaptive" (the proxy's default), "step" (--stream-coalesce off), "grouped"
    saturated: bool = False


def _stream_runs(stack: Stack, sizes: Sizes) -> list[_StreamRun]:
    """One round: per concurrency, its streams through each proxy (and whole replies)
    side by side, then the saturated streams."""
    several = {c for c in sizes.stream_concurrencies if c > 1}
    runs: list[_StreamRun] = []
    for c in sizes.stream_concurrencies:
        runs.append(_StreamRun(c, True, "adaptive"))
        if stack.stepwise is not None:
            runs.append(_StreamRun(c, True, "step"))
        if c in several:
            runs.append(_StreamRun(c, False, "adaptive"))
            if stack.grouped is not None:
                runs.append(_StreamRun(c, True, "grouped"))
    streams = sizes.stream_saturated[0]
    if streams:
        runs.append(_StreamRun(streams, True, "adaptive", saturated=True))
        if stack.stepwise is not None:
            runs.append(_StreamRun(streams, True, "step", saturated=True))
        if stack.grouped is not None:
            runs.append(_StreamRun(streams, True, "grouped", saturated=True))
    return runs


async def section_stream(stack: Stack, sizes: Sizes) -> list[dict[str, Any]]:
    """Streams at an engine's pace (every stream gets a token per engine step, as a
    batching GPU engine produces them; the worker sends a step as one frame): proxy CPU
    per streamed token, tokens per content event, and how long the first token takes
    from the worker's engine handing it on to the agent reading it. Side by side at the
    same pace: the proxy's default (adaptive coalescing: every step at once unless its
    event loop runs behind), a proxy that writes every step however busy
    (``--stream-coalesce off``), whole (non-streamed) replies, which cost the turn
    without the per-token writes, and a proxy started with ``--stream-interval``; then
    the same streams at a pace above what the proxy can carry (saturated)."""
    proxies = {"adaptive": stack.proxy, "step": stack.stepwise, "grouped": stack.grouped}
    rows: list[dict[str, Any]] = []
    for round_ in range(sizes.stream_rounds):
        for run in _stream_runs(stack, sizes):
            proxy = proxies[run.mode]
            assert proxy is not None
            turns = (
                sizes.stream_saturated_turns
                if run.saturated
                else sizes.stream_turns_at[run.concurrency]
            )
            result, cpu = await _proxy_load(
                proxy,
                concurrency=run.concurrency,
                total_turns=turns,
                turns_per_session=sizes.turns_per_session,
                stream=run.stream,
                max_tokens=sizes.stream_reply_tokens,
                model=SATURATED_MODEL if run.saturated else PACED_MODEL,
            )
            rows.append(_stream_row(run, round_, result, cpu, sizes))
            if run.stream:
                lags = await _first_token_lags(proxy.url, result.calls)
                rows[-1] |= {
                    "lag_p50_ms": percentile(lags, 0.5) * 1e3 if lags else None,
                    "lag_p99_ms": percentile(lags, 0.99) * 1e3 if lags else None,
                    "lags": len(lags),
                }
            row = rows[-1]
            name = run.mode if run.stream else "whole"
            print(
                f"  paced c={run.concurrency:<3d} {'saturated ' if run.saturated else ''}"
                f"{name:8s} turns={row['turns']} err={row['errors']} "
                f"{row['tokens_per_s']:.0f} tok/s cpu={_fmt(row['cpu_us_per_token'], 0)}us/token "
                f"{_fmt(row['tokens_per_event'], 1)} tokens/event "
                f"first-token lag p50={_fmt(row.get('lag_p50_ms'))}ms",
                flush=True,
            )
    return rows


def _stream_row(
    run: _StreamRun, round_: int, result: LoadResult, cpu: float, sizes: Sizes
) -> dict[str, Any]:
    tokens = sum(c.completion_tokens for c in result.calls)
    events = sum(c.content_events for c in result.calls)
    return {
        "concurrency": run.concurrency,
        "stream": run.stream,
        "mode": run.mode if run.stream else "whole",
        "interval": sizes.stream_grouped_interval if run.mode == "grouped" else 1,
        "saturated": run.saturated,
        "round": round_,
        "turns": len(result.calls),
        "errors": result.errors,
        "first_error": result.first_error,
        "tokens_per_turn": sizes.stream_reply_tokens,
        "engine_tokens_per_s": (
            sizes.stream_saturated[1] if run.saturated else sizes.stream_tokens_per_second
        ),
        "tokens": tokens,
        "tokens_per_s": tokens / result.wall_seconds if result.wall_seconds else 0.0,
        "tokens_per_event": tokens / events if events else None,
        "cpu_us_per_token": cpu / tokens * 1e6 if tokens else None,
        "cpu_ms_per_turn": cpu / len(result.calls) * 1e3 if result.calls else None,
        "lag_p50_ms": None,
        "lag_p99_ms": None,
        "lags": 0,
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


async def wait_for_model(url: str, model: str, within: float = 60.0) -> None:
    """Until a worker serving ``model`` has joined (readiness needs just one worker)."""
    from bench.processes import ADMIN_TOKEN

    deadline = time.perf_counter() + within
    async with client_session(1) as http:
        async with http.post(
            f"{url}/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as response:
            body = await response.json()
        while True:
            async with http.get(
                f"{body['base_url']}/models",
                headers={"Authorization": f"Bearer {body['api_key']}"},
            ) as response:
                served = {m["id"] for m in (await response.json())["data"]}
            if model in served:
                return
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no worker serving {model} joined within {within:g}s")
            await asyncio.sleep(0.2)


async def _first_token_lags(url: str, calls: list[Call]) -> list[float]:
    """Seconds from the engine handing each call's first token on (``first_token_time``
    in the turn's record, instant backend) to the agent reading it. Both are wall-clock
    times on this one machine."""
    from bench.processes import ADMIN_TOKEN

    emitted: dict[tuple[str, int], float] = {}
    async with client_session(1) as http:
        for trial_id in sorted({c.trial_id for c in calls if c.trial_id}):
            async with http.get(
                f"{url}/sessions/{trial_id}/trajectories",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            ) as response:
                body = await response.json()
            for trajectory in body["trajectories"]:
                for turn in trajectory["turns"]:
                    at = (turn.get("extra") or {}).get("first_token_time")
                    if at:
                        emitted[(trial_id, turn["turn"])] = float(at)
    return [
        c.first_token_wall - emitted[(c.trial_id, c.turn)]
        for c in calls
        if c.first_token_wall is not None and (c.trial_id, c.turn) in emitted
    ]


async def section_inmemory(stack: Stack, sizes: Sizes) -> list[dict[str, Any]]:
    """What durability costs: the non-streamed runs of the latency section once more,
    through a second proxy that keeps sessions in memory only (same upstream, its own
    instant worker)."""
    assert stack.volatile is not None
    rows: list[dict[str, Any]] = []
    for concurrency in sizes.concurrencies[:2]:
        result, cpu = await _proxy_load(
            stack.volatile,
            concurrency=concurrency,
            total_turns=sizes.turns_at[concurrency],
            turns_per_session=sizes.turns_per_session,
            stream=False,
            max_tokens=64,
        )
        row = _summary(result) | {
            "concurrency": concurrency,
            "server_cpu_ms_per_turn": cpu / max(len(result.calls), 1) * 1e3,
        }
        rows.append(row)
        print(
            f"  in memory c={concurrency:<4d} turns={row['turns']} err={row['errors']} "
            f"p50={row['p50_ms']:.2f}ms {row['turns_per_s']:.0f}/s "
            f"cpu={row['server_cpu_ms_per_turn']:.2f}ms/turn",
            flush=True,
        )
    return rows


async def section_context(stack: Stack, sizes: Sizes, tpw: float) -> list[dict[str, Any]]:
    """Proxy CPU per turn when the session already holds 1k / 32k / 128k tokens.

    The sizes take turns (one turn of each, round after round), so a machine that gets
    slower or faster while this runs shifts every size alike instead of one."""
    from bench.agents import words

    async with client_session(1) as http:
        agents: list[Agent] = []
        rows: list[dict[str, Any]] = []
        for size in sizes.context_tokens:
            rng = random.Random(size)
            agent = Agent(
                http,
                Target("proxy", stack.proxy.url),
                seed=size,
                system_words=_words_for(size, tpw),
                add_words=_words_for(sizes.context_add_tokens, tpw),
                max_tokens=64,
                stream=False,
            )
            await agent.new_session(words(rng, _words_for(size, tpw)))
            before = stack.proxy.cpu_seconds()
            t0 = time.perf_counter()
            first = await agent.turn()
            rows.append(
                {
                    "context_tokens": first.prompt_tokens,
                    "first_turn_cpu_ms": (stack.proxy.cpu_seconds() - before) * 1e3,
                    "first_turn_ms": (time.perf_counter() - t0) * 1e3,
                }
            )
            agents.append(agent)
        calls: list[list[Call]] = [[] for _ in agents]
        cpu = [0.0 for _ in agents]
        for _ in range(sizes.context_turns):
            for i, agent in enumerate(agents):
                agent.observe()
                before = stack.proxy.cpu_seconds()
                calls[i].append(await agent.turn())
                cpu[i] += stack.proxy.cpu_seconds() - before
        for i, agent in enumerate(agents):
            info = await _session_info(http, stack.proxy.url, agent.trial_id)
            rows[i] |= {
                "final_tokens": calls[i][-1].prompt_tokens + calls[i][-1].completion_tokens,
                "turns": len(calls[i]),
                "request_bytes": len(_body_size(agent)),
                "cpu_ms_per_turn": cpu[i] / len(calls[i]) * 1e3,
                "p50_ms": median([c.seconds for c in calls[i]]) * 1e3,
                "continued": info.get("continued", 0),
            }
            r = rows[i]
            print(
                f"  context {r['context_tokens']:>7d} tokens: {r['cpu_ms_per_turn']:.2f} ms CPU/turn, "
                f"p50 {r['p50_ms']:.2f} ms, first turn {r['first_turn_ms']:.0f} ms",
                flush=True,
            )
    return rows


def _body_size(agent: Agent) -> bytes:
    import json

    return json.dumps({"messages": agent.messages}).encode()


async def _session_info(http: aiohttp.ClientSession, url: str, trial_id: str) -> dict[str, Any]:
    from bench.processes import ADMIN_TOKEN

    async with http.get(
        f"{url}/sessions/{trial_id}/trajectories",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as response:
        body = await response.json()
    reasons = [t["branch_reason"] for tr in body["trajectories"] for t in tr["turns"]]
    return {"continued": reasons.count("continued"), "turns": len(reasons)}


async def section_memory(stack: Stack, sizes: Sizes, tpw: float) -> dict[str, Any]:
    """Proxy RSS per idle session (measured first, on a fresh proxy, so that no memory
    freed by earlier work hides it), then per stored token (sessions of ``memory_tokens``)."""
    proxy = stack.proxy
    sem = asyncio.Semaphore(8)
    async with client_session(8) as http:

        async def one(i: int, system_words: int, add_words: int, max_tokens: int) -> int:
            async with sem:
                agent = Agent(
                    http,
                    Target("proxy", proxy.url),
                    seed=10_000 + i,
                    system_words=system_words,
                    add_words=add_words,
                    max_tokens=max_tokens,
                    stream=False,
                )
                await agent.new_session()
                call = await agent.turn()
                return call.prompt_tokens + call.completion_tokens

        await asyncio.gather(*(one(-1 - i, 8, 4, 8) for i in range(16)))  # warm up
        await asyncio.sleep(0.5)
        rss0 = proxy.rss_bytes()
        idle_tokens = sum(
            await asyncio.gather(*(one(20_000 + i, 8, 4, 8) for i in range(sizes.idle_sessions)))
        )
        await asyncio.sleep(0.5)
        rss1 = proxy.rss_bytes()
        words_each = _words_for(sizes.memory_tokens, tpw)
        stored = sum(
            await asyncio.gather(
                *(one(i, words_each, 20, 64) for i in range(sizes.memory_sessions))
            )
        )
        await asyncio.sleep(0.5)
        rss2 = proxy.rss_bytes()
    out = {
        "sessions": sizes.memory_sessions,
        "tokens_per_session": stored / max(sizes.memory_sessions, 1),
        "stored_tokens": stored,
        "rss_before_mb": rss1 / 2**20,
        "rss_after_mb": rss2 / 2**20,
        "bytes_per_token": (rss2 - rss1) / stored if stored else float("nan"),
        "idle_sessions": sizes.idle_sessions,
        "idle_tokens_each": idle_tokens / max(sizes.idle_sessions, 1),
        "bytes_per_idle_session": (rss1 - rss0) / max(sizes.idle_sessions, 1),
        "rss_idle_before_mb": rss0 / 2**20,
    }
    print(
        f"  memory: {out['bytes_per_token']:.1f} B/token over {stored} tokens; "
        f"{out['bytes_per_idle_session'] / 1024:.1f} KiB per idle session",
        flush=True,
    )
    return out


async def section_history_profile(stack: Stack, sizes: Sizes, out_dir: Path) -> dict[str, Any]:
    """A py-spy profile of the proxy over the late turns of growing conversations: each
    of ``history_profile_agents`` agents (one session each) is grown to the first of
    ``history_profile_turns`` unprofiled, then all run to the second while py-spy
    records (what a turn costs once the history is long)."""
    grown, last = sizes.history_profile_turns
    raw = out_dir / "proxy-profile-history.txt"
    target = Target("proxy", stack.proxy.url)
    agents: list[Agent] = []
    async with client_session(sizes.history_profile_agents) as http:

        async def run(agent: Agent, turns: int) -> None:
            for _ in range(turns):
                if agent.turns:
                    agent.observe()
                await agent.turn()

        for index in range(sizes.history_profile_agents):
            agent = Agent(
                http,
                target,
                seed=1000 + index,
                system_words=60,
                add_words=40,
                max_tokens=64,
                stream=False,
            )
            await agent.new_session()
            agents.append(agent)
        await asyncio.gather(*(run(a, grown) for a in agents))
        spy_proc = _start_py_spy(stack.proxy.popen.pid, raw)
        if spy_proc is None:
            return {"error": "py-spy is not installed (pip install py-spy)"}
        await asyncio.sleep(1.0)  # let py-spy attach
        await asyncio.gather(*(run(a, last - grown) for a in agents))
    error = _stop_py_spy(spy_proc, raw)
    if error is not None:
        return {"error": error}
    return {
        "raw": str(raw),
        "turns": (last - grown) * len(agents),
        "concurrency": len(agents),
        "history_turns": [grown, last],
        "messages_last": len(agents[0].messages),
        "top": summarize_profile(raw),
    }


async def section_profile(
    stack: Stack,
    sizes: Sizes,
    out_dir: Path,
    *,
    paced: bool = False,
) -> dict[str, Any]:
    """A py-spy profile of the proxy's event loop under streaming load: instant replies at
    the second concurrency, or (``paced``) streams at an engine's pace at the stream
    section's highest concurrency."""
    raw = out_dir / ("proxy-profile-paced.txt" if paced else "proxy-profile.txt")
    spy_proc = _start_py_spy(stack.proxy.popen.pid, raw)
    if spy_proc is None:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    await asyncio.sleep(1.0)  # let py-spy attach
    if paced:
        concurrency = sizes.stream_concurrencies[-1]
        load: dict[str, Any] = {
            "total_turns": sizes.stream_turns_at[concurrency],
            "max_tokens": sizes.stream_reply_tokens,
            "model": PACED_MODEL,
        }
    else:
        concurrency = sizes.concurrencies[min(1, len(sizes.concurrencies) - 1)]
        load = {"total_turns": sizes.turns_at[concurrency]}
    deadline = time.perf_counter() + sizes.profile_seconds
    turns = 0
    while time.perf_counter() < deadline:
        result = await run_load(
            Target("proxy", stack.proxy.url),
            concurrency=concurrency,
            turns_per_session=sizes.turns_per_session,
            stream=True,
            **load,
        )
        turns += len(result.calls)
    error = _stop_py_spy(spy_proc, raw)
    if error is not None:
        return {"error": error}
    return {
        "raw": str(raw),
        "turns": turns,
        "concurrency": concurrency,
        "paced": paced,
        "tokens_per_turn": sizes.stream_reply_tokens if paced else sizes.reply_tokens,
        "top": summarize_profile(raw),
    }


def _stop_py_spy(spy_proc: subprocess.Popen[bytes], raw: Path) -> str | None:
    """Stop a recording py-spy; why it wrote no profile, if it did not."""
    spy_proc.send_signal(signal.SIGINT)
    try:
        _, err = spy_proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        spy_proc.kill()
        err = b"timeout"
    if not raw.is_file():
        return f"py-spy failed: {err.decode(errors='replace')[-300:]}"
    return None


def _start_py_spy(pid: int, raw: Path) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return None
    return subprocess.Popen(
        [spy, "record", "-p", str(pid), "-r", "200", "-f", "raw", "--threads", "-o", str(raw)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def summarize_profile(
    raw: Path, top: int = 25, thread: str = "MainThread"
) -> list[tuple[str, float, float]]:
    """(function, self %, total %) of ``thread``'s samples (the event loop's: the store's
    writer thread and idle pool threads blocked in C would count as busy), from py-spy's
    collapsed stacks, heaviest first. Stacks recorded without thread names all count."""
    self_counts: dict[str, int] = {}
    total_counts: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text:
            continue
        count = int(count_text)
        parts = stack_text.split(";")
        if parts[0].startswith("thread ("):
            if not parts[0].endswith(f": {thread}"):
                continue
            parts = parts[1:]
        frames = [
            f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" if " (" in f else f
            for f in parts
        ]
        samples += count
        self_counts[frames[-1]] = self_counts.get(frames[-1], 0) + count
        for frame in set(frames):
            total_counts[frame] = total_counts.get(frame, 0) + count
    if not samples:
        return []
    ranked = sorted(self_counts.items(), key=lambda kv: -kv[1])[:top]
    return [(name, 100 * n / samples, 100 * total_counts[name] / samples) for name, n in ranked]


async def section_replicas(
    procs: Processes, model_dir: Path, sizes: Sizes, proxy_args: list[str], durable: bool
) -> list[dict[str, Any]]:
    """The same load through one proxy and through two replicas (``--peers``), one worker
    process serving all of them: aggregate turns/s and streamed tokens/s, and each
    replica's CPU per turn. Each agent registers its sessions at one replica (which owns
    them) and talks to it; the agents are split evenly."""
    rows: list[dict[str, Any]] = []
    for count in (1, 2):
        ports = [free_port() for _ in range(count)]
        peers = [f"http://127.0.0.1:{port}" for port in ports]
        replicas = [
            procs.proxy(
                [*proxy_args, "--public-url", peers[i], "--peers", ",".join(peers)],
                durable=durable,
                name=f"replicas-{count}-{i}",
                port=ports[i],
            )
            for i in range(count)
        ]
        for replica in replicas:
            wait_http(replica, "/healthz")
        worker = procs.instant_worker(
            replicas, model_dir, reply_tokens=sizes.reply_tokens, index=10 + count
        )
        for replica in replicas:
            wait_http(replica, "/readyz")
        for stream, turns in ((False, sizes.replica_turns), (True, sizes.replica_stream_turns)):
            before = [r.cpu_seconds() for r in replicas]
            started = time.perf_counter()
            loads = await asyncio.gather(
                *(
                    run_load(
                        Target("proxy", replica.url),
                        concurrency=max(1, sizes.replica_concurrency // count),
                        total_turns=turns // count,
                        turns_per_session=sizes.turns_per_session,
                        stream=stream,
                        max_tokens=sizes.reply_tokens,
                        seed=i,
                    )
                    for i, replica in enumerate(replicas)
                )
            )
            wall = time.perf_counter() - started
            cpu = [r.cpu_seconds() - b for r, b in zip(replicas, before, strict=True)]
            done = sum(len(load.calls) for load in loads)
            tokens = sum(c.completion_tokens for load in loads for c in load.calls)
            row = {
                "replicas": count,
                "stream": stream,
                "turns": done,
                "errors": sum(load.errors for load in loads),
                "first_error": next((x.first_error for x in loads if x.first_error), ""),
                "turns_per_s": done / wall if wall else 0.0,
                "tokens_per_s": tokens / wall if wall else 0.0,
                "cpu_ms_per_turn": [
                    c / len(load.calls) * 1e3 if load.calls else None
                    for c, load in zip(cpu, loads, strict=True)
                ],
            }
            rows.append(row)
            print(
                f"  replicas={count} stream={stream} {row['turns_per_s']:.0f} turns/s "
                f"{row['tokens_per_s']:.0f} tok/s err={row['errors']}",
                flush=True,
            )
        worker.stop()
        for replica in replicas:
            replica.stop()
    return rows


async def run(
    model_dir: Path,
    sizes: Sizes,
    sections: tuple[str, ...],
    *,
    proxy_args: list[str],
    with_litellm: bool,
    durable: bool = True,
    out_dir: Path,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``sections``; ``checkpoint`` receives the results after each section."""
    results: dict[str, Any] = {
        "sizes": sizes,
        "proxy_args": proxy_args,
        "durable": durable,
        "load_average_start": os.getloadavg(),
    }
    save = checkpoint or (lambda _r: None)
    tpw = tokens_per_word(model_dir)
    results["tokens_per_word"] = tpw
    with Processes() as procs:
        proxy = procs.proxy(proxy_args, durable=durable)
        upstream = procs.upstream(model_dir, reply_tokens=sizes.reply_tokens)
        wait_http(proxy, "/healthz")
        worker = procs.instant_worker(proxy, model_dir, reply_tokens=sizes.reply_tokens)
        paced = grouped = stepwise = saturated = None
        if "stream" in sections:
            if sizes.stream_grouped_interval > 1:
                interval = ["--stream-interval", str(sizes.stream_grouped_interval)]
                grouped = procs.proxy([*proxy_args, *interval], durable=durable, name="grouped")
                wait_http(grouped, "/healthz")
            off = ["--stream-coalesce", "off"]
            stepwise = procs.proxy([*proxy_args, *off], durable=durable, name="stepwise")
            wait_http(stepwise, "/healthz")
            streaming = [p for p in (proxy, grouped, stepwise) if p is not None]
            paced = procs.instant_worker(
                streaming,
                model_dir,
                reply_tokens=sizes.stream_reply_tokens,
                index=1,
                name=PACED_MODEL,
                tokens_per_second=sizes.stream_tokens_per_second,
            )
            if sizes.stream_saturated[0]:
                saturated = procs.instant_worker(
                    streaming,
                    model_dir,
                    reply_tokens=sizes.stream_reply_tokens,
                    index=3,
                    name=SATURATED_MODEL,
                    tokens_per_second=sizes.stream_saturated[1],
                )
        wait_http(proxy, "/readyz")
        volatile = volatile_worker = None
        if "inmemory" in sections and durable:
            volatile = procs.proxy(proxy_args, durable=False, name="proxy-in-memory")
            wait_http(volatile, "/healthz")
            volatile_worker = procs.instant_worker(
                volatile, model_dir, reply_tokens=sizes.reply_tokens, index=2
            )
            wait_http(volatile, "/readyz")
        wait_http(upstream, "/healthz")
        litellm = procs.litellm(upstream) if with_litellm else None
        if litellm is not None:
            try:
                wait_http(litellm, "/health/liveliness", within=180)
            except (RuntimeError, TimeoutError) as exc:
                results["litellm_error"] = str(exc)[-500:]
                litellm.stop()
                litellm = None
        elif with_litellm:
            results["litellm_error"] = "LiteLLM side environment missing (make bench-litellm)"
        stack = Stack(proxy, [worker], upstream, litellm, paced, volatile, grouped, stepwise)
        results["log_dir"] = str(procs.log_dir)
        if "latency" in sections:
            print("latency / throughput", flush=True)
            results["latency"] = await section_latency(stack, sizes)
            save(results)
        if "history" in sections:
            print("growing conversations", flush=True)
            results["history"] = await section_history(stack, sizes)
            save(results)
        if "stream" in sections:
            print("paced streams", flush=True)
            for streaming_proxy in (proxy, grouped, stepwise):
                if streaming_proxy is not None:
                    await wait_for_model(streaming_proxy.url, PACED_MODEL)
                    if saturated is not None:
                        await wait_for_model(streaming_proxy.url, SATURATED_MODEL)
            results["stream"] = await section_stream(stack, sizes)
            for stopped in (grouped, stepwise, saturated):
                if stopped is not None:
                    stopped.stop()  # what follows is measured without them
            save(results)
        if volatile is not None:
            print("in memory (no durability)", flush=True)
            results["inmemory"] = await section_inmemory(stack, sizes)
            # Its processes must not disturb what follows.
            volatile.stop()
            if volatile_worker is not None:
                volatile_worker.stop()
            save(results)
        if "context" in sections:
            print("long contexts", flush=True)
            results["context"] = await section_context(stack, sizes, tpw)
            save(results)
        if "profile" in sections:
            print("profile", flush=True)
            results["profile"] = await section_profile(stack, sizes, out_dir)
            if "history" in sections:
                results["history_profile"] = await section_history_profile(stack, sizes, out_dir)
            if "stream" in sections:
                results["stream_profile"] = await section_profile(stack, sizes, out_dir, paced=True)
            save(results)
        if "memory" in sections:
            # After every section that uses this proxy: it fills the proxy with sessions.
            print("memory", flush=True)
            results["memory"] = await section_memory(stack, sizes, tpw)
            save(results)
        results["proxy_rss_end_mb"] = proxy.rss_bytes() / 2**20
        results["load_average_end"] = os.getloadavg()
        if "replicas" in sections:
            # Last: it stops this proxy and its workers (the replicas get the machine).
            print("replicas", flush=True)
            for stopped in (proxy, worker, paced, grouped, upstream):
                if stopped is not None:
                    stopped.stop()
            results["replicas"] = await section_replicas(
                procs, model_dir, sizes, proxy_args, durable
            )
            save(results)
        if "vllm" in sections:
            # Last, alone: it starts a real engine twice, one after the other.
            print("vllm serve beside the proxy and a vllm worker", flush=True)
            for stopped in procs.procs:
                stopped.stop()
            results["vllm"] = await section_vllm(sizes, proxy_args, durable, procs.log_dir)
            save(results)
    return results
