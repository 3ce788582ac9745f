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
frames each have a rate budget (``budget.TokenBucket``); past one: GOAWAY(ENHANCE_YOUR_CALM).

Backpressure: a stream's buffer may reach the limits' ``stream_send_buffer_bytes``; past it
``writable()`` hands the engine loop a future, so no more tokens are pulled for a client that
does not read (and the call is stalled after ``send_stall_s``). While the transport's own buffer
is over its high-water mark (asyncio's ``pause_writing``), no DATA is framed into it and nothing
is read, so a client that does not read cannot make the replica queue answers to new requests,
PINGs or SETTINGS either.

Writes are coalesced: responses produced by engine tasks mark the connection dirty and one
callback per loop iteration flushes everything h2 has framed, so one engine step that produces
a chunk for many streams costs one socket write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Final

import h2.config
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from serving.wire.contract import (
    BAD_REQUEST,
    OVERLOADED,
    REQUEST_TIMEOUT,
    error_body,
    error_headers,
)
from serving.wire.h2base import H2ServerState, RequestMalformed
from serving.wire.hpackenc import LiteralEncoder
from zerolayer.server.budget import TokenBucket
from zerolayer.server.core import BODY

if TYPE_CHECKING:
    from zerolayer.server.core import Call, Replica

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
PING_PAYLOAD_BYTES: Final = 8  # RFC 9113 6.7: a PING carries exactly 8 octets
IDLE_CHECKS: Final = 4  # idle checks per idle_timeout_s (see H2Handler._on_idle_check)


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
            conn.send(self, body, True)
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
            conn.watch_unsent(self)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.conn.h2.send_headers(self.sid, [(_STATUS, STATUS[status]), *headers])

    def write(self, data: bytes) -> None:
        conn = self.conn
        conn.send(self, data, False)
        conn.mark_dirty()

    def end(self, data: bytes) -> None:
        conn = self.conn
        conn.send(self, data, True)
        conn.mark_dirty()
        conn.forget_if_done(self)
        if self.pending is not None:
            conn.watch_unsent(self)

    def cancel(self) -> None:
        """RST_STREAM(CANCEL) after whatever the peer's window lets through now; the rest of a
        response stuck behind flow control is dropped (a peer that does not read gets no more)."""
        conn = self.conn
        if self.pending is not None:
            self.pending_end = False
            conn.drain(self)
        if not self.local_ended:
            conn.reset(self, ErrorCodes.CANCEL)
        conn.mark_dirty()

    def writable(self) -> asyncio.Future[None] | None:
        """Backpressure (see ``core.Sink``): None while the unsent output is under the limits'
        ``stream_send_buffer_bytes``, else a future done once the client has read it back under
        or the stream is gone. One future per congestion episode: core's stall clock runs from
        the moment the buffer fills to the moment it drains under the bound."""
        pending = self.pending
        if pending is None:
            return None
        conn = self.conn
        if len(pending) < conn.send_buffer and not conn.over_budget():
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
    """One HTTP/2 connection: h2's state machine between the transport and the replica."""

    def __init__(
        self, replica: Replica, transport: asyncio.Transport, identity: str | None = None
    ) -> None:
        self.replica = replica
        self.transport = transport
        self.identity = identity
        self.loop = replica.loop
        limits = replica.limits
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
        self.h2 = conn
        self.streams: dict[int, H2Stream] = {}
        self.blocked: set[H2Stream] = set()
        # Request bodies in progress: the time each got its last byte, and their bytes in all.
        self.uploads: dict[Call, float] = {}
        self.upload_bytes = 0
        self._body_timer: asyncio.TimerHandle | None = None
        now = self.loop.time()
        self._resets = TokenBucket(limits.reset_burst, limits.reset_rate, now)
        self._pings = TokenBucket(limits.control_burst, limits.control_rate, now)
        self._settings = TokenBucket(limits.control_burst, limits.control_rate, now)
        self._empty_frames = TokenBucket(limits.control_burst, limits.control_rate, now)
        self._dirty = False
        self._closed = False
        self._lingering = False
        self._lost = False
        self._unflushed = 0
        self._flush_at = limits.write_high_water()
        self.send_buffer = replica.limits.stream_send_buffer_bytes
        # Response bytes held for the client in the streams' buffers, in all.
        self.unsent = 0
        self.budget = limits.connection_buffer_bytes
        self._paused = False
        self._ping_payload: bytes | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        if replica.keepalive_s > 0:
            self._keepalive = self.loop.call_later(replica.keepalive_s, self._on_keepalive)
        self._idle_check: asyncio.TimerHandle | None = None
        self._quiet_checks = 1  # nothing is open when a connection starts
        self._newest_stream = 0
        if replica.limits.idle_timeout_s > 0:
            self._arm_idle_check()
        self.flush()

    # -- inbound --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        conn = self.h2
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("h2 protocol error: %s", exc)
            self.flush()  # h2's GOAWAY
            self.linger()
            return
        streams = self.streams
        now = self.loop.time()
        for event in events:
            if type(event) is _DataReceived:
                stream = streams.get(event.stream_id)
                if event.flow_controlled_length:
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif event.stream_ended is None and not self._empty_frames.take(now):
                    self._calm_down("empty DATA frames")  # CVE-2019-9518
                    return
                if stream is not None:
                    call = stream.call
                    if call is not None and call.state is BODY:
                        self._on_body(call, event.data, now)
            elif type(event) is _RequestReceived:
                self._on_request(event, now)
            elif type(event) is _StreamEnded:
                sid = event.stream_id
                stream = streams.get(sid)
                if stream is not None:
                    stream.remote_ended = True
                    call = stream.call
                    if call is not None:
                        self._end_upload(call)
                        try:
                            call.on_end()
                        except Exception:
                            log.exception("failed to handle a request body on stream %d", sid)
                            call.on_reset()
                            self.reset(stream, ErrorCodes.INTERNAL_ERROR)
                    self.forget_if_done(stream)
            elif type(event) is _StreamReset:
                if event.remote_reset and not self._resets.take(now):
                    self._calm_down("RST_STREAM frames")  # CVE-2023-44487, rapid reset
                    return
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    stream.local_ended = stream.remote_ended = True
                    self._drop_unsent(stream)
                    self.blocked.discard(stream)
                    call, stream.call = stream.call, None
                    if call is not None:
                        self._end_upload(call)
                        call.on_reset()
            elif type(event) is _WindowUpdated:
                if event.stream_id:
                    stream = streams.get(event.stream_id)
                    if stream is not None and stream in self.blocked:
                        self.drain(stream)
                else:
                    self._drain_blocked()
            elif type(event) is _RemoteSettingsChanged:
                if not self._settings.take(now):
                    self._calm_down("SETTINGS frames")  # CVE-2019-9515
                    return
                self._drain_blocked()
            elif type(event) is _PingReceived:
                if not self._pings.take(now):
                    self._calm_down("PING frames")  # CVE-2019-9512
                    return
            elif type(event) is RequestMalformed:
                self._on_malformed(event)
            elif type(event) is _PingAckReceived:
                self._on_ping_ack(event.ping_data)
            elif type(event) is _ConnectionTerminated:
                self.flush()
                self.close()
                return
        if self.uploads and self._body_timer is None and self.replica.limits.body_timeout_s > 0:
            self._arm_body_timer()
        self.flush()

    def _on_request(self, event: h2.events.RequestReceived, now: float) -> None:
        sid = event.stream_id
        state = self.h2.streams.get(sid)
        if state is None or state.closed:
            # Reset by the client in the same read (rapid reset, CVE-2023-44487): h2 has closed
            # the stream already, so it is never routed and nothing is held for it.
            return
        if len(self.streams) >= self.replica.limits.max_concurrent_streams:
            # RFC 9113 section 5.1.2, enforced from the moment the limit is sent rather than
            # when the client acknowledges it (h2 refuses past it after that, see H2ServerState):
            # REFUSED_STREAM tells the client it may retry.
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        stream = H2Stream(self, sid)
        self.streams[sid] = stream
        ended = event.stream_ended is not None
        stream.remote_ended = ended
        try:
            call = self.replica.on_request(stream, event.headers, not ended, self.identity)
        except Exception:  # a bug handling one request must not take the connection down
            log.exception("failed to handle a request on stream %d", sid)
            self.reset(stream, ErrorCodes.INTERNAL_ERROR)
            return
        stream.call = call
        if call is not None:
            self.uploads[call] = now

    def _on_body(self, call: Call, data: bytes, now: float) -> None:
        """Hold a chunk of a request body within the connection's budget
        (``connection_buffer_bytes``); a stream whose body would pass it is refused alone."""
        size = len(data)
        if self.upload_bytes + self.unsent + size > self.budget:
            self._end_upload(call)
            call.refuse(OVERLOADED, f"this connection's bodies in progress and unread responses "
                                    f"would pass {self.budget} bytes")  # fmt: skip
            return
        self.uploads[call] = now
        self.upload_bytes += size
        call.on_data(data)
        if call.state is not BODY:  # refused while reading (too large, deadline)
            self._end_upload(call)

    def _end_upload(self, call: Call) -> None:
        """The call reads no more body: its bytes leave the connection's budget (they are
        exactly its ``body_len``, counted as they arrived)."""
        if self.uploads.pop(call, None) is not None:
            self.upload_bytes -= call.body_len

    def _arm_body_timer(self) -> None:
        first = min(self.uploads.values())
        when = first + self.replica.limits.body_timeout_s
        self._body_timer = self.loop.call_at(when, self._on_body_timeout)

    def _on_body_timeout(self) -> None:
        """408 (and the stream reset) for each body that got no byte for ``body_timeout_s``
        (nginx's client_body_timeout): one timer per connection, armed for the oldest upload
        only while one is in progress, so a body that arrives in the same read costs none."""
        self._body_timer = None
        if self._closed:
            return
        timeout = self.replica.limits.body_timeout_s
        cutoff = self.loop.time() - timeout
        for call, last in list(self.uploads.items()):
            if last <= cutoff:
                self._end_upload(call)
                call.refuse(REQUEST_TIMEOUT, f"no request body byte for {timeout:g} s")
        if self.uploads:
            self._arm_body_timer()
        self.flush()

    def _on_malformed(self, event: RequestMalformed) -> None:
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
            return
        found = self.streams.get(sid)
        if found is None:
            return
        call = found.call
        if call is not None and call.state is BODY:
            self._end_upload(call)
            call.refuse(BAD_REQUEST, message)
        else:
            self.reset(found, ErrorCodes.PROTOCOL_ERROR)

    def _calm_down(self, what: str) -> None:
        """GOAWAY(ENHANCE_YOUR_CALM) and close: the client spent a rate budget (RFC 9113
        section 5.4.1, a connection error). What h2 framed in answer to the flood (its ACKs) is
        dropped first: answering is what a flood is after."""
        log.warning("closing an HTTP/2 connection: %s past their budget", what)
        self.h2.clear_outbound_data_buffer()
        self.h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
        self.flush()
        self.linger()

    def linger(self) -> None:
        """Close after ``linger_s``, reading and discarding meanwhile (nginx's lingering close).

        Closing a socket with unread input makes the kernel send a TCP reset, and a reset can
        destroy the GOAWAY in the client's receive buffer before it is read: the client would
        see a reset where the replica told it why. The write side is shut (FIN after the GOAWAY)
        where the transport can, and what still arrives is dropped unparsed."""
        if self._closed or self._lingering:
            return
        self._lingering = True
        self._cancel_timers()
        self._abandon_streams()
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        self.loop.call_later(self.replica.limits.linger_s, self.close)

    # -- outbound -------------------------------------------------------------------------------

    def send(self, stream: H2Stream, data: bytes, end: bool) -> None:
        """Send ``data`` on ``stream`` as far as the peer's windows and the transport allow;
        buffer the rest."""
        if stream.local_ended:
            return
        if stream.pending is None:
            conn = self.h2
            size = len(data)
            if (
                size <= conn.max_outbound_frame_size
                and size <= conn.local_flow_control_window(stream.sid)
                and not self._paused
            ):
                conn.send_data(stream.sid, data, end_stream=end)
                if end:
                    stream.local_ended = True
                self._framed(size)
                return
            stream.pending = bytearray(data)
        else:
            stream.pending += data
        self.unsent += len(data)
        stream.pending_end = end
        self.drain(stream)

    def drain(self, stream: H2Stream) -> None:
        """Send what a stream has buffered, as far as the windows and the transport allow; wake
        the engine loop once the buffer is back under its bound."""
        pending = stream.pending
        if pending is None:
            return
        conn = self.h2
        sid = stream.sid
        try:
            while pending:
                window = conn.local_flow_control_window(sid)
                if window <= 0 or self._paused:
                    self.blocked.add(stream)
                    if stream.waiter is not None and len(pending) < self.send_buffer:
                        stream.wake()
                    return
                size = min(window, conn.max_outbound_frame_size, len(pending))
                last = size == len(pending)
                conn.send_data(sid, bytes(pending[:size]), end_stream=last and stream.pending_end)
                del pending[:size]
                self.unsent -= size
                self._framed(size)
            if stream.pending_end:
                stream.local_ended = True
            stream.pending = None
            self.blocked.discard(stream)
            stream.wake()
            if stream.reset_after is not None:
                self.reset(stream, stream.reset_after)
            self.forget_if_done(stream)
        except h2.exceptions.StreamClosedError:
            self._drop_unsent(stream)
            stream.call = None
            self.blocked.discard(stream)
            self.streams.pop(sid, None)
            stream.wake()

    def _drain_blocked(self) -> None:
        for stream in list(self.blocked):
            self.drain(stream)

    def reset(self, stream: H2Stream, code: ErrorCodes) -> None:
        if stream.call is not None:
            self._end_upload(stream.call)
        self._drop_unsent(stream)
        stream.local_ended = True
        stream.call = None
        self.blocked.discard(stream)
        self.streams.pop(stream.sid, None)
        stream.wake()
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.h2.reset_stream(stream.sid, code)

    def forget_if_done(self, stream: H2Stream) -> None:
        """Drop a finished stream, and its link to the call (the call keeps its sink): no
        stream-call cycle is left for the garbage collector."""
        if stream.local_ended and stream.remote_ended and stream.pending is None:
            stream.call = None
            self.streams.pop(stream.sid, None)

    def _drop_unsent(self, stream: H2Stream) -> None:
        """Forget what a stream still holds for the client (reset, closed)."""
        if stream.pending is not None:
            self.unsent -= len(stream.pending)
            stream.pending = None

    def over_budget(self) -> bool:
        """Whether the connection holds more than ``connection_buffer_bytes`` in response data
        its client has not read and request bodies in progress."""
        return self.unsent + self.upload_bytes > self.budget

    def watch_unsent(self, stream: H2Stream) -> None:
        """A finished response still held for a client that does not read: no engine run is left
        for core to stall, so the stream is reset here once the client reads none of it for
        ``send_stall_s`` (as nginx's send_timeout: the time between two reads)."""
        pending = stream.pending
        if pending is not None and not self._closed and self.over_budget():
            # A finished response that would keep the connection past its budget (the client
            # reads none of its streams): cut it now rather than hold it for send_stall_s.
            log.info("stream %d: response unread and the connection over budget", stream.sid)
            self.reset(stream, ErrorCodes.CANCEL)
            return
        if pending is not None and not self._closed and self.replica.limits.send_stall_s > 0:
            stall_s = self.replica.limits.send_stall_s
            self.loop.call_later(stall_s, self._check_unsent, stream, len(pending))

    def _check_unsent(self, stream: H2Stream, unsent_before: int) -> None:
        pending = stream.pending
        if pending is None or self._closed:
            return
        if len(pending) < unsent_before:
            self.watch_unsent(stream)
            return
        log.info("stream %d: the client read nothing of its response; resetting", stream.sid)
        self.reset(stream, ErrorCodes.CANCEL)
        self.mark_dirty()

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark (asyncio flow control): frame no
        more DATA into it, so the streams' bounded buffers fill and push back on the engine, and
        read nothing more, so a client that does not read cannot make the replica queue answers
        to new requests, PINGs or SETTINGS."""
        self._paused = True
        if not self._closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """The transport drained under its low-water mark: send what the streams hold, one
        stream per write so that the transport pausing again stops it, then read again."""
        self._paused = False
        if self._closed:
            return
        for stream in list(self.blocked):
            if self._paused:
                return
            self.drain(stream)
            self.flush()
        if not self._paused:
            self.transport.resume_reading()

    def mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.loop.call_soon(self.flush)

    def _framed(self, size: int) -> None:
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

    # -- keepalive and shutdown -------------------------------------------------------------------

    def _on_keepalive(self) -> None:
        """PING with an unpredictable payload; close if the last one was not acknowledged.
        TCP delivers in order, so the ACK of a payload the client could not guess proves it
        read everything sent before that PING (RFC 9113 6.7)."""
        if self._closed:
            return
        if self._ping_payload is not None:
            log.info("peer did not answer a PING within %.1f s; closing", self.replica.keepalive_s)
            self.close()
            return
        self._ping_payload = os.urandom(PING_PAYLOAD_BYTES)
        self.h2.ping(self._ping_payload)
        self.flush()
        self._keepalive = self.loop.call_later(self.replica.keepalive_s, self._on_keepalive)

    def _on_ping_ack(self, payload: bytes) -> None:
        """Only the ACK of the PING in flight counts; any other payload proves nothing."""
        if payload == self._ping_payload:
            self._ping_payload = None

    def _arm_idle_check(self) -> None:
        interval = self.replica.limits.idle_timeout_s / IDLE_CHECKS
        self._idle_check = self.loop.call_later(interval, self._on_idle_check)

    def _on_idle_check(self) -> None:
        """GOAWAY(NO_ERROR) and close once no stream has been open for ``idle_timeout_s``.

        Checked IDLE_CHECKS times per timeout rather than on each stream's open and close, so
        streams cost nothing. A check is quiet when no stream is open and none opened since the
        previous check. A stream seen at the last busy check may have closed just after it, so
        the first quiet check proves nothing before itself; IDLE_CHECKS more in a row prove the
        whole timeout idle. The close thus comes at most 1/IDLE_CHECKS of the timeout late (a
        new connection, with nothing open yet, starts with its first quiet check done)."""
        if self._closed:
            return
        timeout = self.replica.limits.idle_timeout_s
        newest = self.h2.highest_inbound_stream_id
        if self.streams or newest != self._newest_stream:
            self._newest_stream = newest
            self._quiet_checks = 0
        else:
            self._quiet_checks += 1
            if self._quiet_checks > IDLE_CHECKS:
                log.debug("closing a connection idle for %.1f s", timeout)
                self.goaway()
                self.close()
                return
        self._arm_idle_check()

    def goaway(self) -> None:
        """Tell the peer no new streams will be accepted (GOAWAY, NO_ERROR)."""
        if not self._closed:
            self.h2.close_connection()
            self.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cancel_timers()
        self.transport.close()
        # close() waits for the socket to take what is buffered; a client that reads nothing
        # would hold the connection (and its descriptor) for ever: abort once linger_s passed.
        self.loop.call_later(self.replica.limits.linger_s, self._abort_unless_lost)

    def _abort_unless_lost(self) -> None:
        if not self._lost:
            log.info("connection closed but its output unread for %.1f s; aborting",
                     self.replica.limits.linger_s)  # fmt: skip
            self.transport.abort()

    def _cancel_timers(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._idle_check is not None:
            self._idle_check.cancel()
        if self._body_timer is not None:
            self._body_timer.cancel()

    def connection_lost(self) -> None:
        self._closed = self._lost = True
        self._cancel_timers()
        self._abandon_streams()

    def _abandon_streams(self) -> None:
        """The connection is going: every call on it ends (engine requests aborted)."""
        streams = list(self.streams.values())
        self.streams.clear()
        self.blocked.clear()
        self.uploads.clear()
        self.upload_bytes = self.unsent = 0
        for stream in streams:
            stream.wake()
            call, stream.call = stream.call, None
            if call is not None:
                call.on_reset()

    @property
    def idle(self) -> bool:
        return not self.streams
