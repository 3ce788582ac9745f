"""The asyncio protocol for one client connection: picks HTTP/2 or HTTP/1.1, then delegates.

With TLS, ALPN decides (``h2`` or ``http/1.1``). In clear text, the first bytes decide: the
HTTP/2 connection preface means prior-knowledge h2c, anything else is HTTP/1.1. Until they do,
the limits' ``header_timeout_s`` runs from the connection's start, as nginx's
``client_header_timeout`` and Go's ``ReadHeaderTimeout`` do: a client that connects and sends
nothing, or half a preface, is closed.

:class:`Connections` caps how many are open (``limits.connection_cap()``, below the fd limit so
the replica keeps descriptors for its own files).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final, cast

from serving.auth import certificate_tenant
from zerolayer.server.h1proto import H1Handler
from zerolayer.server.h2proto import H2Handler

if TYPE_CHECKING:
    from zerolayer.server.core import ReplicaCore

log = logging.getLogger("zerolayer.server.connection")

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The transport's write buffer pauses the protocol at limits.write_high_water() and resumes it
# at a quarter of that, asyncio's own ratio (64/16 KiB).
WRITE_LOW_RATIO: Final = 4
# At most one WARNING for refused connections in this many seconds: a flood of refusals is one
# line (with the count), not one line each; /metrics counts every one.
REFUSAL_LOG_INTERVAL_S: Final = 10.0


class Connections:
    """The replica's open connections, capped: one past ``limits.connection_cap()`` is closed at
    once and counted in ``replica.refused_connections``."""

    __slots__ = ("_unlogged", "_warn_after", "cap", "open", "replica")

    def __init__(self, replica: ReplicaCore) -> None:
        self.replica = replica
        self.cap = replica.limits.connection_cap()
        self.open: set[ReplicaProtocol] = set()
        self._unlogged = 0
        self._warn_after = 0.0

    def admit(self, protocol: ReplicaProtocol, transport: asyncio.BaseTransport) -> bool:
        """Take the connection if there is room; else close it (without a response: in clear
        text the replica cannot tell HTTP/1.1 from h2c without reading, and a close is what
        any client retries elsewhere) and log it."""
        if len(self.open) >= self.cap:
            transport.close()
            self._refused(transport)
            return False
        self.open.add(protocol)
        self.replica.connections += 1
        return True

    def release(self, protocol: ReplicaProtocol) -> None:
        if protocol in self.open:
            self.open.discard(protocol)
            self.replica.connections -= 1

    def _refused(self, transport: asyncio.BaseTransport) -> None:
        self.replica.refused_connections += 1
        self._unlogged += 1
        now = self.replica.loop.time()
        if now < self._warn_after:
            return
        log.warning(
            "refused %d connection(s) past the cap of %d open (limits.max_connections), the "
            "latest from %s", self._unlogged, self.cap, transport.get_extra_info("peername"),
        )  # fmt: skip
        self._unlogged = 0
        self._warn_after = now + REFUSAL_LOG_INTERVAL_S


class ReplicaProtocol(asyncio.Protocol):
    __slots__ = ("_buffer", "_opened_at", "_preface_timer", "connections", "handler",
                 "identity", "replica", "transport")  # fmt: skip

    def __init__(self, replica: ReplicaCore, connections: Connections) -> None:
        self.replica = replica
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self.handler: H2Handler | H1Handler | None = None
        self.identity: str | None = None
        self._buffer = b""
        self._opened_at = 0.0
        self._preface_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.connections.admit(self, transport):
            return
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        high = self.replica.limits.write_high_water()
        self.transport.set_write_buffer_limits(high=high, low=high // WRITE_LOW_RATIO)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            # Verified against the client CA when there is one; None when none was asked for.
            certificate = ssl_object.getpeercert()
            self.identity = certificate_tenant(certificate) if certificate else None
            alpn = ssl_object.selected_alpn_protocol()
            if alpn == "h2":
                self.handler = H2Handler(self.replica, self.transport, self.identity)
                return
            if alpn == "http/1.1":
                self.handler = H1Handler(self.replica, self.transport, self.identity)
                return
        loop = self.replica.loop
        self._opened_at = loop.time()
        if self.replica.limits.header_timeout_s > 0:  # 0: no timeout, as in h1proto
            self._preface_timer = loop.call_at(
                self._opened_at + self.replica.limits.header_timeout_s, self._preface_timed_out
            )

    def data_received(self, data: bytes) -> None:
        handler = self.handler
        if handler is not None:
            handler.data_received(data)
            return
        buffer = self._buffer + data if self._buffer else data
        prefix = buffer[: len(PREFACE)]
        if PREFACE.startswith(prefix) and len(buffer) < len(PREFACE):
            self._buffer = buffer
            return
        self._buffer = b""
        self._stop_preface_timer()
        assert self.transport is not None
        if prefix == PREFACE:
            self.handler = H2Handler(self.replica, self.transport, self.identity)
        else:
            self.handler = H1Handler(
                self.replica, self.transport, self.identity, header_started=self._opened_at
            )
        self.handler.data_received(buffer)

    def _preface_timed_out(self) -> None:
        self._preface_timer = None
        if self.handler is None and self.transport is not None:
            log.info(
                "connection from %s: header_timeout_s of %g s passed before it chose HTTP/1.1 "
                "or HTTP/2; closing",
                self.transport.get_extra_info("peername"), self.replica.limits.header_timeout_s,
            )  # fmt: skip
            self.transport.close()

    def _stop_preface_timer(self) -> None:
        if self._preface_timer is not None:
            self._preface_timer.cancel()
            self._preface_timer = None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_preface_timer()
        self.connections.release(self)
        if self.handler is not None:
            self.handler.connection_lost()

    def goaway(self) -> None:
        if self.handler is not None:
            self.handler.goaway()
        elif self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        if self.handler is not None:
            self.handler.close()
        elif self.transport is not None:
            self.transport.close()

    @property
    def idle(self) -> bool:
        return self.handler is None or self.handler.idle
