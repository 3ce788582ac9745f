"""A hostile HTTP/2 client: the sans-IO ``h2`` library over a blocking socket, with no manners.

It sends what an attacker would (resets right behind their HEADERS, raw frames ``h2`` would never
produce, headers no validator would pass) and reports what the replica answered: GOAWAY and its
code, RST_STREAM codes, response statuses with their ``zl-error``, and whether the replica
stopped reading (a send that cannot finish) or closed the connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import ContinuationFrame, Frame, HeadersFrame, PingFrame, SettingsFrame

SEND_TIMEOUT_S: Final = 2.0
"""How long a send may block before the attack takes it that the replica stopped reading: it
only ends an attack that is judged on other things (memory, ``active``); an attack judged on
what the replica answers to all it sent uses :data:`HANG_S` instead."""
READ_CHUNK: Final = 1 << 16
BARRIER_PING: Final = b"zlbr"  # and 4 bytes of a count: PING carries 8 (RFC 9113 6.7)
HANG_S: Final = 20.0
"""How long the attacker waits for what the replica owes it (a connection accepted, its SETTINGS,
the ACK of a barrier's PING after a few MiB of frames, a stream's answer, a close) before it
judges without it: a guard against a hang, sized for a loaded host, not a figure any replica is
held to; every such wait ends on its event first."""
Header = tuple[bytes, bytes]

CONFIG: Final = h2.config.H2Configuration(
    client_side=True,
    header_encoding=None,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
    validate_inbound_headers=False,
)


def request_headers(
    port: int,
    path: bytes = b"/v1/completions",
    method: bytes = b"POST",
    extra: Iterable[Header] = (),
    body_len: int | None = None,
) -> list[Header]:
    """A request's header block: pseudo-headers, then ``content-length`` and ``extra``."""
    headers = [
        (b":method", method),
        (b":path", path),
        (b":scheme", b"http"),
        (b":authority", f"127.0.0.1:{port}".encode()),
    ]
    if body_len is not None:
        headers.append((b"content-length", str(body_len).encode()))
    return [*headers, *extra]


@dataclass
class Tally:
    """What the replica answered on one connection."""

    goaway: str = ""
    resets: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    responses: dict[int, str] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)
    reset_ids: set[int] = field(default_factory=set)
    closed: bool = False
    send_blocked: bool = False
    pings_acked: set[bytes] = field(default_factory=set)

    def describe(self, sent: str) -> str:
        """The replica's answer in words, after ``sent`` (what the attacker did)."""
        parts = []
        if self.goaway:
            parts.append(f"GOAWAY {self.goaway} after {sent}")
        elif self.closed:
            parts.append(f"closed the connection after {sent}")
        elif self.send_blocked:
            parts.append(f"stopped reading after {sent}")
        else:
            parts.append(f"kept the connection after {sent}")
        parts += [f"{count:,} x {status}" for status, count in self.statuses.most_common(3)]
        parts += [f"{count:,} x RST_STREAM {code}" for code, count in self.resets.most_common(2)]
        return ", ".join(parts)


