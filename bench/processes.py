"""Starting and stopping the processes under test, all on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
LITELLM_VENV = REPO / ".cache" / "litellm-venv"
LITELLM_KEY = "sk-rollout-relay-bench"
# The proxy runs as in production: authenticated, and durable unless told otherwise.
ADMIN_TOKEN = "bench-admin-token"
WORKER_TOKEN = "bench-worker-token"
AUTH_ENV = {"RELAY_ADMIN_TOKEN": ADMIN_TOKEN, "RELAY_WORKER_TOKEN": WORKER_TOKEN}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _scheduled_seconds(pid: int) -> float | None:
    """On-CPU time of every thread of ``pid`` (``/proc/<pid>/task/*/schedstat``, in ns);
    None where there is no such file. Threads that ended are not counted: the processes
    measured keep theirs for their whole life."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total / 1e9 if total else None


@dataclass(slots=True)
class Proc:
    """One child process and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    ps: psutil.Process = field(init=False)

    def __post_init__(self) -> None:
        self.ps = psutil.Process(self.popen.pid)

    def cpu_seconds(self) -> float:
        """CPU time of the process and its children so far. The process's own comes from
        the scheduler's nanosecond counters where Linux has them (``cpu_times`` counts
        10 ms ticks, too coarse for a few dozen turns of a few ms each)."""
        own = _scheduled_seconds(self.popen.pid)
        if own is None:
            with contextlib.suppress(psutil.Error):
                t = self.ps.cpu_times()
                own = t.user + t.system
        total = own or 0.0
        for p in self.ps.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss_bytes(self) -> int:
        total = 0
        for p in [self.ps, *self.ps.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def cli_module(checkout: Path) -> str:
    """The module that runs ``rollout-relay`` in ``checkout``: ``rollout_relay.cli``, or
    ``proxy.cli`` in checkouts from before the command line left the proxy's package (for
    ``bench.compare`` against older code); empty when it is neither."""
    for module in ("rollout_relay.cli", "proxy.cli"):
        if (checkout / (module.replace(".", "/") + ".py")).is_file():
            return module
    return ""


class Processes:
    """The processes of one benchmark run; everything is stopped on exit.

    ``checkout``: run the proxy and workers of another checkout of rollout-relay (its
    own code, this environment's packages), to compare code in one session."""

    def __init__(self, log_dir: Path | None = None, checkout: Path | None = None) -> None:
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rollout-relay-bench-"))
        self.checkout = checkout
        self.procs: list[Proc] = []
        self.cli = cli_module(checkout or REPO)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        out = log.open("wb")
        code = {"PYTHONPATH": str(self.checkout)} if self.checkout is not None else {}
        popen = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), **code},
            cwd=self.checkout or REPO,
        )
        out.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def proxy(
        self,
        extra_args: list[str],
        *,
        durable: bool = True,
        name: str = "proxy",
        port: int | None = None,
    ) -> Proc:
        """``rollout-relay proxy``; ``durable`` stores sessions in SQLite (``--data-dir``,
        one per proxy process)."""
        port = port or free_port()
        env = dict(AUTH_ENV)
        if durable:
            env["RELAY_DATA_DIR"] = str(self.log_dir / ("data" if name == "proxy" else name))
        proc = self.spawn(
            name,
            [
                sys.executable,
                "-m",
                self.cli,
                "--log-level",
                "WARNING",
                "proxy",
                "--port",
                str(port),
                "--max-tokens",
                "4096",
                "--cache-dir",
                str(self.log_dir / "proxy-cache"),
                *extra_args,
            ],
            env=env,
        )
        proc.url = f"http://127.0.0.1:{port}"
        return proc

    def instant_worker(
        self,
        proxy: Proc | list[Proc],
        model_dir: Path,
        *,
        reply_tokens: int,
        index: int = 0,
        name: str = "bench",
        tokens_per_second: float = 0.0,
    ) -> Proc:
        proxies = proxy if isinstance(proxy, list) else [proxy]
        dial = [
            a
            for p in proxies
            for a in ("--proxy", p.url.replace("http://", "ws://") + "/ws/worker")
        ]
        return self.spawn(
            f"worker-{index}",
            [
                sys.executable,
                "-m",
                self.cli,
                "--log-level",
                "WARNING",
                "worker",
                *dial,
                "--backend",
                "instant",
                "--model",
                str(model_dir),
                "--name",
                name,
                "--tokens-per-second",
                str(tokens_per_second),
                "--max-concurrency",
                "4096",
                "--reply-tokens",
                str(reply_tokens),
                "--worker-id",
                f"bench-{index}",
            ],
            env=AUTH_ENV,
        )

    def upstream(self, model_dir: Path, *, reply_tokens: int) -> Proc:
        port = free_port()
        proc = self.spawn(
            "upstream",
            [
                sys.executable,
                "-m",
                "bench.upstream",
                "--port",
                str(port),
                "--model-dir",
                str(model_dir),
                "--reply-tokens",
                str(reply_tokens),
            ],
        )
        proc.url = f"http://127.0.0.1:{port}"
        return proc

    def litellm(self, upstream: Proc) -> Proc | None:
        """The LiteLLM proxy forwarding to ``upstream``; None when its side environment
        (``make bench-litellm-env``) is missing."""
        exe = LITELLM_VENV / "bin" / "litellm"
        if not exe.is_file():
            return None
        port = free_port()
        config = self.log_dir / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            "  - model_name: bench\n"
            "    litellm_params:\n"
            "      model: openai/bench\n"
            f"      api_base: {upstream.url}/v1\n"
            "      api_key: bench\n"
            "litellm_settings:\n"
            "  telemetry: false\n"
            "  set_verbose: false\n"
        )
        proc = self.spawn(
            "litellm",
            [
                str(exe),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            env={
                "LITELLM_MASTER_KEY": LITELLM_KEY,
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_LOG": "ERROR",
                "DISABLE_SCHEMA_UPDATE": "True",
            },
        )
        proc.url = f"http://127.0.0.1:{port}"
        return proc


def wait_http(
    proc: Proc, path: str, *, within: float = 120.0, ok: tuple[int, ...] = (200,)
) -> None:
    """Poll ``proc.url + path`` until it answers with one of ``ok``."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + within
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        try:
            with urllib.request.urlopen(proc.url + path, timeout=2) as response:
                if response.status in ok:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code in ok:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} not ready within {within}s:\n{proc.tail()}")
        time.sleep(0.1)
