"""TLS on the proxy's own listener, for deployments that do not terminate TLS in front
(an ingress or a service mesh). Workers then dial ``wss://`` and agents use ``https://``."""

from __future__ import annotations

import ssl
from pathlib import Path

from proxy.exceptions import ConfigurationError


def server_ssl_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """A server context from a PEM certificate chain and its private key; None when
    neither is given."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ConfigurationError("TLS needs both --tls-cert and --tls-key")
    # Purpose.CLIENT_AUTH is the server side: it sets secure protocol and cipher defaults
    # (TLS 1.2 or newer) without asking clients for certificates.
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile=cert, keyfile=key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(
            f"cannot load the TLS certificate {cert} and key {key}: {exc}"
        ) from None
    return context
