"""How the app is put together from its config."""

from __future__ import annotations

from proxy.app import build_app
from proxy.appkeys import POOL, SERVICE
from proxy.coalesce import CoalesceMode
from proxy.config import ProxyConfig


def test_streams_coalesce_by_default_unless_off_or_grouped() -> None:
    """Adaptive coalescing is on by default (the pool's frames feed its gauge); off, or
    with an explicit --stream-interval, streams never hold tokens."""
    adaptive = build_app(ProxyConfig())
    coalescer = adaptive[SERVICE].coalescer
    assert coalescer is not None
    assert adaptive[POOL].after_frame == coalescer.frame_handled
    for config in (
        ProxyConfig(stream_coalesce=CoalesceMode.OFF),
        ProxyConfig(stream_interval=8),
    ):
        app = build_app(config)
        assert app[SERVICE].coalescer is None
        assert app[POOL].after_frame is None
