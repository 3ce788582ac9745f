"""The HTTP/1.1 side of a connection, on the sans-IO ``h11`` library.

One request at a time per connection; streamed responses use chunked transfer encoding. A
request refused before its body was read is answered with ``connection: close`` and the
connection is closed after the response, which is HTTP/1.1's only way to stop an upload.

What a client can make a connection hold is bounded: reading pauses while a pipelined request
waits for the current response (h11's ``PAUSED``) and while the client leaves output unread
past the transport's high-water mark (``pause_writing``), so the replica holds at most one read
of input and the high-water mark plus one response of output.

The read timeouts, all from the replica's limits, run on one timer per connection that is
re-armed only when a deadline moves earlier than the one it is set for, so a request costs no
timer of its own: ``header_timeout_s`` to the end of a request's head (from the connection's
start, or from the first byte of a later request), ``body_timeout_s`` between two reads of a
body (then 408), ``idle_timeout_s`` between requests; and once closed, ``send_stall_s`` for the
client to read what is left before the connection is aborted.
"""

from __future__ import annotations

import asyncio
import http
import logging
from enum import Enum
from typing import TYPE_CHECKING, Final

import h11

from serving.wire import contract
from serving.wire.contract import BAD_REQUEST, HEADERS_TOO_LARGE, REQUEST_TIMEOUT, ErrorCode

if TYPE_CHECKING:
    from zerolayer.server.core import Call, ReplicaCore

log = logging.getLogger("zerolayer.server.h1")

_CLOSE: Final = (b"connection", b"close")
REASONS: Final = {s.value: s.phrase.encode() for s in http.HTTPStatus}
# h11's hint for a head that outgrew max_incomplete_event_size (RFC 6585 section 5).
_TOO_LARGE_HINT: Final = 431


class Waiting(Enum):
    """What a connection waits for from its client; each value names the limit that bounds it."""

    HEAD = "header_timeout_s"
    BODY = "body_timeout_s"
    IDLE = "idle_timeout_s"
    LINGER = "send_stall_s"  # closed: the client is to read what is left of its output


HEAD: Final = Waiting.HEAD
BODY: Final = Waiting.BODY
IDLE: Final = Waiting.IDLE
LINGER: Final = Waiting.LINGER


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
        """Backpressure (see ``core.Sink``): the connection's, as HTTP/1.1 has one response at
        a time."""
        return self.conn.writable()

    def open_window(self, size: int) -> None:
        """Admitted: a client waiting for ``100 Continue`` may upload now (no other flow
        control in HTTP/1.1 than TCP's)."""
        conn = self.conn
        if conn.h11.they_are_waiting_for_100_continue:
            conn.write(conn.h11.send(h11.InformationalResponse(status_code=100, headers=[])))


