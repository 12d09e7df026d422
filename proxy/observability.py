"""Prometheus metrics (``GET /metrics``, prometheus_client) and the request middleware that
feeds them, names every request (``X-Request-Id``) and writes one log line per request.

Each app has its own ``CollectorRegistry`` so several proxies can live in one process
(tests). Counters kept by the worker pool (plain ints, the relay knows nothing of
Prometheus) and gauges such as connected workers are read at scrape time by a collector.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.api.errors import ERROR_CODE
from proxy.coalesce import StreamCoalescer
from proxy.ids import new_id
from proxy.logs import request_id_var, trial_id_var
from relay.pool import WorkerPool

log = logging.getLogger("proxy.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("request_id", str)
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

# Latency buckets from a millisecond to ten minutes (agent turns can be long).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

# Route (aiohttp's canonical path) → API label. Unknown routes are "other".
_APIS = {
    "/{trial_id}/v1/chat/completions": "openai.chat",
    "/{trial_id}/v1/completions": "openai.completions",
    "/{trial_id}/v1/responses": "openai.responses",
    "/{trial_id}/v1/models": "openai.models",
    "/{trial_id}/v1/messages": "anthropic.messages",
    "/{trial_id}/v1/messages/count_tokens": "anthropic.count_tokens",
    "/ws/worker": "worker",
    "/healthz": "ops",
    "/readyz": "ops",
    "/metrics": "ops",
}

# Routes that do not get an INFO access line (probes and scrapes every few seconds).
_QUIET_APIS = {"ops"}


def route_of(request: web.Request) -> str:
    """The matched route's pattern (bounded label values), or ``unmatched``."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def api_of(route: str) -> str:
    if route in _APIS:
        return _APIS[route]
    if route.startswith("/sessions"):
        return "sessions"
    return "other"


class _PoolCollector(Collector):
    """Gauges and counters read from the pool and the session registry at scrape time."""

    def __init__(self, pool: WorkerPool, sessions_open: Callable[[], int]) -> None:
        self._pool = pool
        self._sessions_open = sessions_open

    def collect(self) -> Iterator[Metric]:
        pool, stats = self._pool, self._pool.stats
        yield GaugeMetricFamily(
            "relay_workers_connected", "Workers connected to the proxy", value=len(pool.workers)
        )
        yield GaugeMetricFamily(
            "relay_worker_slots",
            "Request slots over all connected workers (after the per-worker cap)",
            value=sum(pool.capacity(h) for h in pool.workers.values()),
        )
        yield GaugeMetricFamily(
            "relay_requests_in_flight", "Generation requests running on workers", value=pool.running
        )
        yield GaugeMetricFamily(
            "relay_requests_queued",
            "Generation requests waiting for a worker slot",
            value=pool.queued,
        )
        yield GaugeMetricFamily(
            "relay_sessions_open", "Sessions the proxy holds", value=self._sessions_open()
        )
        yield CounterMetricFamily(
            "relay_dispatches", "Generation requests sent to a worker", value=stats.dispatched
        )
        retries = CounterMetricFamily(
            "relay_retries",
            "Requests re-dispatched after their worker was lost, by how they went on",
            labels=["mode"],
        )
        retries.add_metric(["restart"], stats.restarted)
        retries.add_metric(["resume"], stats.resumed)
        yield retries
        yield CounterMetricFamily(
            "relay_worker_connects", "Worker connections accepted", value=stats.worker_joins
        )
        yield CounterMetricFamily(
            "relay_worker_disconnects",
            "Workers removed (closed, lost or evicted for missing heartbeats)",
            value=stats.worker_disconnects,
        )
        yield CounterMetricFamily(
            "relay_worker_evictions",
            "Workers evicted because they stopped answering heartbeats",
            value=stats.worker_evictions,
        )
        rejected = CounterMetricFamily(
            "relay_requests_rejected",
            "Generation requests refused for lack of capacity",
            labels=["reason"],
        )
        rejected.add_metric(["queue_full"], stats.rejected_queue_full)
        rejected.add_metric(["wait_timeout"], stats.rejected_wait_timeout)
        yield rejected
        yield GaugeMetricFamily(
            "relay_policy_version", "The policy version the workers serve", value=pool.version
        )
        updates = CounterMetricFamily(
            "relay_weight_updates", "Weight updates (POST /weights), by outcome", labels=["outcome"]
        )
        updates.add_metric(["committed"], stats.updates_committed)
        updates.add_metric(["rolled_back"], stats.updates_rolled_back)
        updates.add_metric(["commit_failed"], stats.updates_commit_failed)
        yield updates
        yield CounterMetricFamily(
            "relay_requests_preempted",
            "Generations an abort-mode weight update stopped and continued on the new weights",
            value=stats.preempted,
        )
        yield CounterMetricFamily(
            "relay_workers_out_of_service",
            "Workers removed because they could not serve the current weights",
            value=stats.out_of_service,
        )


