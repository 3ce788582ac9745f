"""Attacks on connections and on HTTP/1.1 (issue 14 items 2, 7 and 11): pipelined requests never
read, slowloris, idle and half-preface connections, CL+TE, a 70 KB header block in one read,
an unknown model name. Raw sockets, so nothing is sent that the attack did not write.
"""

from __future__ import annotations

import contextlib
import http.client
import select
import socket
import time
from collections.abc import Iterator
from typing import Final

import orjson

from chaos.attacks.context import Context, completion
from chaos.attacks.h2raw import HANG_S, HostileH2
from chaos.attacks.outcome import Observed
from serving.wire import contract

PIPELINED_MAX: Final = 250_000
"""Past the issue's 212k pipelined ``GET /metrics``."""
PIPELINE_BATCH: Final = 1000
SEND_TIMEOUT_S: Final = 2.0
"""How long a send may block before the attack takes it that the replica stopped reading: it ends
a send (the pipeline's, a slow byte), it decides no verdict."""
PROBE: Final = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
"""Sent behind a request whose answer must close the connection: answered only if it stayed
open (a close, not an idle timeout, ends the wait)."""
SLOW_CONNECTIONS: Final = 300
"""The issue's 300 slowloris connections (also the bound on idle ones)."""
SLOW_REQUEST: Final = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
IDLE_CONNECTION_CAP: Final = 256
"""``Limits.max_connections`` for the idle attack: below its 300 connections, so the cap (a new
connection past it closed at once) is exercised too."""
HEADER_BLOCK_BYTES: Final = 70_000
UNKNOWN_MODEL: Final = "no-such-model"


def connect(ctx: Context) -> socket.socket:
    sock = socket.create_connection((ctx.target.host, ctx.target.port), timeout=HANG_S)
    sock.settimeout(SEND_TIMEOUT_S)
    return sock


def h1_pipeline(ctx: Context) -> Observed:
    """``GET /metrics`` pipelined without end, responses never read: the replica must stop
    reading while its unsent output is over its bound, not buffer every response."""
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    batch = request * PIPELINE_BATCH
    sent = 0
    outcome = "read them all"
    stop_at = ctx.deadline()
    with contextlib.closing(connect(ctx)) as sock:
        while sent < PIPELINED_MAX and time.monotonic() < stop_at:
            try:
                sock.sendall(batch)
            except TimeoutError:
                outcome = "stopped reading"
                break
            except OSError:
                outcome = "closed the connection"
                break
            sent += PIPELINE_BATCH
    return Observed(f"{outcome} after {sent:,} pipelined GET /metrics never read")


def slowloris(ctx: Context) -> Observed:
    """Many connections each sending a request's headers one byte a second: the header timeout
    must close every one of them."""
    limit = ctx.target.limits.header_timeout_s
    socks = _open(ctx, SLOW_CONNECTIONS)
    open_ = dict.fromkeys(socks, 0)
    # Ends once all are closed (just past `limit`); HANG_S is under the 40 s the slow bytes take
    # to come round to a new request line, which a replica would refuse whatever its timeout.
    stop_at = ctx.deadline(at_least_s=HANG_S)
    try:
        while open_ and time.monotonic() < stop_at:
            for sock in _closed_by_peer(list(open_)):
                del open_[sock]
            for sock, offset in list(open_.items()):
                if not _send_quietly(sock, SLOW_REQUEST[offset % len(SLOW_REQUEST) :][:1]):
                    del open_[sock]
                else:
                    open_[sock] = offset + 1
            time.sleep(min(1.0, max(0.0, stop_at - time.monotonic())))
        for sock in _closed_by_peer(list(open_)):
            del open_[sock]
        return _verdict(len(socks), len(open_), "slow connections (1 byte/s)", limit)
    finally:
        _close_all(socks)


def idle_connections(ctx: Context) -> Observed:
    """Connections that say nothing, that stop halfway through the HTTP/2 preface, and that
    finish the preface but never ask: timeouts must close them all, and past the connection cap
    a new one must be closed at once."""
    limits = ctx.target.limits
    longest = max(limits.header_timeout_s, limits.idle_timeout_s)
    socks = _open(ctx, SLOW_CONNECTIONS)
    for i, sock in enumerate(socks):
        if i % 3 == 1:
            _send_quietly(sock, PREFACE[:16])
    h2_idle = [HostileH2(ctx.target.host, ctx.target.port, read_settings=False) for _ in range(8)]
    stop_at = ctx.deadline(at_least_s=HANG_S)  # ends when all are closed
    open_ = set(socks) | {conn.sock for conn in h2_idle}
    total = len(open_)
    try:
        while open_ and time.monotonic() < stop_at:
            open_ -= set(_closed_by_peer(list(open_), 0.2))
        return _verdict(total, len(open_), "idle, half-preface and preface-only connections",
                        longest)  # fmt: skip
    finally:
        _close_all(socks)
        for conn in h2_idle:
            conn.close()


