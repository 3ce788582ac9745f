"""One HTTP/2 connection's guard (zerolayer.server.h2guard), alone: its byte budget and its
clocks, driven by a hand-wound clock instead of an event loop."""

from __future__ import annotations

from typing import Any, cast

from tests.support.waiting import HandClock
from zerolayer.server.h2guard import IDLE_CHECKS, PING_PAYLOAD_BYTES, ConnectionGuard
from zerolayer.server.limits import Limits


class Connection:
    """The guarded side: records what the guard's clocks made it do."""

    def __init__(self) -> None:
        self.idle = True
        self.newest_stream = 0
        self.pings: list[bytes] = []
        self.closed = self.went_away = False
        self.flushes = 0

    def ping(self, payload: bytes) -> None:
        self.pings.append(payload)

    def goaway(self) -> None:
        self.went_away = True

    def close(self) -> None:
        self.closed = True

    def flush(self) -> None:
        self.flushes += 1


class Upload:
    """A call reading its body: what the guard reads and does to one."""

    def __init__(self) -> None:
        self.body_len = 0
        self.refused: list[str] = []

    def refuse(self, error: Any, message: str) -> None:
        self.refused.append(error.code)


def guard(limits: Limits) -> tuple[ConnectionGuard, HandClock, Connection]:
    clock, conn = HandClock(), Connection()
    return ConnectionGuard(limits, cast(Any, clock), conn), clock, conn


def test_bodies_and_unread_responses_share_the_byte_budget() -> None:
    g, _, _ = guard(Limits(connection_buffer_bytes=100, keepalive_s=0, idle_timeout_s=0))
    call = cast(Any, Upload())
    g.started_upload(call, 0.0)
    assert g.has_room(60, unsent=40) and not g.has_room(61, unsent=40)
    g.uploaded(call, 60, 0.0)
    call.body_len = 60
    assert not g.over_budget(unsent=40) and g.over_budget(unsent=41)
    g.end_upload(call)
    assert g.upload_bytes == 0 and not g.uploads
    g.end_upload(call)  # a second end counts nothing twice
    assert g.upload_bytes == 0


def test_a_body_that_stops_arriving_is_refused_408_once_its_timeout_passes() -> None:
    limits = Limits(body_timeout_s=5, keepalive_s=0, idle_timeout_s=0)
    g, clock, conn = guard(limits)
    slow, busy = Upload(), Upload()
    g.started_upload(cast(Any, slow), clock.now)
    g.started_upload(cast(Any, busy), clock.now)
    g.watch_uploads()
    clock.advance(3)
    g.uploaded(cast(Any, busy), 10, clock.now)
    clock.advance(2.5)
    assert slow.refused == ["request_timeout"] and not busy.refused
    clock.advance(3)
    assert busy.refused == ["request_timeout"] and not g.uploads and conn.flushes == 2


def test_an_unanswered_keepalive_ping_closes_and_an_answered_one_does_not() -> None:
    g, clock, conn = guard(Limits(keepalive_s=10, idle_timeout_s=0))
    clock.advance(10)
    (payload,) = conn.pings
    assert len(payload) == PING_PAYLOAD_BYTES
    g.ping_acked(b"\0" * PING_PAYLOAD_BYTES)  # a payload the client guessed proves nothing
    g.ping_acked(payload)
    clock.advance(10)
    assert len(conn.pings) == 2 and conn.pings[1] != payload and not conn.closed
    clock.advance(10)
    assert conn.closed


def test_a_ping_answered_while_the_replica_was_too_busy_to_read_does_not_close() -> None:
    """A loop that stalled past the PING's interval (a loaded host, a flood on another
    connection) fires the keepalive before reading the ACK waiting in the socket: the verdict
    waits one more interval of reading, once; a PING still unanswered then closes."""
    g, clock, conn = guard(Limits(keepalive_s=10, idle_timeout_s=0))
    clock.advance(10)
    (payload,) = conn.pings
    clock.now = 35  # the loop was busy from before the ACK came until 15 s past the verdict
    clock.advance(0)
    assert not conn.closed and len(conn.pings) == 1
    g.ping_acked(payload)  # the loop reads again: the ACK was there
    clock.advance(10)
    assert not conn.closed and len(conn.pings) == 2
    clock.now = 60  # stalled again, and this time no ACK comes at all
    clock.advance(0)
    assert not conn.closed
    clock.advance(10)
    assert conn.closed


def test_a_connection_idle_for_its_timeout_goes_away_and_a_busy_one_stays() -> None:
    _, clock, conn = guard(Limits(keepalive_s=0, idle_timeout_s=8))
    step = 8 / IDLE_CHECKS
    conn.idle = False
    clock.advance(8 * 3)
    assert not conn.went_away
    conn.idle = True  # just after a busy check: the whole timeout is still to be proven
    clock.advance(8)
    assert not conn.went_away
    clock.advance(step)  # at most one check late
    assert conn.went_away and conn.closed


def test_a_stopped_guard_fires_no_clock() -> None:
    g, clock, conn = guard(Limits(keepalive_s=1, idle_timeout_s=1, body_timeout_s=1))
    upload = Upload()
    g.started_upload(cast(Any, upload), clock.now)
    g.watch_uploads()
    g.stop()
    clock.advance(100)
    assert not conn.pings and not conn.closed and not upload.refused
