"""Proxy settings (one frozen object, built by the CLI or by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from proxy.coalesce import CoalesceMode
from proxy.images import ImageLimits

_IMAGES = ImageLimits()  # the defaults


@dataclass(slots=True, frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # The URL agents reach the proxy at, for the base_url handed out per trial; derived
    # from the request's Host header when not set.
    public_url: str | None = None
    # Every replica's public URL, this one's included (normalized by relay.cluster); each
    # trial is owned by one of them. Empty: a single proxy.
    peers: tuple[str, ...] = ()
    # Agents resend their whole history each turn, images included, as base64: a 20-turn
    # session with a screenshot each turn is over 16 MiB (a 1-2 MB PNG is a third more as
    # base64), so the limit is 64 MiB; each image is still held to --max-image-bytes.
    max_body_bytes: int = 64 * 1024 * 1024
    worker_wait_seconds: float = 30.0
    max_tokens: int = 4096
    # Credentials (None: open; the CLI refuses that without --no-auth). With an admin
    # token the session API needs it and agent routes need their trial's API key.
    admin_token: str | None = None
    worker_token: str | None = None
    # TLS on the proxy's own listener (both or neither); None: plain HTTP.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Limits (0: none): messages in one agent request, tokens one session stores,
    # sessions held (registered and not deleted).
    max_messages: int = 10_000
    max_session_tokens: int = 16 * 1024 * 1024
    max_sessions: int = 100_000
    # What the sessions' history memories hold together, at most (MiB): the histories
    # lately sent, which let a turn parse and hash only its new messages.
    history_memory_mb: int = 512
    tool_parser: str | None = None
    # Images (proxy.images): the hosts http(s) image URLs may be fetched from (none: only
    # base64 images are taken), and what one image and one request may hold (0: no limit).
    image_url_allow: tuple[str, ...] = ()
    # Whether an allowed host may be fetched at a loopback, private or link-local address
    # (no flag: for tests, whose image hosts listen on loopback, and for embedding).
    image_url_private_addresses: bool = False
    image_fetch_seconds: float = 10.0
    max_image_bytes: int = _IMAGES.max_bytes
    max_image_pixels: int = _IMAGES.max_pixels
    max_images: int = _IMAGES.max_images
    # Tokens per streamed event at least (the first event goes out at once and the last
    # takes what is left): 1 streams every engine step; more trades how often an agent
    # hears from a stream for less proxy CPU per token.
    stream_interval: int = 1
    # With stream_interval 1: while the event loop runs behind, a stream's tokens wait a
    # few milliseconds and go out together (proxy.coalesce); OFF writes every step.
    stream_coalesce: CoalesceMode = CoalesceMode.ADAPTIVE
    heartbeat_seconds: float = 10.0
    # How long one phase of a weight update (pause, load, commit or rollback) may take on
    # the workers; a whole update takes at most three phases.
    weights_phase_seconds: float = 600.0
    retry_after_seconds: int = 5
    # Backpressure (0: no bound of that kind): requests running per worker (caps what the
    # worker announced) and overall; requests waiting for a slot overall and per trial.
    max_in_flight_per_worker: int = 0
    max_in_flight: int = 0
    max_queued: int = 4096
    max_queued_per_trial: int = 256
    # On SIGTERM, how long running turns may take to finish before they are cancelled.
    drain_seconds: float = 30.0
    # Where sessions and turns are stored (SQLite, WAL); None: in memory only, lost on exit.
    data_dir: Path | None = None
    # Session lifetime (0: no limit): an active session is completed after this long without
    # a request, or at this age; a completed one is removed this long after it completed, or
    # after its trajectories were first fetched.
    session_idle_seconds: float = 3600.0
    session_max_age_seconds: float = 86400.0
    retention_seconds: float = 86400.0
    fetched_retention_seconds: float = 600.0
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "rollout-relay")
