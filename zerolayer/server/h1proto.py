"""The HTTP/1.1 side of a connection, on the sans-IO ``h11`` library.

One request at a time per connection (pipelined requests wait in h11's buffer); streamed
responses use chunked transfer encoding. A request refused before its body was read is
answered with ``connection: close`` and the connection is closed after the response, which is
HTTP/1.1's only way to stop an upload.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import TYPE_CHECKING

import h11

if TYPE_CHECKING:
    from zerolayer.server.core import Call, Replica

log = logging.getLogger("zerolayer.server.h1")

MAX_HEADER_BYTES = 64 << 10
_CLOSE = (b"connection", b"close")
REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


class H1Exchange:
    """One request/response on an HTTP/1.1 connection: the sink a Call writes to."""

    __slots__ = ("call", "conn", "local_ended", "remote_ended")

    def __init__(self, conn: H1Handler, remote_ended: bool) -> None:
        self.conn = conn
        self.call: Call | None = None
        self.remote_ended = remote_ended
        self.local_ended = False

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if self.local_ended:
            return
        headers = list(headers)
        if not any(name == b"content-length" for name, _ in headers):
            headers.append((b"content-length", str(len(body)).encode()))
        if not self.remote_ended:
            headers.append(_CLOSE)
        conn = self.conn
        out = conn.h11.send(
            h11.Response(status_code=status, headers=headers, reason=REASONS.get(status, b""))
        )
        if body:
            out += conn.h11.send(h11.Data(data=body))
        out += conn.h11.send(h11.EndOfMessage())
        self.local_ended = True
        conn.write(out)
        conn.response_done()

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        conn = self.conn
        response = h11.Response(
            status_code=status, headers=headers, reason=REASONS.get(status, b"")
        )
        conn.write(conn.h11.send(response))

    def write(self, data: bytes) -> None:
        if not self.local_ended:
            self.conn.write(self.conn.h11.send(h11.Data(data=data)))

    def end(self, data: bytes) -> None:
        if self.local_ended:
            return
        conn = self.conn
        out = conn.h11.send(h11.Data(data=data)) if data else b""
        out += conn.h11.send(h11.EndOfMessage())
        self.local_ended = True
        conn.write(out)
        conn.response_done()

    def cancel(self) -> None:
        """HTTP/1.1 cannot end one response early but by closing the connection."""
        self.local_ended = True
        self.conn.close()

    def writable(self) -> asyncio.Future[None] | None:
        """Backpressure (see ``core.Sink``)."""
        return None

    def open_window(self, size: int) -> None:
        """Admitted: a client waiting for ``100 Continue`` may upload now (no other flow
        control in HTTP/1.1 than TCP's)."""
        conn = self.conn
        if conn.h11.they_are_waiting_for_100_continue:
            conn.write(conn.h11.send(h11.InformationalResponse(status_code=100, headers=[])))


class H1Handler:
    """One HTTP/1.1 connection."""

    def __init__(
        self, replica: Replica, transport: asyncio.Transport, identity: str | None = None
    ) -> None:
        self.replica = replica
        self.transport = transport
        self.identity = identity
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self.exchange: H1Exchange | None = None
        self._closed = False
        self._goaway = False

    def data_received(self, data: bytes) -> None:
        self.h11.receive_data(data)
        self._process()

    def _process(self) -> None:
        conn = self.h11
        while not self._closed:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._bad_request(exc)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if type(event) is h11.Request:
                self._on_request(event)
            elif type(event) is h11.Data:
                exchange = self.exchange
                if exchange is not None and exchange.call is not None:
                    exchange.call.on_data(event.data)
            elif type(event) is h11.EndOfMessage:
                exchange = self.exchange
                if exchange is not None:
                    was_ended = exchange.remote_ended
                    exchange.remote_ended = True
                    if exchange.call is not None and not was_ended:
                        exchange.call.on_end()
                self._next_cycle()
            elif type(event) is h11.ConnectionClosed:
                self.close()
                return

    def _on_request(self, event: h11.Request) -> None:
        body_follows = False
        headers: list[tuple[bytes, bytes]] = [(b":method", event.method), (b":path", event.target)]
        for name, value in event.headers:
            if name == b"content-length":
                body_follows = value != b"0"
            elif name == b"transfer-encoding":
                body_follows = True
            headers.append((name, value))
        exchange = H1Exchange(self, not body_follows)
        self.exchange = exchange
        exchange.call = self.replica.on_request(exchange, headers, body_follows, self.identity)

    def _bad_request(self, exc: Exception) -> None:
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = b'{"error":{"code":"bad_request","message":"malformed HTTP/1.1 request"}}'
            try:
                out = self.h11.send(
                    h11.Response(
                        status_code=400,
                        headers=[(b"content-type", b"application/json"),
                                 (b"zl-error", b"bad_request"),
                                 (b"content-length", str(len(body)).encode()), _CLOSE],
                    )
                )  # fmt: skip
                out += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
                self.write(out)
            except h11.LocalProtocolError:
                pass
        log.debug("bad HTTP/1.1 request: %s", exc)
        self.close()

    def response_done(self) -> None:
        if self.h11.our_state is h11.MUST_CLOSE:
            self.close()
            return
        self._next_cycle()

    def _next_cycle(self) -> None:
        conn = self.h11
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            if self._goaway:
                self.close()
                return
            conn.start_next_cycle()
            self.exchange = None
            self.replica.loop.call_soon(self._process)
        elif conn.our_state is h11.MUST_CLOSE:
            self.close()

    def write(self, data: bytes) -> None:
        if data and not self._closed:
            self.transport.write(data)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport.close()

    def goaway(self) -> None:
        """Between requests, close; with one in flight, close once it is answered."""
        self._goaway = True
        if self.exchange is None:
            self.close()

    def connection_lost(self) -> None:
        self._closed = True
        exchange = self.exchange
        self.exchange = None
        if exchange is not None and exchange.call is not None:
            exchange.call.on_reset()

    @property
    def idle(self) -> bool:
        return self.exchange is None
