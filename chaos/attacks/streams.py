"""Attacks through streams (issue 14 items 2, 3, 4 and 5): clients that do not read, bad streams
beside good ones, more streams than allowed, bodies that never end, ids and tenants without end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final

import h2.exceptions
import h2.settings

from chaos.attacks.context import LONG_DEADLINE, Context, completion, contract_header
from chaos.attacks.h2raw import HANG_S, Header, HostileH2, request_headers
from chaos.attacks.outcome import Observed
from serving.wire import contract

LONG_COMPLETIONS: Final = 200
"""The issue's 200 requests of 65,536 tokens for a client that reads nothing."""
MAX_TOKENS: Final = contract.MAX_OUTPUT_TOKENS
HEALTHY_PER_ROUND: Final = 4
EXCESS_STREAMS: Final = 8
EXCESS_PROBE_MAX: Final = 16_384
"""The most streams the attack opens to exceed what the replica advertises (today's value)."""
UNFINISHED_STREAMS: Final = 100
BODY_BYTES: Final = 4 << 20
"""The issue's 100 streams x 4 MB bodies, each one byte short of done."""
FRAME: Final = 16_384
REQUEST_ID_BYTES: Final = 3_900
REQUESTS_MAX: Final = 100_000
REQUEST_BATCH: Final = 100

# RFC 9113 8.2.2 and 8.1.1: each of these makes a request malformed, a stream error.
MALFORMED: Final[dict[str, Sequence[Header]]] = {
    "uppercase header name": [(b"X-Note", b"a")],
    "connection header": [(b"connection", b"keep-alive")],
    "te: gzip": [(b"te", b"gzip")],
}
LYING_LENGTH: Final = "content-length disagreeing with the body"


