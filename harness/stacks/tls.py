"""TLS for a stack: the self-signed certificate its zero-layer replicas serve, and the client
context that trusts exactly that certificate."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from pathlib import Path

from harness.certs import self_signed

TLS_DIR = "tls"


def serving_certificate(workdir: Path, ips: Sequence[str] = ()) -> tuple[Path, Path]:
    """(certificate, key) for a stack's servers, made under ``workdir`` (good for loopback and
    ``ips``: a cluster's node addresses); the certificate is also the one CA its clients
    trust."""
    return self_signed(workdir / TLS_DIR, ips=ips)


def client_tls(ca: Path | None, alpn: Sequence[str] = ("h2",)) -> ssl.SSLContext | None:
    """A client context that trusts exactly the stack's certificate (None without TLS)."""
    if ca is None:
        return None
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(list(alpn))
    return ctx
