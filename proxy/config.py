"""Proxy settings (one frozen object, built by the CLI or by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True, frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # The URL agents reach the proxy at, for the base_url handed out per trial; derived
    # from the request's Host header when not set.
    public_url: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    worker_wait_seconds: float = 30.0
    max_tokens: int = 4096
    worker_token: str | None = None
    tool_parser: str | None = None
    heartbeat_seconds: float = 10.0
    retry_after_seconds: int = 5
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "rollout-relay")
