"""The proxy's server TLS context."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trustme

from proxy.exceptions import ConfigurationError
from proxy.tls import server_ssl_context


def test_no_files_means_plain_http() -> None:
    """Neither file given: no TLS."""
    assert server_ssl_context(None, None) is None


def test_loads_a_certificate_and_key(tmp_path: Path) -> None:
    """A PEM chain and key give a server context that requires TLS 1.2 or newer."""
    issued = trustme.CA().issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    context = server_ssl_context(cert, key)
    assert context is not None
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


@pytest.mark.parametrize("given", ["cert", "key"])
def test_one_file_alone_is_refused(tmp_path: Path, given: str) -> None:
    """Half a TLS configuration is an error, not silently plain HTTP."""
    path = tmp_path / "x.pem"
    with pytest.raises(ConfigurationError, match="both"):
        server_ssl_context(path if given == "cert" else None, path if given == "key" else None)


def test_unreadable_files_are_a_clear_error(tmp_path: Path) -> None:
    """A missing or invalid file names the files instead of a raw ssl error."""
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate")
    with pytest.raises(ConfigurationError, match="cannot load"):
        server_ssl_context(bogus, tmp_path / "missing.pem")
