"""The HTTP/2 side of a connection, on the sans-IO ``h2`` library.

Flow control: every stream starts with the default 64 KiB receive window, so a request the
replica refuses on its HEADERS can upload at most that much before the refusal reaches the
client; a request it admits gets its window opened at once to the body's size (so a 512 KiB body
is one round trip), and the connection window is large (thousands of concurrent streams) and
refilled as data is consumed. Outbound, a stream's data waits in its own buffer whenever the
peer's window is short, and goes out as WINDOW_UPDATEs arrive.

Inbound, a client's fault stays as small as it can (RFC 9113 section 5.4): a malformed request
gets a 400 on its stream alone, a stream past MAX_CONCURRENT_STREAMS RST_STREAM(REFUSED_STREAM)
(see ``H2ServerState``), a request reset in the read that opened it is never routed, and request
bodies in progress share the connection's ``connection_buffer_bytes`` (past it: 503 overloaded)
and must keep arriving (``body_timeout_s``: 408). RST_STREAM, PING, SETTINGS and empty DATA
frames each have a rate budget; past one: GOAWAY(ENHANCE_YOUR_CALM). Those budgets and the
connection's clocks are its ``h2guard.ConnectionGuard``'s.

Backpressure: a stream's buffer may reach the limits' ``stream_send_buffer_bytes``; past it
``writable()`` hands the engine loop a future, so no more tokens are pulled for a client that
does not read (and the call is stalled after ``send_stall_s``). While the transport's own buffer
is over its high-water mark (asyncio's ``pause_writing``), no DATA is framed into it and nothing
is read, so a client that does not read cannot make the replica queue answers to new requests,
PINGs or SETTINGS either. The buffers are the connection's ``h2buffer.StreamBuffer``.

Writes are coalesced: responses produced by engine tasks mark the connection dirty and one
callback per loop iteration flushes everything h2 has framed, so one engine step that produces
a chunk for many streams costs one socket write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import h2.config
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from serving.wire.contract import BAD_REQUEST, OVERLOADED, error_body, error_headers
from serving.wire.h2base import H2ServerState, RequestMalformed
from serving.wire.hpackenc import LiteralEncoder
from zerolayer.server.h2buffer import StreamBuffer
from zerolayer.server.h2guard import ConnectionGuard
from zerolayer.server.limits import Limits

if TYPE_CHECKING:
    from zerolayer.server.core import Call, ReplicaCore

log = logging.getLogger("zerolayer.server.h2")

CONFIG: Final = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
    validate_inbound_headers=True,
    normalize_inbound_headers=True,
)
CONNECTION_WINDOW: Final = 1 << 30
STATUS: Final = {code: str(code).encode() for code in range(100, 600)}
_STATUS: Final = b":status"

_RequestReceived = h2.events.RequestReceived
_DataReceived = h2.events.DataReceived
_StreamEnded = h2.events.StreamEnded
_StreamReset = h2.events.StreamReset
_WindowUpdated = h2.events.WindowUpdated
_RemoteSettingsChanged = h2.events.RemoteSettingsChanged
_ConnectionTerminated = h2.events.ConnectionTerminated
_PingAckReceived = h2.events.PingAckReceived
_PingReceived = h2.events.PingReceived
# An event handler, given the event (of the type it is registered for) and the loop's time; True
# when the connection is closing and the rest of the read is to be dropped.
Handle = Callable[[Any, float], bool]


class H2Stream:
    """One stream: the sink a Call writes its response to (see ``core.Sink``)."""

    __slots__ = ("call", "conn", "local_ended", "pending", "pending_end", "remote_ended",
                 "reset_after", "sid", "waiter")  # fmt: skip

    def __init__(self, conn: H2Handler, sid: int) -> None:
        self.conn = conn
        self.sid = sid
        self.call: Call | None = None
        self.remote_ended = False
        self.local_ended = False
        self.pending: bytearray | None = None
        self.pending_end = False
        self.reset_after: ErrorCodes | None = None
        self.waiter: asyncio.Future[None] | None = None

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if self.local_ended:
            return
        conn = self.conn
        conn.h2.send_headers(self.sid, [(_STATUS, STATUS[status]), *headers], end_stream=not body)
        if body:
            conn.buffer.send(self, body, True)
        else:
            self.local_ended = True
        if not self.remote_ended:
            # RFC 9113 8.1: the whole response, then RST_STREAM(NO_ERROR) so the client stops
            # uploading a body nobody will read.
            self.reset_after = ErrorCodes.NO_ERROR
            if self.pending is None:
                conn.reset(self, ErrorCodes.NO_ERROR)
        conn.mark_dirty()
        conn.forget_if_done(self)
        if self.pending is not None:
            conn.buffer.watch(self)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.conn.h2.send_headers(self.sid, [(_STATUS, STATUS[status]), *headers])

    def write(self, data: bytes) -> None:
        conn = self.conn
        conn.buffer.send(self, data, False)
        conn.mark_dirty()

    def end(self, data: bytes) -> None:
        conn = self.conn
        conn.buffer.send(self, data, True)
        conn.mark_dirty()
        conn.forget_if_done(self)
        if self.pending is not None:
            conn.buffer.watch(self)

    def cancel(self) -> None:
        """RST_STREAM(CANCEL) after whatever the peer's window lets through now; the rest of a
        response stuck behind flow control is dropped (a peer that does not read gets no more)."""
        conn = self.conn
        if self.pending is not None:
            self.pending_end = False
            conn.buffer.drain(self)
        if not self.local_ended:
            conn.reset(self, ErrorCodes.CANCEL)
        conn.mark_dirty()

    def writable(self) -> asyncio.Future[None] | None:
        """Backpressure (see ``core.Sink``): None while the unsent output is under the limits'
        ``stream_send_buffer_bytes``, else a future done once the client has read it back under
        or the stream is gone. One future per congestion episode: core's stall clock runs from
        the moment the buffer fills to the moment it drains under the bound."""
        if self.pending is None or not self.conn.buffer.full(self):
            return None
        if self.waiter is None:
            self.waiter = self.conn.loop.create_future()
        return self.waiter

    def wake(self) -> None:
        """Resolve the engine loop's wait on ``writable``, if any."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def open_window(self, size: int) -> None:
        increment = size - self.conn.h2.local_settings.initial_window_size
        if increment > 0 and not self.remote_ended:
            self.conn.h2.increment_flow_control_window(increment, stream_id=self.sid)


