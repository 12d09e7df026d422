"""The benchmark harness at a tiny size: it starts the real proxy, an ``instant`` worker
and the baseline upstream, drives agents through them and reports consistent numbers.
No timing is asserted (speed belongs to ``python -m bench``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.agents import percentile
from bench.harness import Sizes, summarize_profile
from tests.e2e.conftest import TIMEOUT_FACTOR

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One run of every section the tests read (its processes' start-up is most of its
    time), the replicas last, as ``bench`` orders them."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--no-litellm",
            "--sections",
            "latency,history,stream,inmemory,context,memory,replicas",
            "--model",
            str(tiny_model_dir),
            "--out",
            str(out / "RESULTS.md"),
            "--json",
            str(out / "results.json"),
        ],
        cwd=REPO,
        check=False,
        timeout=300 * TIMEOUT_FACTOR,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data: dict[str, object] = json.loads((out / "results.json").read_text())
    data["_markdown"] = (out / "RESULTS.md").read_text()
    return data


def test_every_load_run_completes_its_turns(results: dict[str, object]) -> None:
    """Each (target, concurrency, mode) ran exactly the turns asked for, without errors,
    with positive latencies, throughput and token counts."""
    sizes = Sizes.quick()
    rows = results["latency"]
    assert isinstance(rows, list)
    seen = {(r["target"], r["concurrency"], r["stream"]) for r in rows}
    assert seen == {
        (t, c, s) for t in ("direct", "proxy") for c in sizes.concurrencies for s in (False, True)
    }
    for row in rows:
        assert row["errors"] == 0, row["first_error"]
        assert row["turns"] == sizes.turns_at[row["concurrency"]]
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["turns_per_s"] > 0
        # Every reply carries reply_tokens tokens (the last one is eos).
        if row["target"] == "proxy":
            assert row["completion_tokens"] == row["turns"] * sizes.reply_tokens
        assert row["sessions"] >= math.ceil(row["turns"] / sizes.turns_per_session)
        if row["stream"]:
            assert 0 < row["ttft_p50_ms"] <= row["p50_ms"] + 1e-9


def test_growing_conversations_keep_one_session_per_agent(results: dict[str, object]) -> None:
    """Each growing-conversation run served every agent's turns in one session on every
    target, its prompts growing to the end, with a CPU figure and both latency edges."""
    sizes = Sizes.quick()
    rows = results["history"]
    assert isinstance(rows, list)
    assert {(r["target"], r["agents"], r["turns_each"], r.get("context_chars")) for r in rows} == {
        (t, a, n, None) for t in ("direct", "proxy") for a, n in sizes.history_runs
    } | {(t, 1, sizes.history_large_turns, sizes.history_large_chars) for t in ("direct", "proxy")}
    for row in rows:
        assert row["errors"] == 0
        assert row["turns"] == row["agents"] * row["turns_each"]
        assert row["cpu_ms_per_turn"] > 0
        assert row["p50_first_ms"] > 0
        assert row["p50_last_ms"] > 0
    proxy = [r for r in rows if r["target"] == "proxy"]
    # A history two messages longer each turn: the last prompt is far longer than a
    # first one (60 system + 40 user words, ~1.3 tokens a word on the tiny vocabulary).
    grown = [r for r in proxy if not r.get("context_chars")]
    assert all(r["prompt_tokens_last"] > 60 * r["turns_each"] for r in grown)
    # The large context is in every prompt (at least a token per 8 characters), and its
    # first turn, timed apart, rendered all of it.
    (large,) = [r for r in proxy if r.get("context_chars")]
    assert large["prompt_tokens_last"] > sizes.history_large_chars / 8
    assert large["first_turn_ms"] > 0


def test_long_context_turns_continue_the_session(results: dict[str, object]) -> None:
    """The long-context runs reach the asked context sizes and every measured turn
    continued the stored context (no re-rendering of the history)."""
    sizes = Sizes.quick()
    rows = results["context"]
    assert isinstance(rows, list)
    assert len(rows) == len(sizes.context_tokens)
    for row, asked in zip(rows, sizes.context_tokens, strict=True):
        assert row["context_tokens"] >= asked * 0.8
        assert row["turns"] == sizes.context_turns
        assert row["continued"] == sizes.context_turns
        assert row["final_tokens"] > row["context_tokens"]
        assert row["cpu_ms_per_turn"] >= 0


def test_paced_streams_are_measured_per_token(results: dict[str, object]) -> None:
    """Each paced run carried every token of every reply and charged the proxy's CPU to
    them; streamed runs (the adaptive default, every step through the --stream-coalesce
    off proxy, in groups through the --stream-interval proxy) timed each first token from
    the engine to the agent and counted their events, beside whole replies; then the same
    three at the saturated pace."""
    sizes = Sizes.quick()
    rows = results["stream"]
    assert isinstance(rows, list)
    grouped = sizes.stream_grouped_interval
    expected = []
    for c in sizes.stream_concurrencies:
        expected += [(c, "adaptive", 1, False), (c, "step", 1, False)]
        if c > 1:
            expected += [(c, "whole", 1, False), (c, "grouped", grouped, False)]
    saturated = sizes.stream_saturated[0]
    expected += [(saturated, m, i, True) for m, i in (("adaptive", 1), ("step", 1), ("grouped", 4))]
    assert [(r["concurrency"], r["mode"], r["interval"], r["saturated"]) for r in rows] == expected
    for row in rows:
        assert row["errors"] == 0, row["first_error"]
        turns = (
            sizes.stream_saturated_turns
            if row["saturated"]
            else sizes.stream_turns_at[row["concurrency"]]
        )
        assert row["turns"] == turns
        assert row["tokens"] == row["turns"] * sizes.stream_reply_tokens
        assert row["cpu_us_per_token"] > 0
        if row["stream"]:
            assert row["lags"] == row["turns"]  # every turn's first token was matched
            assert 0 < row["lag_p50_ms"] <= row["lag_p99_ms"]
            # Every event carried a token at least; groups carry more than one.
            assert row["tokens_per_event"] >= 1.0
            if row["mode"] == "grouped":
                assert row["tokens_per_event"] > 1.5
    markdown = str(results["_markdown"])
    assert "`--stream-interval 4`" in markdown
    assert "`--stream-coalesce off`" in markdown
    assert f"| {saturated} × {sizes.stream_saturated[1]:.0f}/s |" in markdown


def test_in_memory_runs_repeat_the_non_streamed_ones(results: dict[str, object]) -> None:
    """The second, in-memory proxy served the same non-streamed load without errors."""
    sizes = Sizes.quick()
    rows = results["inmemory"]
    assert isinstance(rows, list)
    assert [r["concurrency"] for r in rows] == list(sizes.concurrencies[:2])
    for row in rows:
        assert row["errors"] == 0, row["first_error"]
        assert row["turns"] == sizes.turns_at[row["concurrency"]]
        assert row["server_cpu_ms_per_turn"] > 0


def test_memory_section_counts_the_stored_tokens(results: dict[str, object]) -> None:
    """The memory run stored the sessions it made and measured the proxy's RSS."""
    sizes = Sizes.quick()
    memory = results["memory"]
    assert isinstance(memory, dict)
    assert memory["sessions"] == sizes.memory_sessions
    assert memory["stored_tokens"] >= sizes.memory_sessions * sizes.memory_tokens * 0.8
    assert memory["rss_after_mb"] > 0