class _CoalescerCollector(Collector):
    """The event loop's lag and the adaptive stream coalescing it drives, read at scrape
    time."""

    def __init__(self, coalescer: StreamCoalescer) -> None:
        self._coalescer = coalescer

    def collect(self) -> Iterator[Metric]:
        coalescer, stats = self._coalescer, self._coalescer.stats
        yield GaugeMetricFamily(
            "relay_event_loop_lag_seconds",
            "How long the last probe queued after a worker frame waited for the event loop",
            value=coalescer.gauge.last_lag,
        )
        yield GaugeMetricFamily(
            "relay_event_loop_busy_share",
            "The share of the last window the event loop's thread ran (CPU time ÷ wall time)",
            value=coalescer.gauge.share,
        )
        yield CounterMetricFamily(
            "relay_event_loop_late_probes",
            "Probes that found the event loop behind (streams then coalesce their tokens)",
            value=stats.late_probes,
        )
        yield CounterMetricFamily(
            "relay_stream_holds",
            "Times a stream held its tokens for a sweep instead of writing them at once",
            value=stats.holds,
        )
        yield CounterMetricFamily(
            "relay_stream_sweeps",
            "Sweeps that wrote the tokens streams had held for the longest wait",
            value=stats.sweeps,
        )
        yield CounterMetricFamily(
            "relay_stream_swept",
            "Streams whose held tokens a sweep wrote (the others wrote a full group first)",
            value=stats.swept,
        )


