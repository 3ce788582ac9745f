"""A self-signed certificate made for one run, so HTTP/2 can go over TLS with ALPN.

k6 (Go's net/http) only speaks HTTP/2 over TLS, so a k6 run against the zero-layer stack starts
its replicas with this certificate; the loaders skip verification (``insecureSkipTLSVerify``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(directory: str | Path, days: int = 2) -> tuple[Path, Path]:
    """Write ``cert.pem`` and ``key.pem`` for localhost/127.0.0.1/::1; return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zerolayer-bench")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def client_context(cert_path: str | Path, alpn: tuple[str, ...] = ("h2",)) -> ssl.SSLContext:
    """A client context that trusts exactly the run's certificate and offers ``alpn``."""
    ctx = ssl.create_default_context(cafile=str(cert_path))
    ctx.set_alpn_protocols(list(alpn))
    return ctx