def _open(ctx: Context, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        try:
            socks.append(connect(ctx))
        except OSError:
            break
    return socks


def _send_quietly(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def _closed_by_peer(socks: list[socket.socket], wait_s: float = 0.0) -> Iterator[socket.socket]:
    """The sockets the replica closed (EOF or reset); whatever it said first is read and
    dropped (a 408, a GOAWAY)."""
    if not socks:
        return
    readable, _, _ = select.select(socks, [], [], wait_s)
    for sock in readable:
        try:
            if not sock.recv(1 << 16):
                yield sock
        except OSError:
            yield sock


def _close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.close()


def _verdict(total: int, still_open: int, what: str, timeout_s: float) -> Observed:
    """Every connection must be closed by the replica's ``timeout_s``: the attack waits for the
    closes, and judges one still open after :data:`HANG_S` (a loaded host makes a timer late,
    not absent) never closed."""
    said = f"closed {total - still_open} of {total} {what}"
    if still_open:
        problem = f"{still_open} still open after {HANG_S:g} s, past a {timeout_s:g} s timeout"
        return Observed(said, (problem,))
    return Observed(said)


def cl_te(ctx: Context) -> Observed:
    """Content-Length and Transfer-Encoding together (request smuggling's shape): whatever the
    answer, the connection must be closed after it (RFC 9112 6.1)."""
    body = completion(4, stream=False)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (len(body), chunked)
    )
    status, closed = _one_request(ctx, request)
    said = f"answered {status} and {'closed' if closed else 'kept'} the connection"
    if not closed:
        return Observed(said, ("a CL+TE request left the connection open (RFC 9112 6.1)",))
    return Observed(said)


def header_block_70k(ctx: Context) -> Observed:
    """A 70 KB header block arriving in one read: past the 64 KiB limit however it arrives."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\n\r\n" % (b"a" * HEADER_BLOCK_BYTES)
    status, _ = _one_request(ctx, request)
    said = f"answered {status} to a {HEADER_BLOCK_BYTES:,}-byte header block"
    if status.startswith("2"):
        limit = ctx.target.limits.max_header_list_size
        return Observed(said, (f"served a header block past max_header_list_size {limit:,}",))
    return Observed(said)


def _one_request(ctx: Context, request: bytes) -> tuple[str, bool]:
    """Send ``request`` in one write; (the response's status and ``zl-error``, whether the
    replica closed the connection after it). Once the response's head is in, :data:`PROBE`
    follows it: the wait ends when the connection closes or the probe is answered (it stayed
    open), whichever the replica does, however late; :data:`HANG_S` only guards a hang."""
    received = b""
    answered_at = 0  # where the probe's answer starts, once the response's length is known
    with contextlib.closing(connect(ctx)) as sock:
        _send_quietly(sock, request)
        give_up_at = time.monotonic() + HANG_S
        while time.monotonic() < give_up_at:
            if not select.select([sock], [], [], max(0.0, give_up_at - time.monotonic()))[0]:
                break
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                return _status(received), True
            received += data
            if not answered_at and b"\r\n\r\n" in received:
                answered_at = _response_end(received)
                _send_quietly(sock, PROBE)
            if answered_at and len(received) > answered_at:
                return _status(received), False
    return _status(received), False


def _response_end(response: bytes) -> int:
    """Where a response with a complete head ends (its ``content-length``; without one, past
    anything that can arrive, so only a close ends the wait)."""
    head, _, _ = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(head) + 4 + int(value)
    return 1 << 62


def _status(response: bytes) -> str:
    """``"431 headers_too_large"`` from a response's head (RFC 9112 4: the status line, then
    header fields); ``"no answer"`` when nothing came."""
    head = response.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    status_line = head[0].split(b" ")
    if len(status_line) < 2:
        return "no answer"
    error = next(
        (
            line.split(b":", 1)[1].strip()
            for line in head[1:]
            if line.lower().startswith(b"zl-error:")
        ),
        b"",
    )
    return f"{status_line[1].decode()} {error.decode()}".strip()


def unknown_model(ctx: Context) -> Observed:
    """A model name the replica does not serve: refused with ``model_not_found``, not echoed."""
    conn = http.client.HTTPConnection(ctx.target.host, ctx.target.port, timeout=HANG_S)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            completion(4, stream=False, model=UNKNOWN_MODEL),
            {"content-type": "application/json"},
        )
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    error = response.getheader("zl-error") or ""
    said = f"answered {response.status} {error}".strip() + f" to model {UNKNOWN_MODEL!r}"
    if error != contract.MODEL_NOT_FOUND.code:
        echoed = UNKNOWN_MODEL in str(orjson.loads(body)) if body.startswith(b"{") else False
        return Observed(said, (f"not refused with model_not_found (echoed: {echoed})",))
    return Observed(said)