class ProxyMetrics:
    """Every metric the proxy exports."""

    def __init__(
        self,
        pool: WorkerPool,
        sessions_open: Callable[[], int],
        coalescer: StreamCoalescer | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "relay_http_requests",
            "HTTP requests by API, route, method and status",
            ["api", "route", "method", "status"],
            registry=r,
        )
        self.http_seconds = Histogram(
            "relay_http_request_duration_seconds",
            "Time to answer an HTTP request (whole stream for streaming replies)",
            ["api"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "relay_errors",
            "Error replies (status >= 400) by API and error code",
            ["api", "code"],
            registry=r,
        )
        self.turns = Counter(
            "relay_turns",
            "Turns recorded, by API and finish reason",
            ["api", "finish_reason"],
            registry=r,
        )
        self.truncated_turns = Counter(
            "relay_turns_truncated",
            "Turns recorded truncated (the agent left or the proxy stopped mid-turn)",
            ["api"],
            registry=r,
        )
        self.replayed_turns = Counter(
            "relay_turns_replayed",
            "Retried requests answered with the recorded reply (nothing sampled)",
            ["api"],
            registry=r,
        )
        self.undelivered_turns = Counter(
            "relay_turns_undelivered",
            "Turns whose reply did not reach the client (cut, or its end not written);"
            " none of them is trained by default",
            ["api"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "relay_prompt_tokens", "Prompt tokens sent to workers", ["api"], registry=r
        )
        self.completion_tokens = Counter(
            "relay_completion_tokens", "Tokens sampled by workers", ["api"], registry=r
        )
        self.queue_seconds = Histogram(
            "relay_turn_queue_seconds",
            "Time a turn waited for a worker slot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "relay_turn_engine_seconds",
            "Time from dispatch to the worker until the turn finished",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token_seconds = Histogram(
            "relay_turn_time_to_first_token_seconds",
            "Time from the turn's request reaching the proxy to its first sampled token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.turn_seconds = Histogram(
            "relay_turn_duration_seconds",
            "Time from the turn's request reaching the proxy to the turn being recorded",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead_seconds = Histogram(
            "relay_turn_proxy_overhead_seconds",
            "Proxy time of a turn outside queue and engine (validation, rendering, recording)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_PoolCollector(pool, sessions_open))
        if coalescer is not None:
            r.register(_CoalescerCollector(coalescer))

    def observe_turn(
        self,
        *,
        api: str,
        finish_reason: str,
        truncated: bool,
        prompt_tokens: int,
        completion_tokens: int,
        queue_seconds: float,
        engine_seconds: float,
        total_seconds: float,
        first_token_seconds: float | None,
    ) -> None:
        self.turns.labels(api, finish_reason).inc()
        if truncated:
            self.truncated_turns.labels(api).inc()
        self.prompt_tokens.labels(api).inc(prompt_tokens)
        self.completion_tokens.labels(api).inc(completion_tokens)
        self.queue_seconds.observe(queue_seconds)
        self.engine_seconds.observe(engine_seconds)
        self.turn_seconds.observe(total_seconds)
        self.overhead_seconds.observe(max(0.0, total_seconds - queue_seconds - engine_seconds))
        if first_token_seconds is not None:
            self.first_token_seconds.observe(first_token_seconds)

    def observe_error(self, api: str, code: str | None) -> None:
        self.errors.labels(api, code or "error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


METRICS = web.AppKey("metrics", ProxyMetrics)


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(
        body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


def _request_id(request: web.Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _CLIENT_REQUEST_ID.match(given) else new_id("req")


@web.middleware
async def observe_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware: request id, log context, access line, request metrics."""
    rid = _request_id(request)
    request[REQUEST_ID] = rid
    route = route_of(request)
    api = api_of(route)
    rid_token = request_id_var.set(rid)
    trial_token = trial_id_var.set(request.match_info.get("trial_id"))
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:  # redirects and the like (errors are rendered inside)
        status = exc.status
        raise
    finally:
        elapsed = time.perf_counter() - started
        metrics = request.app[METRICS]
        metrics.http_requests.labels(api, route, request.method, str(status)).inc()
        if status >= 400:
            code = request.get(ERROR_CODE)
            metrics.observe_error(api, code if isinstance(code, str) else f"http_{status}")
        if api != "worker":  # a worker socket lives for hours; its duration is no latency
            metrics.http_seconds.labels(api).observe(elapsed)
        log.log(
            logging.DEBUG if api in _QUIET_APIS else logging.INFO,
            "%s %s %d %.1fms",
            request.method,
            request.path,
            status,
            elapsed * 1000,
            extra={
                "method": request.method,
                "path": request.path,
                "route": route,
                "api": api,
                "status": status,
                "duration_ms": round(elapsed * 1000, 3),
            },
        )
        request_id_var.reset(rid_token)
        trial_id_var.reset(trial_token)


async def _stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    # on_response_prepare runs before headers go out, also for streamed replies.
    rid = request.get(REQUEST_ID)
    if isinstance(rid, str):
        response.headers[REQUEST_ID_HEADER] = rid


def setup_observability(app: web.Application, metrics: ProxyMetrics) -> None:
    app[METRICS] = metrics
    app.router.add_get("/metrics", metrics_handler)
    app.on_response_prepare.append(_stamp_request_id)
