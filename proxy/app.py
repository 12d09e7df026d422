"""Building the proxy's aiohttp application."""

from __future__ import annotations

from aiohttp import web

from proxy.api import sessions, ui, weights
from proxy.api.anthropic import routes as anthropic_routes
from proxy.api.auth import auth_middleware
from proxy.api.errors import error_middleware, json_response
from proxy.api.images import ImageSources
from proxy.api.openai import routes as openai_routes
from proxy.api.responses import routes as responses_routes
from proxy.appkeys import CONFIG, IMAGES, MODELS, POOL, SERVICE, SESSIONS, TEACHER, WEIGHTS
from proxy.chat import history
from proxy.cluster import forward_middleware, setup_cluster
from proxy.coalesce import CoalesceMode, StreamCoalescer
from proxy.config import ProxyConfig
from proxy.durability import setup_durability
from proxy.exceptions import ConfigurationError
from proxy.images import ImageChecker, ImageFetcher, ImageLimits
from proxy.lifecycle import LIFECYCLE, Lifecycle, drain_gate
from proxy.limits import Limits
from proxy.models import ModelRegistry
from proxy.observability import ProxyMetrics, observe_middleware, setup_observability
from proxy.sessions.registry import SessionRegistry
from proxy.teacher import TeacherService
from proxy.turns import TurnService
from relay.endpoint import WorkerSocketConfig, make_worker_socket_handler
from relay.pool import PoolLimits, WorkerPool
from relay.weights import WeightSync

__all__ = ["build_app"]


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    workers = len(pool.workers)
    accepting = request.app[LIFECYCLE].accepting
    ready = workers > 0 and accepting
    status = "ready" if ready else ("no_workers" if accepting else "draining")
    return json_response({"status": status, "workers": workers}, status=200 if ready else 503)


def build_app(config: ProxyConfig) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[
            observe_middleware,
            error_middleware,
            forward_middleware,
            auth_middleware,
            drain_gate,
        ],
    )
    pool = WorkerPool(
        wait_seconds=config.worker_wait_seconds,
        limits=PoolLimits(
            max_in_flight=config.max_in_flight,
            max_in_flight_per_worker=config.max_in_flight_per_worker,
            max_queued=config.max_queued,
            max_queued_per_trial=config.max_queued_per_trial,
        ),
    )
    models = ModelRegistry(config.cache_dir, tool_parser=config.tool_parser)
    app[CONFIG] = config
    app[POOL] = pool
    app[WEIGHTS] = WeightSync(pool, phase_seconds=config.weights_phase_seconds)
    app[MODELS] = models
    app[SESSIONS] = SessionRegistry()
    app[TEACHER] = TeacherService(
        pool, models, app[SESSIONS], retry_after_seconds=config.retry_after_seconds
    )
    coalescer = None
    if config.stream_coalesce is CoalesceMode.ADAPTIVE and config.stream_interval == 1:
        # An explicit --stream-interval groups every stream alike; nothing to adapt.
        coalescer = StreamCoalescer()
        pool.after_frame = coalescer.frame_handled
    app[SERVICE] = TurnService(
        pool,
        models,
        global_max_tokens=config.max_tokens,
        retry_after_seconds=config.retry_after_seconds,
        stream_interval=config.stream_interval,
        coalescer=coalescer,
    )
    app[SERVICE].limits = Limits(
        max_messages=config.max_messages,
        max_session_tokens=config.max_session_tokens,
        max_sessions=config.max_sessions,
    )
    history.BUDGET.limit = config.history_memory_mb * 2**20
    checker = ImageChecker(
        ImageLimits(
            max_bytes=config.max_image_bytes,
            max_pixels=config.max_image_pixels,
            max_images=config.max_images,
        )
    )
    try:
        fetcher = ImageFetcher(
            config.image_url_allow,
            checker,
            timeout_seconds=config.image_fetch_seconds,
            private_addresses=config.image_url_private_addresses,
        )
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    app[IMAGES] = ImageSources(checker, fetcher)
    app[LIFECYCLE] = Lifecycle(retry_after_seconds=config.retry_after_seconds)
    metrics = ProxyMetrics(pool, lambda: len(app[SESSIONS]), coalescer)
    app[SERVICE].recorder.metrics = metrics
    setup_observability(app, metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get(
        "/ws/worker",
        make_worker_socket_handler(
            pool,
            WorkerSocketConfig(
                token=config.worker_token, heartbeat_seconds=config.heartbeat_seconds
            ),
            models.admit,
        ),
    )
    setup_durability(app)
    setup_cluster(app)
    sessions.add_routes(app)
    weights.add_routes(app)
    openai_routes.add_routes(app)
    anthropic_routes.add_routes(app)
    responses_routes.add_routes(app)
    ui.add_routes(app)
    app.on_shutdown.append(_disconnect_workers)
    return app


async def _disconnect_workers(app: web.Application) -> None:
    # Without this, shutting down waits for each worker socket's heartbeat to time out.
    await app[POOL].disconnect_all("proxy shutting down")
    # A running weight update ends too: the workers roll it back as their connections end,
    # and its task is not left pending behind the proxy.
    await app[WEIGHTS].close()
    # Scoring with a teacher stops too; what it committed stays.
    await app[TEACHER].close()