def test_markdown_report_has_every_table(results: dict[str, object]) -> None:
    """RESULTS.md names the machine and has the latency, throughput, context and memory
    tables."""
    text = results["_markdown"]
    assert isinstance(text, str)
    for heading in (
        "## Added latency",
        "## Throughput and CPU",
        "## What durability costs",
        "## Streams at an engine's pace",
        "## Long contexts",
        "## Memory",
        "## Growing conversations",
    ):
        assert heading in text
    assert "cores" in text
    assert "python -m bench" in text


def test_percentile_interpolates() -> None:
    """p50/p99 are linear-interpolated order statistics."""
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_profile_summary_ranks_self_time(tmp_path: Path) -> None:
    """py-spy's collapsed stacks become (function, self %, total %) rows."""
    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (a.py:1);handle (b.py:2);encode (c.py:3) 6\n"
        "main (a.py:1);handle (b.py:9) 3\n"
        "main (a.py:1) 1\n"
    )
    top = summarize_profile(raw)
    assert top[0] == ("encode (c.py)", 60.0, 60.0)
    assert ("handle (b.py)", 30.0, 90.0) in top


def test_profile_summary_counts_the_event_loop_thread_only(tmp_path: Path) -> None:
    """With --threads, a writer thread blocked in C does not dilute the loop's shares."""
    raw = tmp_path / "p.txt"
    raw.write_text(
        "thread (0x1): MainThread;main (a.py:1);send (s.py:4) 3\n"
        "thread (0x1): MainThread;main (a.py:1) 1\n"
        "thread (0x2): Thread-1 (_run);_run (store.py:7) 50\n"
    )
    top = summarize_profile(raw)
    assert top[0] == ("send (s.py)", 75.0, 75.0)
    assert all("store.py" not in name for name, _, _ in top)


def test_the_replicas_section_measures_one_and_two_replicas(results: dict[str, object]) -> None:
    """One proxy, then two --peers replicas with one worker process joined to both: every
    turn completes, and each replica reports its CPU per turn. Sections asked for with
    it still run (the replicas stop the first proxy, so they come last)."""
    memory = results["memory"]
    assert isinstance(memory, dict)
    assert memory["sessions"] > 0
    rows = results["replicas"]
    assert isinstance(rows, list)
    sizes = Sizes.quick()
    assert [(r["replicas"], r["stream"]) for r in rows] == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    for row in rows:
        assert row["errors"] == 0, row["first_error"]
        wanted = sizes.replica_stream_turns if row["stream"] else sizes.replica_turns
        assert row["turns"] == wanted
        assert len(row["cpu_ms_per_turn"]) == row["replicas"]
        assert all(cpu > 0 for cpu in row["cpu_ms_per_turn"])
    assert "## One proxy and two replicas" in str(results["_markdown"])
