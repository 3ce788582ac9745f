"""One multiplexed HTTP/2 connection to a replica, on asyncio and the sans-IO ``h2`` library.

h2c by prior knowledge, or TLS with ALPN ``h2`` for https URLs. Outbound header validation is off
(we build every header ourselves, and the constant ones once per connection; a caller's extra
headers were checked once by ``codec.caller_headers``); inbound validation stays on. Receive
windows are large and acknowledged as data is consumed, so thousands of streams and large bodies
flow without stalls; request bodies larger than the peer's window are paced by its
WINDOW_UPDATEs. A request is one ``transport.write``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import h2.config
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from serving.wire.h2base import H2State
from serving.wire.hpackenc import LiteralEncoder
from zerolayer.client.codec import MAX_ERROR_BODY_BYTES
from zerolayer.client.stream import Response

RECV_WINDOW = 1 << 24
DEFAULT_MAX_STREAMS = 100

Header = tuple[bytes, bytes]


class _Collect:
    """A sink that gathers a small whole response (``/health``) into memory, up to
    MAX_ERROR_BODY_BYTES (a longer one is cut, and fails to parse)."""

    __slots__ = ("body", "future", "status")

    def __init__(self, future: asyncio.Future[tuple[int, bytes]]) -> None:
        self.future = future
        self.status = 0
        self.body = bytearray()

    def on_response(self, status: int, headers: list[Header]) -> None:
        self.status = status

    def on_data(self, data: bytes) -> None:
        room = MAX_ERROR_BODY_BYTES - len(self.body)
        if room > 0:
            self.body += data[:room]

    def on_end(self) -> None:
        if not self.future.done():
            self.future.set_result((self.status, bytes(self.body)))

    def on_reset(self, error_code: int) -> None:
        self.on_lost(f"stream reset ({error_code})")

    def on_lost(self, reason: str) -> None:
        if not self.future.done():
            self.future.set_exception(ConnectionError(reason))


class H2Connection(asyncio.Protocol):
    """The client end of one HTTP/2 connection; ``request`` starts a stream feeding a sink."""

    def __init__(
        self, authority: str, scheme: str, on_lost: Callable[[], object] | None = None
    ) -> None:
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=True,
        )
        self._conn = H2State(config=config)
        self._conn.encoder = LiteralEncoder()  # type: ignore[assignment]
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, Response | _Collect] = {}
        self._pumps: dict[int, memoryview] = {}
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._max_streams = DEFAULT_MAX_STREAMS
        self._on_lost = on_lost
        self.closed = False
        self.goaway = False
        a, s = authority.encode(), scheme.encode()
        self._prefix = {
            path: [
                (b":method", b"POST"),
                (b":scheme", s),
                (b":authority", a),
                (b":path", path),
                (b"content-type", b"application/json"),
                (b"accept", b"text/event-stream"),
            ]
            for path in (b"/v1/completions", b"/v1/chat/completions")
        }
        self._get_prefix = [(b":method", b"GET"), (b":scheme", s), (b":authority", a)]
        self._dispatch: dict[type, Callable[[Any], None]] = {
            h2.events.ResponseReceived: self._on_response,
            h2.events.DataReceived: self._on_data,
            h2.events.StreamEnded: self._on_stream_ended,
            h2.events.StreamReset: self._on_stream_reset,
            h2.events.WindowUpdated: self._on_window,
            h2.events.RemoteSettingsChanged: self._on_settings,
            h2.events.ConnectionTerminated: self._on_goaway,
        }

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        on_lost: Callable[[], object] | None = None,
    ) -> H2Connection:
        """Open the socket (TLS with ALPN ``h2`` when given a context) and send the preface."""
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            lambda: cls(authority, "https" if tls else "http", on_lost),
            host,
            port,
            ssl=tls,
            server_hostname=host if tls else None,
        )
        if tls is not None:
            ssl_obj = proto._transport.get_extra_info("ssl_object") if proto._transport else None
            if ssl_obj is None or ssl_obj.selected_alpn_protocol() != "h2":
                proto.close()
                raise ConnectionError(f"{authority} did not negotiate h2 over TLS")
        return proto

    @property
    def usable(self) -> bool:
        return not self.closed and not self.goaway

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = writer = cast(asyncio.Transport, transport)
        conn = self._conn
        conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: RECV_WINDOW,
            },
        )
        conn.initiate_connection()
        conn.increment_flow_control_window(RECV_WINDOW - 65535)
        writer.write(conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        conn = self._conn
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self._fail_all(f"HTTP/2 protocol error: {exc}")
            if self._transport is not None:
                self._transport.write(conn.data_to_send())
                self._transport.close()
            return
        dispatch = self._dispatch
        for event in events:
            handler = dispatch.get(type(event))
            if handler is not None:
                handler(event)
        out = conn.data_to_send()
        if out and self._transport is not None:
            self._transport.write(out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(f"connection lost: {exc or 'closed by the replica'}")

    def _fail_all(self, reason: str) -> None:
        was_closed = self.closed
        self.closed = True
        streams, self._streams = self._streams, {}
        self._pumps.clear()
        for sink in streams.values():
            sink.on_lost(reason)
        self._wake_slots()
        if not was_closed:
            self._report_lost()

    # events

    def _on_response(self, event: h2.events.ResponseReceived) -> None:
        sink = self._streams.get(event.stream_id)
        if sink is not None:
            status = 0
            for name, value in event.headers:
                if name == b":status":
                    status = int(value)
                    break
            sink.on_response(status, event.headers)

    def _on_data(self, event: h2.events.DataReceived) -> None:
        sink = self._streams.get(event.stream_id)
        if sink is not None:
            sink.on_data(event.data)
        self._conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    def _on_stream_ended(self, event: h2.events.StreamEnded) -> None:
        sink = self._streams.pop(event.stream_id, None)
        if sink is not None:
            sink.on_end()
            self._release()
        if self._pumps.pop(event.stream_id, None) is not None:
            self._reset(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)

    def _on_stream_reset(self, event: h2.events.StreamReset) -> None:
        self._pumps.pop(event.stream_id, None)
        sink = self._streams.pop(event.stream_id, None)
        if sink is not None:
            sink.on_reset(event.error_code)
            self._release()

    def _on_window(self, event: h2.events.WindowUpdated) -> None:
        if self._pumps:
            self._pump()

    def _on_settings(self, event: h2.events.RemoteSettingsChanged) -> None:
        changed = event.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
        if changed is not None:
            self._max_streams = changed.new_value
            self._wake_slots()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        """Streams above ``last_stream_id`` were not processed (RFC 9113 section 6.8): they end
        as lost before any answer, so they are retried elsewhere. A PROTOCOL_ERROR whose
        ``last_stream_id`` is a request of ours still unanswered (the last stream the replica
        opened, so the one it was reading when it gave up) blames that request: it fails as the
        caller's ``bad_request`` and the replica is not marked down for it."""
        self.goaway = True
        last = event.last_stream_id or 0
        for sid in [s for s in self._streams if s > last]:
            self._pumps.pop(sid, None)
            self._streams.pop(sid).on_lost("replica sent GOAWAY before processing the stream")
        if event.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR and self._blames(last):
            self._pumps.pop(last, None)
            self._streams.pop(last).on_reset(h2.errors.ErrorCodes.PROTOCOL_ERROR)
            self._on_lost = None
        self._wake_slots()
        self._report_lost()

    def _blames(self, stream_id: int) -> bool:
        """Whether ``stream_id`` is one of our requests still waiting for its answer."""
        sink = self._streams.get(stream_id)
        return sink is not None and sink.status == 0

    def _report_lost(self) -> None:
        """Tell the replica's health the connection is gone (once)."""
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost()

    # streams

    def _release(self) -> None:
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_slots(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def _slot(self) -> None:
        """Wait while the peer's MAX_CONCURRENT_STREAMS is reached."""
        loop = asyncio.get_running_loop()
        while len(self._streams) >= self._max_streams and self.usable:
            waiter = loop.create_future()
            self._slot_waiters.append(waiter)
            await waiter

    def _reset(self, stream_id: int, code: h2.errors.ErrorCodes) -> None:
        try:
            self._conn.reset_stream(stream_id, code)
        except h2.exceptions.StreamClosedError:
            return
        if self._transport is not None:
            self._transport.write(self._conn.data_to_send())

    def cancel(self, stream_id: int) -> None:
        """Stop a stream we no longer want (RST_STREAM CANCEL); its sink hears no more."""
        self._pumps.pop(stream_id, None)
        if self._streams.pop(stream_id, None) is not None:
            self._release()
        if not self.closed:
            self._reset(stream_id, h2.errors.ErrorCodes.CANCEL)

    @property
    def has_slot(self) -> bool:
        """Whether a new stream may open now (the peer's MAX_CONCURRENT_STREAMS not reached)."""
        return len(self._streams) < self._max_streams

    async def request(self, path: bytes, headers: list[Header], body: bytes, sink: Response) -> int:
        """Wait for a stream slot when the peer's limit is reached, then :meth:`start`."""
        if len(self._streams) >= self._max_streams:
            await self._slot()
            if sink.done:  # it timed out while waiting: nothing to send
                return 0
        return self.start(path, headers, body, sink)

    def start(self, path: bytes, headers: list[Header], body: bytes, sink: Response) -> int:
        """Start a POST stream now: headers and as much body as the windows allow, in one write.

        Synchronous, so a caller with a free slot (``has_slot``) needs no task to send.
        """
        if not self.usable:
            sink.on_lost("connection closed")
            return 0
        conn = self._conn
        try:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, self._prefix[path] + headers, end_stream=False)
        except h2.exceptions.ProtocolError as exc:
            # The connection is closing under us (GOAWAY, stream ids spent): nothing was sent.
            self.goaway = True
            sink.on_lost(f"cannot open a stream: {exc!r}")
            return 0
        self._streams[sid] = sink
        sink.attach(self, sid)
        size = len(body)
        if size <= conn.max_outbound_frame_size and size <= conn.local_flow_control_window(sid):
            conn.send_data(sid, body, end_stream=True)
        else:
            self._pumps[sid] = memoryview(body)
            self._pump_one(sid)
        assert self._transport is not None
        self._transport.write(conn.data_to_send())
        return sid

    def _pump_one(self, sid: int) -> None:
        """Send as much of a stream's pending body as the windows allow."""
        view = self._pumps[sid]
        conn = self._conn
        frame = conn.max_outbound_frame_size
        try:
            window = conn.local_flow_control_window(sid)
            while view and window > 0:
                n = min(len(view), window, frame)
                conn.send_data(sid, view[:n].tobytes(), end_stream=n == len(view))
                view = view[n:]
                window -= n
        except (h2.exceptions.StreamClosedError, h2.exceptions.FlowControlError):
            self._pumps.pop(sid, None)
            return
        if view:
            self._pumps[sid] = view
        else:
            del self._pumps[sid]

    def _pump(self) -> None:
        for sid in list(self._pumps):
            self._pump_one(sid)

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """A small GET (``/health``) on this connection: (status, body)."""
        if not self.usable:
            raise ConnectionError("connection closed")
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        conn = self._conn
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [*self._get_prefix, (b":path", path.encode())], end_stream=True)
        self._streams[sid] = _Collect(future)
        assert self._transport is not None
        self._transport.write(conn.data_to_send())
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self.cancel(sid)
            raise

    def close(self) -> None:
        """Send GOAWAY and close; live streams end as lost."""
        if self._transport is not None and not self.closed:
            self.closed = True
            try:
                self._conn.close_connection()
                self._transport.write(self._conn.data_to_send())
            except h2.exceptions.ProtocolError:
                pass
            self._transport.close()