class H1Handler:
    """One HTTP/1.1 connection.

    ``header_started`` is when the clock of the first request's head started (the loop's time;
    default now): the connection's start, when a cleartext client first had to show whether it
    speaks HTTP/2.
    """

    def __init__(
        self,
        replica: ReplicaCore,
        transport: asyncio.Transport,
        identity: str | None = None,
        header_started: float | None = None,
    ) -> None:
        self.replica = replica
        self.transport = transport
        self.identity = identity
        self.loop = replica.loop
        self.limits = replica.limits
        self.h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.limits.max_header_list_size
        )
        self.exchange: H1Exchange | None = None
        self._closed = False
        self._goaway = False
        self._processing = False
        self._pipelined = False  # a next request waits in h11's buffer: reading paused
        self._write_paused = False  # the client leaves output unread: reading paused
        self._reading = True
        self._drained: asyncio.Future[None] | None = None
        self._waiting: Waiting | None = None
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._wait(HEAD, self.loop.time() if header_started is None else header_started)

    # -- input ------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        waiting = self._waiting
        if waiting is IDLE:
            self._wait(HEAD, self.loop.time())
        elif waiting is BODY:
            self._since = self.loop.time()
        self.h11.receive_data(data)
        self._process()

    def _process(self) -> None:
        """Hand h11's events to the replica until it needs data, or until reading must pause."""
        conn = self.h11
        self._processing = True
        try:
            while not (self._closed or self._write_paused):
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    self._refuse_malformed(exc)
                    return
                if event is h11.NEED_DATA:
                    return
                if event is h11.PAUSED:
                    self._pipelined = True
                    self._update_reading()
                    return
                if type(event) is h11.Request:
                    self._on_request(event)
                elif type(event) is h11.Data:
                    exchange = self.exchange
                    if exchange is not None and exchange.call is not None:
                        exchange.call.on_data(event.data)
                elif type(event) is h11.EndOfMessage:
                    self._wait(None)  # the response's pace is the replica's
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
        finally:
            self._processing = False

    def _on_request(self, event: h11.Request) -> None:
        body_follows = has_length = chunked = False
        size = len(event.method) + len(event.target)
        headers: list[tuple[bytes, bytes]] = [(b":method", event.method), (b":path", event.target)]
        for name, value in event.headers:
            size += len(name) + len(value)
            if name == b"content-length":
                body_follows = value != b"0"
                has_length = True
            elif name == b"transfer-encoding":
                body_follows = chunked = True
            headers.append((name, value))
        limit = self.limits.max_header_list_size
        if size > limit:  # h11 bounds only a head that is still incomplete
            self._refuse(HEADERS_TOO_LARGE, f"the request head exceeds {limit} bytes")
            return
        if has_length and chunked:
            # RFC 9112 section 6.1: a possible smuggling attempt; the server MUST close.
            self._refuse(BAD_REQUEST, "content-length and transfer-encoding together")
            return
        self._wait(BODY if body_follows else None, self.loop.time())
        exchange = H1Exchange(self, not body_follows)
        self.exchange = exchange
        exchange.call = self.replica.on_request(exchange, headers, body_follows, self.identity)

    def _refuse_malformed(self, exc: h11.RemoteProtocolError) -> None:
        if exc.error_status_hint == _TOO_LARGE_HINT:
            limit = self.limits.max_header_list_size
            self._refuse(HEADERS_TOO_LARGE, f"the request head exceeds {limit} bytes")
        else:
            log.debug("bad HTTP/1.1 request: %s", exc)
            self._refuse(BAD_REQUEST, "malformed HTTP/1.1 request")

    def _refuse(self, error: ErrorCode, message: str) -> None:
        """Answer with an error unless a response was already begun, then close: after a
        request whose framing cannot be trusted, the connection cannot go on."""
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = contract.error_body(error, message)
            headers = [*contract.error_headers(error),
                       (b"content-length", str(len(body)).encode()), _CLOSE]  # fmt: skip
            reason = REASONS.get(error.status, b"")
            try:
                out = self.h11.send(
                    h11.Response(status_code=error.status, headers=headers, reason=reason)
                )
                out += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
            except h11.LocalProtocolError:
                pass
            else:
                self.write(out)
                self.replica.refusals[error.code] += 1
        self.close()

    # -- the request/response cycle ---------------------------------------------------------------

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
            self._wait(IDLE, self.loop.time())
            if self._pipelined:
                self._pipelined = False
                self._update_reading()
                if not self._processing:
                    self.loop.call_soon(self._process)
        elif conn.our_state is h11.MUST_CLOSE:
            self.close()

    # -- output and backpressure --------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if data and not self._closed:
            self.transport.write(data)

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: take no further request and stop
        reading until the client has read it back down."""
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._release_waiter()
        self._update_reading()
        self.loop.call_soon(self._process)

    def writable(self) -> asyncio.Future[None] | None:
        """None while output is under the high-water mark; else a future done once it is back
        under it (or the connection is gone)."""
        if not self._write_paused:
            return None
        if self._drained is None:
            self._drained = self.loop.create_future()
        return self._drained

    def _release_waiter(self) -> None:
        drained = self._drained
        self._drained = None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _update_reading(self) -> None:
        """Read unless a pipelined request or unread output waits."""
        reading = not (self._pipelined or self._write_paused)
        if reading == self._reading or self._closed:
            return
        self._reading = reading
        if reading:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    # -- timeouts -------------------------------------------------------------------------------

    def _wait(self, waiting: Waiting | None, since: float = 0.0) -> None:
        """Start the clock of what the connection now waits for (None: nothing from the
        client); the timer moves only when this deadline comes before the one it is set for.
        A limit of 0 is no timeout, as for HTTP/2's idle_timeout_s."""
        self._waiting = waiting
        self._since = since
        if waiting is None:
            return
        timeout = getattr(self.limits, waiting.value)
        if timeout > 0 and (self._timer is None or since + timeout < self._timer_at):
            self._arm(since + timeout)

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(due, self._on_timer)
        self._timer_at = due

    def _on_timer(self) -> None:
        self._timer = None
        waiting = self._waiting
        timeout = getattr(self.limits, waiting.value) if waiting is not None else 0.0
        if waiting is None or timeout <= 0:
            return
        due = self._since + timeout
        if self.loop.time() < due:
            self._arm(due)
            return
        self._waiting = None
        log.info(
            "HTTP/1.1 connection from %s: %s of %g s passed; closing",
            self.transport.get_extra_info("peername"), waiting.value, timeout,
        )  # fmt: skip
        if waiting is LINGER:
            self.transport.abort()
            return
        if waiting is BODY:
            message = f"no request body byte for {timeout:g} s"
            exchange = self.exchange
            if exchange is not None and exchange.call is not None:
                exchange.call.refuse(REQUEST_TIMEOUT, message)  # accounted as the call's end
            self._refuse(REQUEST_TIMEOUT, message)
        self.close()

    # -- the connection ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close once the output is sent; a client that does not read it within
        ``send_stall_s`` has the connection aborted."""
        if self._closed:
            return
        self._closed = True
        self.transport.close()
        if self.transport.get_write_buffer_size():
            self._wait(LINGER, self.loop.time())
        else:
            self._waiting = None

    def goaway(self) -> None:
        """Between requests, close; with one in flight, close once it is answered."""
        self._goaway = True
        if self.exchange is None:
            self.close()

    def connection_lost(self) -> None:
        self._closed = True
        self._waiting = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._release_waiter()
        exchange = self.exchange
        self.exchange = None
        if exchange is not None and exchange.call is not None:
            exchange.call.on_reset()

    @property
    def idle(self) -> bool:
        return self.exchange is None
