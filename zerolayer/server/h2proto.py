"""The HTTP/2 side of a connection, on the sans-IO ``h2`` library.

Flow control: every stream starts with the default 64 KiB receive window, so a request the
replica refuses on its HEADERS can upload at most that much before the refusal reaches the
client; a request it admits gets its window opened at once to the body's size (so a 512 KiB body
is one round trip), and the connection window is large (thousands of concurrent streams) and
refilled as data is consumed. Outbound, a stream's data waits in its own buffer whenever the
peer's window is short, and goes out as WINDOW_UPDATEs arrive.

Writes are coalesced: responses produced by engine tasks mark the connection dirty and one
callback per loop iteration flushes everything h2 has framed, so one engine step that produces
a chunk for many streams costs one socket write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final

import h2.config
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from zerolayer.wire.h2base import H2State
from zerolayer.wire.hpackenc import LiteralEncoder

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
STREAM_WINDOW: Final = 65_535
MAX_CONCURRENT_STREAMS: Final = 16_384
MAX_FRAME_SIZE: Final = 1 << 20
MAX_HEADER_LIST_SIZE: Final = 64 << 10
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


class H2Stream:
    """One stream: the sink a Call writes its response to (see ``core.Sink``)."""

    __slots__ = ("call", "conn", "local_ended", "pending", "pending_end", "remote_ended",
                 "reset_after", "sid")  # fmt: skip

    def __init__(self, conn: H2Handler, sid: int) -> None:
        self.conn = conn
        self.sid = sid
        self.call: Call | None = None
        self.remote_ended = False
        self.local_ended = False
        self.pending: bytearray | None = None
        self.pending_end = False
        self.reset_after: ErrorCodes | None = None

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
        """Backpressure (see ``core.Sink``)."""
        return None

    def open_window(self, size: int) -> None:
        increment = size - STREAM_WINDOW
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
        conn = H2State(config=CONFIG)
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_SIZE,
            },
        )
        conn.max_inbound_frame_size = MAX_FRAME_SIZE
        # Response headers are a handful of constant fields: cached encodings beat hpack's
        # per-field table search (see hpackenc).
        conn.encoder = LiteralEncoder()  # type: ignore[assignment]
        conn.initiate_connection()
        conn.increment_flow_control_window(CONNECTION_WINDOW - 65_535)
        self.h2 = conn
        self.streams: dict[int, H2Stream] = {}
        self.blocked: set[H2Stream] = set()
        self._dirty = False
        self._closed = False
        self._ping_outstanding = False
        self._keepalive: asyncio.TimerHandle | None = None
        if replica.keepalive_s > 0:
            self._keepalive = self.loop.call_later(replica.keepalive_s, self._on_keepalive)
        self.flush()

    # -- inbound --------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        conn = self.h2
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.debug("h2 protocol error: %s", exc)
            self.flush()
            self.close()
            return
        streams = self.streams
        for event in events:
            if type(event) is _DataReceived:
                stream = streams.get(event.stream_id)
                if event.flow_controlled_length:
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if stream is not None and stream.call is not None:
                    stream.call.on_data(event.data)
            elif type(event) is _RequestReceived:
                self._on_request(event)
            elif type(event) is _StreamEnded:
                sid = event.stream_id
                stream = streams.get(sid)
                if stream is not None:
                    stream.remote_ended = True
                    call = stream.call
                    if call is not None:
                        try:
                            call.on_end()
                        except Exception:
                            log.exception("failed to handle a request body on stream %d", sid)
                            call.on_reset()
                            self.reset(stream, ErrorCodes.INTERNAL_ERROR)
                    self.forget_if_done(stream)
            elif type(event) is _StreamReset:
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    stream.local_ended = stream.remote_ended = True
                    stream.pending = None
                    self.blocked.discard(stream)
                    call, stream.call = stream.call, None
                    if call is not None:
                        call.on_reset()
            elif type(event) is _WindowUpdated:
                if event.stream_id:
                    stream = streams.get(event.stream_id)
                    if stream is not None and stream in self.blocked:
                        self.drain(stream)
                else:
                    self._drain_blocked()
            elif type(event) is _RemoteSettingsChanged:
                self._drain_blocked()
            elif type(event) is _PingAckReceived:
                self._ping_outstanding = False
            elif type(event) is _ConnectionTerminated:
                self.flush()
                self.close()
                return
        self.flush()

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        stream = H2Stream(self, sid)
        self.streams[sid] = stream
        ended = event.stream_ended is not None
        stream.remote_ended = ended
        try:
            stream.call = self.replica.on_request(stream, event.headers, not ended, self.identity)
        except Exception:  # a bug handling one request must not take the connection down
            log.exception("failed to handle a request on stream %d", sid)
            self.reset(stream, ErrorCodes.INTERNAL_ERROR)

    # -- outbound -------------------------------------------------------------------------------

    def send(self, stream: H2Stream, data: bytes, end: bool) -> None:
        """Send ``data`` on ``stream`` as far as the peer's windows allow; buffer the rest."""
        if stream.local_ended:
            return
        if stream.pending is None:
            conn = self.h2
            size = len(data)
            if size <= conn.max_outbound_frame_size and size <= conn.local_flow_control_window(
                stream.sid
            ):
                conn.send_data(stream.sid, data, end_stream=end)
                if end:
                    stream.local_ended = True
                return
            stream.pending = bytearray(data)
        else:
            stream.pending += data
        stream.pending_end = end
        self.drain(stream)

    def drain(self, stream: H2Stream) -> None:
        """Send what a stream has buffered, as far as the windows allow."""
        pending = stream.pending
        if pending is None:
            return
        conn = self.h2
        sid = stream.sid
        try:
            while pending:
                window = conn.local_flow_control_window(sid)
                if window <= 0:
                    self.blocked.add(stream)
                    return
                size = min(window, conn.max_outbound_frame_size, len(pending))
                last = size == len(pending)
                conn.send_data(sid, bytes(pending[:size]), end_stream=last and stream.pending_end)
                del pending[:size]
            if stream.pending_end:
                stream.local_ended = True
            stream.pending = None
            self.blocked.discard(stream)
            if stream.reset_after is not None:
                self.reset(stream, stream.reset_after)
            self.forget_if_done(stream)
        except h2.exceptions.StreamClosedError:
            stream.pending = None
            stream.call = None
            self.blocked.discard(stream)
            self.streams.pop(sid, None)

    def _drain_blocked(self) -> None:
        for stream in list(self.blocked):
            self.drain(stream)

    def reset(self, stream: H2Stream, code: ErrorCodes) -> None:
        stream.pending = None
        stream.local_ended = True
        stream.call = None
        self.blocked.discard(stream)
        self.streams.pop(stream.sid, None)
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.h2.reset_stream(stream.sid, code)

    def forget_if_done(self, stream: H2Stream) -> None:
        """Drop a finished stream, and its link to the call (the call keeps its sink): no
        stream-call cycle is left for the garbage collector."""
        if stream.local_ended and stream.remote_ended and stream.pending is None:
            stream.call = None
            self.streams.pop(stream.sid, None)

    def mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._dirty = False
        data = self.h2.data_to_send()
        if data and not self._closed:
            self.transport.write(data)

    # -- keepalive and shutdown -------------------------------------------------------------------

    def _on_keepalive(self) -> None:
        if self._closed:
            return
        if self._ping_outstanding:
            log.info("peer did not answer a PING within %.1f s; closing", self.replica.keepalive_s)
            self.close()
            return
        self._ping_outstanding = True
        self.h2.ping(b"zl-alive")
        self.flush()
        self._keepalive = self.loop.call_later(self.replica.keepalive_s, self._on_keepalive)

    def goaway(self) -> None:
        """Tell the peer no new streams will be accepted (GOAWAY, NO_ERROR)."""
        if not self._closed:
            self.h2.close_connection()
            self.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
        self.transport.close()

    def connection_lost(self) -> None:
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
        streams = list(self.streams.values())
        self.streams.clear()
        self.blocked.clear()
        for stream in streams:
            call, stream.call = stream.call, None
            if call is not None:
                call.on_reset()

    @property
    def idle(self) -> bool:
        return not self.streams
