"""The asyncio protocol for one client connection: picks HTTP/2 or HTTP/1.1, then delegates.

With TLS, ALPN decides (``h2`` or ``http/1.1``). In clear text, the first bytes decide: the
HTTP/2 connection preface means prior-knowledge h2c, anything else is HTTP/1.1.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final, cast

from zerolayer.server.h1proto import H1Handler
from zerolayer.server.h2proto import H2Handler

if TYPE_CHECKING:
    from zerolayer.server.core import Replica

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class ReplicaProtocol(asyncio.Protocol):
    __slots__ = ("_buffer", "handler", "registry", "replica", "transport")

    def __init__(self, replica: Replica, registry: set[ReplicaProtocol]) -> None:
        self.replica = replica
        self.registry = registry
        self.transport: asyncio.Transport | None = None
        self.handler: H2Handler | H1Handler | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.registry.add(self)
        self.replica.connections += 1
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            alpn = ssl_object.selected_alpn_protocol()
            if alpn == "h2":
                self.handler = H2Handler(self.replica, self.transport)
            elif alpn == "http/1.1":
                self.handler = H1Handler(self.replica, self.transport)

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
        assert self.transport is not None
        if prefix == PREFACE:
            self.handler = H2Handler(self.replica, self.transport)
        else:
            self.handler = H1Handler(self.replica, self.transport)
        self.handler.data_received(buffer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.registry.discard(self)
        self.replica.connections -= 1
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
