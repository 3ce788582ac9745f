"""Starting and stopping a replica server in-process: :func:`start_replica`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl

from serving.auth import Authenticator
from serving.engine.kvwatch import KvWatch
from serving.engine.types import Engine
from zerolayer.accounting import FLUSH_INTERVAL_S, FLUSH_ROWS, Accounting, FsyncPolicy
from zerolayer.scheduler import SchedulerConfig
from zerolayer.server.connection import Connections, ReplicaProtocol
from zerolayer.server.core import DEFAULT_MAX_BODY_BYTES, ReplicaCore
from zerolayer.server.limits import DEFAULT_LIMITS, Limits

DRAIN_TIMEOUT_S = 30.0


def tls_context(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    client_ca: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """A server TLS context offering ALPN ``h2`` then ``http/1.1``.

    With ``client_ca`` (mutual TLS), a client must present a certificate signed by that CA, and
    by no other: the system's CAs are not loaded, as anyone can buy a certificate they sign.
    """
    cafile = os.fspath(client_ca) if client_ca is not None else None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cafile)
    if cafile is not None:
        context.verify_mode = ssl.CERT_REQUIRED
    context.load_cert_chain(os.fspath(cert), os.fspath(key))
    context.set_alpn_protocols(["h2", "http/1.1"])
    context.options |= ssl.OP_NO_COMPRESSION
    return context


class ReplicaHandle:
    """A running replica: ``port``, ``url``, ``engine``, ``replica``; ``drain()``, ``close()``.

    The engine belongs to the caller: ``close`` stops the server, not the engine.
    """

    def __init__(
        self,
        replica: ReplicaCore,
        server: asyncio.Server,
        connections: Connections,
        host: str,
        tls: bool,
        kv_watch: KvWatch | None = None,
    ) -> None:
        self.replica = replica
        self.kv_watch = kv_watch
        self.engine = replica.engine
        self.server = server
        self._protocols = connections.open
        self.host = host
        self.port: int = server.sockets[0].getsockname()[1]
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://{host}:{self.port}"
        self.closed = False

    @property
    def name(self) -> str:
        return self.replica.name

    async def drain(self, timeout: float | None = DRAIN_TIMEOUT_S) -> bool:
        """Refuse new streams with ``draining`` and wait for in-flight ones to finish (False if
        ``timeout`` passed first). The server keeps answering ``/health`` and ``/metrics``."""
        return await self.replica.drain(timeout)

    async def close(self, timeout: float | None = DRAIN_TIMEOUT_S) -> None:
        """Graceful stop: drain, send GOAWAY, close connections and the listener, flush the
        accounting. Idempotent."""
        if self.closed:
            return
        self.closed = True
        await self.replica.drain(timeout)
        self.server.close()
        for protocol in list(self._protocols):
            protocol.goaway()
        await asyncio.sleep(0)
        for protocol in list(self._protocols):
            protocol.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 1.0)
        if self.kv_watch is not None:
            await self.kv_watch.stop()
        self.replica.accounting.close()

    async def __aenter__(self) -> ReplicaHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_replica(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    tls_client_ca: str | os.PathLike[str] | None = None,
    name: str | None = None,
    accounting_path: str | os.PathLike[str] | None = None,
    scheduler_config: SchedulerConfig | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: Limits = DEFAULT_LIMITS,
    auth: Authenticator | None = None,
    accounting_flush_s: float = FLUSH_INTERVAL_S,
    accounting_flush_rows: int = FLUSH_ROWS,
    accounting_fsync: FsyncPolicy = FsyncPolicy.BATCH,
    backlog: int = 1024,
    kv_watch_path: str | os.PathLike[str] | None = None,
) -> ReplicaHandle:
    """Serve ``engine`` on ``host:port`` (0: a free port) with HTTP/2 and HTTP/1.1.

    TLS with ALPN when ``tls_cert`` and ``tls_key`` are given; with ``tls_client_ca`` too, mutual
    TLS: each client shows a certificate that CA signed, and the tenant it names
    (``auth.certificate_tenant``) goes to the authenticator. With ``kv_watch_path``, the
    engine's KV is stamped there under pressure (``serving.engine.kvwatch``). Call on the loop
    that will run it.
    """
    context = server_tls(tls_cert, tls_key, tls_client_ca)
    name = name or f"replica-{os.getpid()}"
    accounting = Accounting(
        accounting_path,
        flush_interval_s=accounting_flush_s,
        flush_rows=accounting_flush_rows,
        fsync=accounting_fsync,
        max_tenants=limits.max_tenants,
        replica=name,
    )
    replica = ReplicaCore(
        engine,
        name=name,
        config=scheduler_config,
        max_body_bytes=max_body_bytes,
        accounting=accounting,
        limits=limits,
        auth=auth,
    )
    connections = Connections(replica)
    server = await _listen(replica, connections, host, port, context, backlog)
    accounting.start(replica.loop)
    watch = None
    if kv_watch_path is not None:
        watch = KvWatch(
            engine.stats,
            kv_watch_path,
            pending=lambda: replica.promised_blocks + sum(replica.queue.state.blocks),
            admitted=lambda: replica.admitted,
        )
        watch.start()
    return ReplicaHandle(replica, server, connections, host, context is not None, watch)


def server_tls(
    cert: str | os.PathLike[str] | None,
    key: str | os.PathLike[str] | None,
    client_ca: str | os.PathLike[str] | None,
) -> ssl.SSLContext | None:
    """The TLS context ``start_replica``'s arguments ask for (None: clear text); ValueError for
    a half-given pair."""
    if (cert is None) != (key is None):
        raise ValueError("give both tls_cert and tls_key, or neither")
    if client_ca is not None and cert is None:
        raise ValueError("tls_client_ca needs tls_cert and tls_key")
    return tls_context(cert, key, client_ca) if cert and key else None


async def _listen(
    replica: ReplicaCore,
    connections: Connections,
    host: str,
    port: int,
    context: ssl.SSLContext | None,
    backlog: int,
) -> asyncio.Server:
    handshake_timeout = replica.limits.handshake_timeout_s if context is not None else 0.0
    return await replica.loop.create_server(
        lambda: ReplicaProtocol(replica, connections),
        host,
        port,
        ssl=context,
        # asyncio takes no 0 (its default, 60 s, then applies).
        ssl_handshake_timeout=handshake_timeout or None,
        backlog=backlog,
        reuse_address=True,
    )