class HostileH2:
    """One HTTP/2 connection to the replica, driven by the attack."""

    def __init__(
        self,
        host: str,
        port: int,
        settings: dict[int, int] | None = None,
        *,
        read_settings: bool = True,
        connect: bool = True,
        send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.port = port
        self.send_timeout_s = send_timeout_s
        self.sock: socket.socket
        self.h2 = h2.connection.H2Connection(config=CONFIG)
        self.h2.initiate_connection()
        if settings:
            self.h2.update_settings(settings)
        self.tally = Tally()
        self.sent_streams = 0
        self._unfed = b""
        self.settings_seen = False
        if connect:
            self.connect(read_settings=read_settings)

    def connect(self, *, read_settings: bool = True) -> None:
        """Open the socket and send what h2 has framed (``connect=False`` left it unopened):
        streams queued before it cost the attacker's CPU before the replica's clocks start
        (keepalive, body timeout), not while they run, however slow a loaded host makes that."""
        self.sock = socket.create_connection((self.host, self.port), timeout=HANG_S)
        self.sock.settimeout(self.send_timeout_s)
        self.flush()
        if read_settings:
            self.read_until(lambda: self.settings_seen, HANG_S)

    # -- sending --------------------------------------------------------------------------------

    def flush(self, extra: bytes = b"") -> bool:
        """Write what h2 has framed (and ``extra``); False once the replica stops reading or the
        connection is gone."""
        data = self.h2.data_to_send() + extra
        if not data or self.tally.closed:
            return not self.tally.closed
        try:
            self.sock.sendall(data)
        except TimeoutError:
            self.tally.send_blocked = True
            return False
        except OSError:
            self.tally.closed = True
            return False
        return True

    def open_stream(self, headers: Sequence[Header], end_stream: bool = False) -> int:
        """Queue a new stream's HEADERS (sent at the next flush); returns its id."""
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, list(headers), end_stream=end_stream)
        self.sent_streams += 1
        return sid

    def send_request(self, headers: Sequence[Header], body: bytes) -> int:
        """Queue a new stream's HEADERS and its whole body (sent at the next flush); returns
        its id."""
        sid = self.open_stream(headers)
        self.h2.send_data(sid, body, end_stream=True)
        return sid

    def raw_headers(self, sid: int, headers: Sequence[Header], end_headers: bool = True) -> bytes:
        """A HEADERS frame encoded with the connection's own HPACK encoder (so the replica's
        decoder stays in step), for streams ``h2`` would refuse to open (past the replica's
        MAX_CONCURRENT_STREAMS)."""
        frame = HeadersFrame(sid)
        frame.data = self.h2.encoder.encode(list(headers))
        if end_headers:
            frame.flags.add("END_HEADERS")
        return frame.serialize()

    @staticmethod
    def continuation(sid: int, payload: bytes) -> bytes:
        frame = ContinuationFrame(sid)
        frame.data = payload
        return frame.serialize()

    @staticmethod
    def ping_ack(payload: bytes) -> bytes:
        """A PING ACK sent blind, without reading the PING it pretends to answer."""
        frame = PingFrame(0)
        frame.flags.add("ACK")
        frame.opaque_data = payload
        return frame.serialize()

    # -- reading --------------------------------------------------------------------------------

    def peek_settings(self, timeout_s: float = HANG_S) -> dict[int, int]:
        """The replica's first SETTINGS, read without feeding them to h2 (they are fed at the
        next :meth:`pump`), so h2 does not yet hold this client to the replica's limits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            header_size = 9
            if len(self._unfed) >= header_size:
                frame, length = Frame.parse_frame_header(memoryview(self._unfed[:header_size]))
                if len(self._unfed) >= header_size + length:
                    frame.parse_body(memoryview(self._unfed[header_size : header_size + length]))
                    if isinstance(frame, SettingsFrame):
                        return dict(frame.settings)
                    return {}
            readable, _, _ = select.select([self.sock], [], [], 0.1)
            if readable:
                data = self.sock.recv(READ_CHUNK)
                if not data:
                    break
                self._unfed += data
        return {}

    def pump(self, wait_s: float = 0.0) -> list[h2.events.Event]:
        """Read what has arrived (waiting up to ``wait_s`` for the first bytes), feed h2, and
        tally the replica's answers."""
        events: list[h2.events.Event] = []
        if self._unfed:
            events += self._feed(self._unfed)
            self._unfed = b""
        deadline = time.monotonic() + wait_s
        while not self.tally.closed:
            remaining = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.sock], [], [], remaining)
            if not readable:
                break
            try:
                data = self.sock.recv(READ_CHUNK)
            except (TimeoutError, BlockingIOError):
                break
            except OSError:
                self.tally.closed = True
                break
            if not data:
                self.tally.closed = True
                break
            events += self._feed(data)
            deadline = 0.0  # after the first read, take only what is already there
        self.flush()
        return events

    def read_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Pump until ``done()`` is true, the connection closes, or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not done() and not self.tally.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.pump(min(remaining, 0.1))

    def barrier(self, timeout_s: float = HANG_S) -> bool:
        """Send a PING of our own and read until its ACK. The replica reads a connection's
        frames in order (RFC 9113 section 5.1: frames of a connection are processed in the
        order received), so its ACK means it has read everything sent before the PING; what it
        said about those frames (a GOAWAY) comes with the ACK or just after it (section 6.7
        lets the ACK go first), which a short pump after this reads. A loaded host makes the
        replica read late, not less: this waits for it rather than judge what it has not read
        yet. False when no ACK came (the connection ended, a send timed out partway through a
        frame, or ``timeout_s`` passed)."""
        if self.tally.goaway or self.tally.closed or self.tally.send_blocked:
            return False
        payload = BARRIER_PING + (self.sent_streams % 2**32).to_bytes(4, "big")
        self.h2.ping(payload)
        if not self.flush():
            return False
        self.read_until(lambda: payload in self.tally.pings_acked, timeout_s)
        return payload in self.tally.pings_acked

    def wait_answered(self, sids: Sequence[int], timeout_s: float) -> None:
        """Pump until every one of ``sids`` has ended or been reset (or ``timeout_s``)."""
        tally = self.tally
        self.read_until(
            lambda: all(s in tally.ended or s in tally.reset_ids for s in sids), timeout_s
        )

    def _feed(self, data: bytes) -> list[h2.events.Event]:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.tally.closed = True
            return []
        tally = self.tally
        for event in events:
            if isinstance(event, h2.events.ConnectionTerminated):
                tally.goaway = _code_name(event.error_code)
            elif isinstance(event, h2.events.StreamReset):
                tally.resets[_code_name(event.error_code)] += 1
                tally.reset_ids.add(event.stream_id)
            elif isinstance(event, h2.events.ResponseReceived):
                status = _status(event.headers)
                tally.statuses[status] += 1
                tally.responses[event.stream_id] = status
            elif isinstance(event, h2.events.StreamEnded):
                tally.ended.add(event.stream_id)
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self.settings_seen = True
            elif isinstance(event, h2.events.PingAckReceived):
                tally.pings_acked.add(event.ping_data)
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        return events

    def close(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: never connected
            self.sock.close()


def _code_name(code: int | None) -> str:
    if code is None:
        return "?"
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return str(code)


def _status(headers: Sequence[Header]) -> str:
    fields = dict(headers)
    status = fields.get(b":status", b"?").decode()
    error = fields.get(b"zl-error", b"").decode()
    return f"{status} {error}".strip()