def zero_window(ctx: Context) -> Observed:
    """INITIAL_WINDOW_SIZE=0 and long completions: the replica can send nothing, so it must
    stop generating and, after its stall limit, reset the streams and abort the engine work.
    The client answers PINGs (it is alive), it just never opens a window."""
    target = ctx.target
    conn = HostileH2(target.host, target.port, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    try:
        sent = _open_long_completions(conn)
        stop_at = ctx.deadline()
        while time.monotonic() < stop_at and not conn.tally.closed:
            conn.pump(0.1)
        return Observed(conn.tally.describe(f"{sent} long completions at window 0"))
    finally:
        conn.close()


def ping_ack_blind(ctx: Context) -> Observed:
    """Never read, but ACK the keepalive PING blind with the payload the replica used to send
    (``zl-alive``): a keepalive that a non-reading client can fake keeps its buffers alive."""
    target = ctx.target
    conn = HostileH2(target.host, target.port)
    ack = conn.ping_ack(b"zl-alive")
    interval = max(0.05, target.limits.keepalive_s / 2)
    try:
        sent = _open_long_completions(conn)
        stop_at = ctx.deadline()
        while time.monotonic() < stop_at and conn.flush(ack):
            time.sleep(interval)
        return Observed(conn.tally.describe(f"{sent} long completions, never read, PINGs faked"))
    finally:
        conn.close()


def _open_long_completions(conn: HostileH2) -> int:
    body = completion(MAX_TOKENS)
    headers = request_headers(conn.port, extra=[LONG_DEADLINE], body_len=len(body))
    for _ in range(LONG_COMPLETIONS):
        conn.send_request(headers, body)
    conn.flush()
    return LONG_COMPLETIONS


def malformed_stream(ctx: Context) -> Observed:
    """Healthy streams and one malformed stream on the SAME connection, in one write: the bad
    stream alone is reset (RFC 9113 8.1.1); the healthy ones complete."""
    target = ctx.target
    conn = HostileH2(target.host, target.port)
    problems: list[str] = []
    rounds = 0
    stop_at = ctx.deadline()
    variants = [*MALFORMED, LYING_LENGTH]
    try:
        while time.monotonic() < stop_at and not (conn.tally.closed or conn.tally.goaway):
            variant = variants[rounds % len(variants)]
            cut = _malformed_round(conn, variant)
            rounds += 1
            if cut:
                problems.append(f"{variant}: {cut} of {HEALTHY_PER_ROUND} healthy streams cut")
        said = conn.tally.describe(f"{rounds} rounds of {HEALTHY_PER_ROUND} healthy + 1 bad stream")
        return Observed(said, tuple(problems))
    finally:
        conn.close()


def _malformed_round(conn: HostileH2, variant: str) -> int:
    """One round; how many of its healthy streams did not complete with a 200."""
    body = completion(8)
    healthy = request_headers(conn.port, body_len=len(body))
    sids = [conn.send_request(healthy, body) for _ in range(HEALTHY_PER_ROUND)]
    if variant == LYING_LENGTH:
        bad = conn.open_stream(request_headers(conn.port, body_len=len(body) + 100))
    else:
        bad = conn.open_stream(request_headers(conn.port, extra=MALFORMED[variant]))
    conn.h2.send_data(bad, body, end_stream=True)
    conn.flush()
    conn.wait_answered(sids, HANG_S)
    tally = conn.tally
    return sum(1 for s in sids if not (s in tally.ended and tally.responses.get(s) == "200"))


def excess_streams(ctx: Context) -> Observed:
    """More streams than the replica's MAX_CONCURRENT_STREAMS, all open at once (bodies never
    sent): the excess get RST_STREAM(REFUSED_STREAM), the connection lives on.

    The limit is read on a probe connection; the streams are framed before the attack's own
    connection opens and sent with its preface (framing a thousand streams takes seconds of a
    loaded host's CPU, long enough for the keepalive to close a connection that did not read
    meanwhile); the verdict waits for the replica to have read them all (the barrier)."""
    target = ctx.target
    probe = HostileH2(target.host, target.port, read_settings=False)
    try:
        advertised = probe.peek_settings().get(
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS, EXCESS_PROBE_MAX + 1
        )
    finally:
        probe.close()
    if advertised > EXCESS_PROBE_MAX:
        return Observed(
            f"advertises MAX_CONCURRENT_STREAMS {advertised:,}",
            (f"MAX_CONCURRENT_STREAMS {advertised:,} is past {EXCESS_PROBE_MAX:,}",),
        )
    conn = HostileH2(target.host, target.port, connect=False)
    try:
        opened = advertised + EXCESS_STREAMS
        headers = request_headers(target.port, extra=[LONG_DEADLINE], body_len=64)
        for _ in range(opened):
            conn.open_stream(headers)
        conn.connect(read_settings=False)
        conn.barrier()
        conn.pump(0.2)
        tally = conn.tally
        problems = []
        if tally.goaway or tally.closed:
            problems.append("the connection was closed, not the excess streams refused")
        if tally.resets["REFUSED_STREAM"] < EXCESS_STREAMS:
            refused = tally.resets["REFUSED_STREAM"]
            problems.append(f"{refused} of {EXCESS_STREAMS} excess streams got REFUSED_STREAM")
        said = tally.describe(f"{opened:,} streams open at once (limit {advertised:,})")
        return Observed(said, tuple(problems))
    finally:
        conn.close()


def unfinished_bodies(ctx: Context) -> Observed:
    """Many streams each uploading a 4 MB body one byte short of done, with an hour's deadline:
    the per-connection budget and the body timeout must bound what they pin."""
    target = ctx.target
    conn = HostileH2(target.host, target.port)
    headers = request_headers(target.port, extra=[LONG_DEADLINE], body_len=BODY_BYTES)
    sids = [conn.open_stream(headers) for _ in range(UNFINISHED_STREAMS)]
    left = dict.fromkeys(sids, BODY_BYTES - 1)
    uploaded = 0
    chunk = b"x" * FRAME
    stop_at = ctx.deadline()
    try:
        conn.flush()
        while left and time.monotonic() < stop_at and conn.flush():
            conn.pump(0.01)
            for sid in list(left):
                size = _sendable(conn, sid, left[sid])
                if size:
                    conn.h2.send_data(sid, chunk[:size])
                    left[sid] -= size
                    uploaded += size
                if not left[sid] or sid in conn.tally.reset_ids:
                    del left[sid]
        conn.pump(0.2)
        said = conn.tally.describe(f"{uploaded >> 20:,} MiB of bodies never finished")
        return Observed(said)
    finally:
        conn.close()


def _sendable(conn: HostileH2, sid: int, left: int) -> int:
    if sid in conn.tally.reset_ids or sid in conn.tally.ended:
        return 0
    try:
        window = conn.h2.local_flow_control_window(sid)
    except h2.exceptions.ProtocolError:  # the stream is closed in h2's eyes: nothing to send
        return 0
    return max(0, min(window, FRAME, left))


def long_request_ids(ctx: Context) -> Observed:
    """A 3.9 KB ``zl-request-id`` on every request: HPACK indexes it, so it costs the client a
    few bytes a request; the replica must refuse it, not keep it in its accounting ring."""
    request_id = contract_header(contract.REQUEST_ID, "r" * REQUEST_ID_BYTES)
    return _request_stream(ctx, lambda _: [request_id], f"{REQUEST_ID_BYTES:,}-byte request ids")


def many_tenants(ctx: Context) -> Observed:
    """A new ``zl-tenant`` on every request: the replica's per-tenant state must stay bounded
    (``Limits.max_tenants``)."""
    return _request_stream(
        ctx, lambda n: [contract_header(contract.TENANT, f"tenant-{n}")], "distinct tenants"
    )


def _request_stream(ctx: Context, extra: Callable[[int], list[Header]], what: str) -> Observed:
    """Small requests in batches on one connection, each batch answered before the next, until
    the count or time bound."""
    target = ctx.target
    conn = HostileH2(target.host, target.port)
    body = completion(1, stream=False)
    sent = 0
    stop_at = ctx.deadline()
    try:
        while sent < REQUESTS_MAX and time.monotonic() < stop_at and not conn.tally.closed:
            sids = []
            for _ in range(REQUEST_BATCH):
                headers = request_headers(target.port, extra=extra(sent), body_len=len(body))
                sids.append(conn.send_request(headers, body))
                sent += 1
            if not conn.flush():
                break
            conn.wait_answered(sids, HANG_S)
        return Observed(conn.tally.describe(f"{sent:,} requests with {what}"))
    finally:
        conn.close()