class H2Handler:
    """One HTTP/2 connection: h2's events dispatched to the replica, with the connection's
    limits in its ``guard`` and its outbound flow control in its ``buffer``."""

    def __init__(
        self, replica: ReplicaCore, transport: asyncio.Transport, identity: str | None = None
    ) -> None:
        self.replica = replica
        self.transport = transport
        self.identity = identity
        self.loop = replica.loop
        limits = replica.limits
        self.h2 = conn = server_state(limits)
        self.streams: dict[int, H2Stream] = {}
        self._dirty = False
        self._closed = False
        self._lingering = False
        self._lost = False
        self._unflushed = 0
        self._flush_at = limits.write_high_water()
        self.buffer: StreamBuffer[H2Stream] = StreamBuffer(
            conn, self, self.loop, limits.stream_send_buffer_bytes, limits.send_stall_s
        )
        self.guard = ConnectionGuard(limits, self.loop, self)
        # h2's events this connection acts on; any other is h2's own business.
        self._handlers: dict[type, Handle] = {
            _DataReceived: self._on_data,
            _RequestReceived: self._on_request,
            _StreamEnded: self._on_stream_ended,
            _StreamReset: self._on_stream_reset,
            _WindowUpdated: self._on_window_updated,
            _RemoteSettingsChanged: self._on_settings,
            _PingReceived: self._on_ping,
            RequestMalformed: self._on_malformed,
            _PingAckReceived: self._on_ping_ack,
            _ConnectionTerminated: self._on_terminated,
        }
        self.flush()

    # -- inbound --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("h2 protocol error: %s", exc)
            self.flush()  # h2's GOAWAY
            self.linger()
            return
        handlers = self._handlers
        now = self.loop.time()
        for event in events:
            handle = handlers.get(type(event))
            if handle is not None and handle(event, now):
                return
        self.guard.watch_uploads()
        self.flush()

    def _on_data(self, event: h2.events.DataReceived, now: float) -> bool:
        if event.flow_controlled_length:
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif event.stream_ended is None and not self.guard.empty_frames.take(now):
            return self._calm_down("empty DATA frames")  # CVE-2019-9518
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            call = stream.call
            if call is not None and call.accepts_data:
                self._on_body(call, event.data, now)
        return False

    def _on_request(self, event: h2.events.RequestReceived, now: float) -> bool:
        sid = event.stream_id
        state = self.h2.streams.get(sid)
        if state is None or state.closed:
            # Reset by the client in the same read (rapid reset, CVE-2023-44487): h2 has closed
            # the stream already, so it is never routed and nothing is held for it.
            return False
        if len(self.streams) >= self.replica.limits.max_concurrent_streams:
            # RFC 9113 section 5.1.2, enforced from the moment the limit is sent rather than
            # when the client acknowledges it (h2 refuses past it after that, see H2ServerState):
            # REFUSED_STREAM tells the client it may retry.
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return False
        stream = H2Stream(self, sid)
        self.streams[sid] = stream
        ended = event.stream_ended is not None
        stream.remote_ended = ended
        try:
            call = self.replica.on_request(stream, event.headers, not ended, self.identity)
        except Exception:  # a bug handling one request must not take the connection down
            log.exception("failed to handle a request on stream %d", sid)
            self.reset(stream, ErrorCodes.INTERNAL_ERROR)
            return False
        stream.call = call
        if call is not None:
            self.guard.started_upload(call, now)
        return False

    def _on_body(self, call: Call, data: bytes, now: float) -> None:
        """Hold a chunk of a request body within the connection's budget
        (``connection_buffer_bytes``); a stream whose body would pass it is refused alone."""
        guard = self.guard
        size = len(data)
        if not guard.has_room(size, self.buffer.unsent):
            guard.end_upload(call)
            call.refuse(OVERLOADED, f"this connection's bodies in progress and unread responses "
                                    f"would pass {guard.budget} bytes")  # fmt: skip
            return
        guard.uploaded(call, size, now)
        call.on_data(data)
        if not call.accepts_data:  # refused while reading (too large, deadline)
            guard.end_upload(call)

    def _on_stream_ended(self, event: h2.events.StreamEnded, now: float) -> bool:
        sid = event.stream_id
        stream = self.streams.get(sid)
        if stream is None:
            return False
        stream.remote_ended = True
        call = stream.call
        if call is not None:
            self.guard.end_upload(call)
            try:
                call.on_end()
            except Exception:
                log.exception("failed to handle a request body on stream %d", sid)
                call.on_reset()
                self.reset(stream, ErrorCodes.INTERNAL_ERROR)
        self.forget_if_done(stream)
        return False

    def _on_stream_reset(self, event: h2.events.StreamReset, now: float) -> bool:
        if event.remote_reset and not self.guard.resets.take(now):
            return self._calm_down("RST_STREAM frames")  # CVE-2023-44487, rapid reset
        stream = self.streams.pop(event.stream_id, None)
        if stream is not None:
            stream.local_ended = stream.remote_ended = True
            self.buffer.release(stream)
            call, stream.call = stream.call, None
            if call is not None:
                self.guard.end_upload(call)
                call.on_reset()
        return False

    def _on_window_updated(self, event: h2.events.WindowUpdated, now: float) -> bool:
        buffer = self.buffer
        if event.stream_id:
            stream = self.streams.get(event.stream_id)
            if stream is not None and stream in buffer.blocked:
                buffer.drain(stream)
        else:
            buffer.drain_blocked()
        return False

    def _on_settings(self, event: h2.events.RemoteSettingsChanged, now: float) -> bool:
        if not self.guard.settings.take(now):
            return self._calm_down("SETTINGS frames")  # CVE-2019-9515
        self.buffer.drain_blocked()
        return False

    def _on_ping(self, event: h2.events.PingReceived, now: float) -> bool:
        if not self.guard.pings.take(now):
            return self._calm_down("PING frames")  # CVE-2019-9512
        return False

    def _on_ping_ack(self, event: h2.events.PingAckReceived, now: float) -> bool:
        self.guard.ping_acked(event.ping_data)
        return False

    def _on_terminated(self, event: h2.events.ConnectionTerminated, now: float) -> bool:
        self.flush()
        self.close()
        return True

    def _on_malformed(self, event: RequestMalformed, now: float) -> bool:
        """RFC 9113 section 8.1.1: a malformed request is a stream error. A 400 where no response
        has begun (the server MAY answer before resetting), else RST_STREAM(PROTOCOL_ERROR)."""
        sid = event.stream_id
        log.debug("malformed request on stream %d: %s", sid, event.reason)
        if event.flow_controlled_length:
            self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
        message = f"malformed request: {event.reason}"
        if event.opened:
            stream = H2Stream(self, sid)
            self.streams[sid] = stream
            stream.remote_ended = event.ended
            self.replica.refusals[BAD_REQUEST.code] += 1
            stream.respond(BAD_REQUEST.status, error_headers(BAD_REQUEST),
                           error_body(BAD_REQUEST, message))  # fmt: skip
            return False
        found = self.streams.get(sid)
        if found is None:
            return False
        call = found.call
        if call is not None and call.accepts_data:
            self.guard.end_upload(call)
            call.refuse(BAD_REQUEST, message)
        else:
            self.reset(found, ErrorCodes.PROTOCOL_ERROR)
        return False

    def _calm_down(self, what: str) -> bool:
        """GOAWAY(ENHANCE_YOUR_CALM) and close: the client spent a rate budget (RFC 9113
        section 5.4.1, a connection error). What h2 framed in answer to the flood (its ACKs) is
        dropped first: answering is what a flood is after. True: the rest of the read is
        dropped."""
        log.warning("closing an HTTP/2 connection: %s past their budget", what)
        self.h2.clear_outbound_data_buffer()
        self.h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
        self.flush()
        self.linger()
        return True

    def linger(self) -> None:
        """Close after ``linger_s``, reading and discarding meanwhile (nginx's lingering close).

        Closing a socket with unread input makes the kernel send a TCP reset, and a reset can
        destroy the GOAWAY in the client's receive buffer before it is read: the client would
        see a reset where the replica told it why. The write side is shut (FIN after the GOAWAY)
        where the transport can, and what still arrives is dropped unparsed."""
        if self._closed or self._lingering:
            return
        self._lingering = True
        self.guard.stop()
        self._abandon_streams()
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        self.loop.call_later(self.replica.limits.linger_s, self.close)

    # -- streams --------------------------------------------------------------------------------

    def reset(self, stream: H2Stream, code: ErrorCodes) -> None:
        if stream.call is not None:
            self.guard.end_upload(stream.call)
        self.buffer.release(stream)
        stream.local_ended = True
        stream.call = None
        self.streams.pop(stream.sid, None)
        stream.wake()
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.h2.reset_stream(stream.sid, code)

    def forget(self, stream: H2Stream) -> None:
        stream.call = None
        self.streams.pop(stream.sid, None)

    def forget_if_done(self, stream: H2Stream) -> None:
        """Drop a finished stream, and its link to the call (the call keeps its sink): no
        stream-call cycle is left for the garbage collector."""
        if stream.local_ended and stream.remote_ended and stream.pending is None:
            stream.call = None
            self.streams.pop(stream.sid, None)

    def over_budget(self) -> bool:
        """Whether the connection holds more than ``connection_buffer_bytes`` in response data
        its client has not read and request bodies in progress."""
        return self.guard.over_budget(self.buffer.unsent)

    # -- outbound -------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark (asyncio flow control): frame no
        more DATA into it, so the streams' bounded buffers fill and push back on the engine, and
        read nothing more, so a client that does not read cannot make the replica queue answers
        to new requests, PINGs or SETTINGS."""
        self.buffer.paused = True
        if not self._closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """The transport drained under its low-water mark: send what the streams hold, then
        read again."""
        buffer = self.buffer
        buffer.paused = False
        if self._closed:
            return
        buffer.drain_unpaused()
        if not buffer.paused:
            self.transport.resume_reading()

    def mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.loop.call_soon(self.flush)

    def framed(self, size: int) -> None:
        """Count DATA framed since the last flush; past the socket's high-water mark, flush now.
        Writes are coalesced into one flush per loop turn, but one turn can frame the answers of
        many streams (an engine that answers at once): without this they would all land in the
        socket's buffer before it could say it is full (``pause_writing``)."""
        self._unflushed += size
        if self._unflushed + self.transport.get_write_buffer_size() >= self._flush_at:
            self.flush()

    def flush(self) -> None:
        self._dirty = False
        self._unflushed = 0
        data = self.h2.data_to_send()
        if data and not self._closed and not self._lingering:
            self.transport.write(data)

    def ping(self, payload: bytes) -> None:
        """A keepalive PING (the guard's clock)."""
        self.h2.ping(payload)
        self.flush()

    # -- shutdown -------------------------------------------------------------------------------

    def goaway(self) -> None:
        """Tell the peer no new streams will be accepted (GOAWAY, NO_ERROR)."""
        if not self._closed:
            self.h2.close_connection()
            self.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.guard.stop()
        self.transport.close()
        # close() waits for the socket to take what is buffered; a client that reads nothing
        # would hold the connection (and its descriptor) for ever: abort once linger_s passed.
        self.loop.call_later(self.replica.limits.linger_s, self._abort_unless_lost)

    def _abort_unless_lost(self) -> None:
        if not self._lost:
            log.info("connection closed but its output unread for %.1f s; aborting",
                     self.replica.limits.linger_s)  # fmt: skip
            self.transport.abort()

    def connection_lost(self) -> None:
        self._closed = self._lost = True
        self.guard.stop()
        self._abandon_streams()

    def _abandon_streams(self) -> None:
        """The connection is going: every call on it ends (engine requests aborted)."""
        streams = list(self.streams.values())
        self.streams.clear()
        self.buffer.clear()
        self.guard.clear_uploads()
        for stream in streams:
            stream.wake()
            call, stream.call = stream.call, None
            if call is not None:
                call.on_reset()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def idle(self) -> bool:
        return not self.streams

    @property
    def newest_stream(self) -> int:
        return self.h2.highest_inbound_stream_id


def server_state(limits: Limits) -> H2ServerState:
    """h2's server state machine with the replica's settings, its preface and the connection
    window already framed."""
    conn = H2ServerState(CONFIG, limits.max_header_list_size)
    conn.local_settings = h2.settings.Settings(
        client=False,
        initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: limits.stream_window,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: limits.max_frame_size,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
        },
    )
    # h2 applies these once the client acknowledges the SETTINGS; a client that never does
    # must not escape them (RFC 9113 section 6.5.2 makes the header list size advisory).
    conn.max_inbound_frame_size = limits.max_frame_size
    conn.decoder.max_header_list_size = limits.max_header_list_size
    # Response headers are a handful of constant fields: cached encodings beat hpack's
    # per-field table search (see hpackenc).
    conn.encoder = LiteralEncoder()  # type: ignore[assignment]
    conn.initiate_connection()
    conn.increment_flow_control_window(CONNECTION_WINDOW - 65_535)
    return conn
