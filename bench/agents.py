"""Simulated agents: multi-turn chat sessions over real HTTP (aiohttp's client).

An agent behaves like a real one: it sends its whole history every turn (system prompt,
the replies it received verbatim, its tool outputs), streaming or not, and starts a new
session after a number of turns. Timings are taken on the client side.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "or",
    "at",
    "from",
    "file",
    "line",
    "test",
    "error",
    "value",
    "return",
    "function",
    "class",
    "import",
    "def",
    "self",
    "none",
    "true",
    "false",
    "print",
    "list",
    "dict",
    "string",
    "number",
    "path",
    "module",
    "result",
    "output",
    "input",
    "check",
    "build",
    "run",
    "make",
    "call",
    "data",
    "open",
    "read",
    "write",
    "close",
    "index",
    "count",
    "field",
    "type",
    "name",
    "args",
    "kwargs",
    "loop",
    "async",
    "await",
    "task",
    "patch",
    "diff",
    "commit",
    "branch",
    "merge",
    "review",
    "fix",
    "bug",
    "issue",
    "change",
    "update",
    "remove",
    "add",
    "new",
    "old",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass(slots=True, frozen=True)
class Target:
    """Where the agents send their calls: ``proxy`` (a session per conversation),
    ``direct`` (the instant upstream) or ``litellm``."""

    kind: str
    url: str


@dataclass(slots=True)
class Call:
    seconds: float
    ttft: float | None
    prompt_tokens: int
    completion_tokens: int
    # Which recorded turn this call became (proxy targets): its session and its index.
    trial_id: str = ""
    turn: int = -1
    # Wall-clock time (Unix seconds) the first content arrived, streamed calls only.
    first_token_wall: float | None = None
    # Streamed calls: how many events carried content (fewer than tokens when coalesced).
    content_events: int = 0


@dataclass(slots=True)
class LoadResult:
    calls: list[Call] = field(default_factory=list)
    wall_seconds: float = 0.0
    errors: int = 0
    sessions: int = 0
    first_error: str = ""

    def latencies(self) -> list[float]:
        return [c.seconds for c in self.calls]

    def ttfts(self) -> list[float]:
        return [c.ttft for c in self.calls if c.ttft is not None]


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Agent:
    """One conversation at a time against ``target``."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        target: Target,
        *,
        seed: int,
        system_words: int,
        add_words: int,
        max_tokens: int,
        stream: bool,
        model: str = "bench",
    ) -> None:
        self.http = http
        self.model = model
        self.target = target
        self.rng = random.Random(seed)
        self.system_words = system_words
        self.add_words = add_words
        self.max_tokens = max_tokens
        self.stream = stream
        self.base_url = ""
        self.headers: dict[str, str] = {}
        self.messages: list[dict[str, Any]] = []
        self.trial_id = ""
        self.turns = 0  # calls made in the current session

    async def new_session(self, system: str | None = None) -> None:
        if self.target.kind == "proxy":
            from bench.processes import ADMIN_TOKEN

            async with self.http.post(
                f"{self.target.url}/sessions",
                json={},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            ) as response:
                response.raise_for_status()
                body = await response.json()
            self.base_url = body["base_url"]
            self.trial_id = body["trial_id"]
            self.headers = {"Authorization": f"Bearer {body['api_key']}"}
        else:
            from bench.processes import LITELLM_KEY

            self.base_url = f"{self.target.url}/v1"
            self.headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
        self.turns = 0
        self.messages = [
            {"role": "system", "content": system or words(self.rng, self.system_words)},
            {"role": "user", "content": words(self.rng, self.add_words)},
        ]

    def observe(self, n_words: int | None = None) -> None:
        """The environment's answer to the last reply (a tool output, say)."""
        self.messages.append(
            {"role": "user", "content": words(self.rng, n_words or self.add_words)}
        )

    async def turn(self) -> Call:
        body = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
        }
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        data = json.dumps(body).encode()
        headers = {**self.headers, "Content-Type": "application/json"}
        started = time.perf_counter()
        ttft: float | None = None
        first_wall: float | None = None
        usage: dict[str, Any] = {}
        parts: list[str] = []
        async with self.http.post(
            f"{self.base_url}/chat/completions", data=data, headers=headers
        ) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            if not self.stream:
                reply = await response.json()
                seconds = time.perf_counter() - started
                content = reply["choices"][0]["message"]["content"] or ""
                usage = reply.get("usage") or {}
            else:
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    chunk = json.loads(payload)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            if ttft is None:
                                ttft = time.perf_counter() - started
                                first_wall = time.time()
                            parts.append(text)
                seconds = time.perf_counter() - started
                content = "".join(parts)
        self.messages.append({"role": "assistant", "content": content})
        self.turns += 1
        return Call(
            seconds,
            ttft,
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            trial_id=self.trial_id,
            turn=self.turns - 1,
            first_token_wall=first_wall,
            content_events=len(parts) if self.stream else 0,
        )


def client_session(concurrency: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(concurrency, 1) + 8, force_close=False),
        timeout=aiohttp.ClientTimeout(total=600),
    )


async def run_load(
    target: Target,
    *,
    concurrency: int,
    total_turns: int,
    turns_per_session: int,
    stream: bool,
    system_words: int = 60,
    add_words: int = 40,
    max_tokens: int = 64,
    seed: int = 0,
    on_start: Callable[[], Awaitable[None]] | None = None,
    max_seconds: float | None = None,
    model: str = "bench",
) -> LoadResult:
    """``concurrency`` agents share ``total_turns`` turns; each opens a new session every
    ``turns_per_session`` turns. Session creation is not timed. With ``max_seconds``, no
    turn starts after that much time (slow targets measured on a budget)."""
    result = LoadResult()
    remaining = total_turns
    deadline = float("inf")

    async with client_session(concurrency) as http:

        async def agent_loop(index: int) -> None:
            nonlocal remaining
            agent = Agent(
                http,
                target,
                seed=seed * 100_003 + index,
                system_words=system_words,
                add_words=add_words,
                max_tokens=max_tokens,
                stream=stream,
                model=model,
            )
            done_in_session = turns_per_session
            while remaining > 0 and time.perf_counter() < deadline:
                remaining -= 1
                try:
                    if done_in_session >= turns_per_session:
                        await agent.new_session()
                        result.sessions += 1
                        done_in_session = 0
                    else:
                        agent.observe()
                    result.calls.append(await agent.turn())
                    done_in_session += 1
                except (TimeoutError, aiohttp.ClientError, RuntimeError, KeyError) as exc:
                    result.errors += 1
                    if not result.first_error:
                        result.first_error = f"{type(exc).__name__}: {exc}"
                    done_in_session = turns_per_session

        # Warm the connection pool and both ends before timing.
        warm = [agent_loop(-1 - i) for i in range(min(concurrency, 8))]
        saved = remaining
        remaining = min(concurrency, 8) * 2
        await asyncio.gather(*warm)
        result.calls.clear()
        result.sessions = 0
        result.errors = 0
        remaining = saved
        if on_start is not None:
            await on_start()
        started = time.perf_counter()
        if max_seconds is not None:
            deadline = started + max_seconds
        await asyncio.gather(*(agent_loop(i) for i in range(concurrency)))
        result.wall_seconds = time.perf_counter() - started
    return result
