"""Every bound the replica puts on what a client can make it hold or do: one config, one table.

With no gateway in front of the replicas, each one absorbs what a proxy (Envoy, nginx) would have:
hostile or broken clients included. Each field below is a limit, its default, and the precedent
it follows; ``zl-replica --limit NAME=VALUE`` (repeatable) overrides one (0 turns a timeout, a
``*_s`` limit, off), and
``docs/limits.md`` is the same table for readers (a test keeps the two in step).

A limit a client trips is answered at the smallest scope that contains the fault: one stream
(RST_STREAM, or a 4xx with ``zl-error``), then one connection (GOAWAY ENHANCE_YOUR_CALM, or a
close), never the replica.
"""

from __future__ import annotations

import dataclasses
import math
import resource
from dataclasses import dataclass, field
from typing import Any, Final

FD_HEADROOM: Final = 64
WRITE_BUFFER_SHARE: Final = 4


def _limit(default: Any, doc: str, precedent: str) -> Any:
    return field(default=default, metadata={"doc": doc, "precedent": precedent})


@dataclass(frozen=True, slots=True)
class Limits:
    """The replica's limits (see the module docstring); every field is documented in metadata."""

    # -- HTTP/2 settings it advertises ----------------------------------------------------------
    max_concurrent_streams: int = _limit(
        1024,
        "HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; a stream past it gets RST_STREAM(REFUSED_STREAM)."
        " Above the edge proxies' 100-250 because the SDK multiplexes every caller of a client "
        "onto one connection per replica",
        "nginx http2_max_concurrent_streams 128; Go http2 250; h2o 100",
    )
    max_frame_size: int = _limit(
        16_384,
        "HTTP/2 SETTINGS_MAX_FRAME_SIZE the replica accepts (the RFC 9113 minimum and default)",
        "RFC 9113 6.5.2 default; Go, h2o and nginx advertise 16 KiB",
    )
    max_header_list_size: int = _limit(
        64 << 10,
        "bytes of one request's header block (HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE, HTTP/1.1 "
        "request line and headers); larger: 431, or the stream reset",
        "Envoy max_request_headers_kb 60; nginx large_client_header_buffers 4 x 8k",
    )
    stream_window: int = _limit(
        65_535,
        "HTTP/2 initial stream receive window before a request is admitted",
        "RFC 9113 6.9.2 default",
    )
    # -- memory a connection may hold -------------------------------------------------------------
    connection_buffer_bytes: int = _limit(
        16 << 20,
        "bytes one connection may hold in request bodies in progress and response data its "
        "client has not read: a body that would pass it is refused (503 overloaded), a stream "
        "that would stops pulling tokens (or, finished, is reset); the socket's own buffer "
        "pauses reading at a quarter of it",
        "Envoy per_connection_buffer_limit_bytes (1 MiB) and overload manager",
    )
    stream_send_buffer_bytes: int = _limit(
        256 << 10,
        "response bytes one stream may buffer for a client that does not read; past it the "
        "replica stops pulling tokens from the engine for that stream",
        "hypercorn's bounded stream buffer; Envoy per-stream buffer limits",
    )
    # -- timeouts ---------------------------------------------------------------------------------
    header_timeout_s: float = _limit(
        10.0,
        "seconds from a connection's start (or a later request's first byte) to the end of its "
        "request headers; in clear text it also bounds the bytes that choose HTTP/1.1 or h2c",
        "nginx client_header_timeout 60s; Go http.Server ReadHeaderTimeout",
    )
    body_timeout_s: float = _limit(
        30.0,
        "seconds a request body may go without a byte arriving; then 408 (or the stream reset)",
        "nginx client_body_timeout 60s (between two reads)",
    )
    idle_timeout_s: float = _limit(
        300.0,
        "seconds a connection may stay open with no request in flight; then GOAWAY and close",
        "nginx keepalive_timeout 75s; Envoy idle_timeout 1h",
    )
    handshake_timeout_s: float = _limit(
        10.0,
        "seconds a TLS handshake may take",
        "nginx ssl_handshake_timeout 60s; asyncio ssl_handshake_timeout 60s",
    )
    send_stall_s: float = _limit(
        30.0,
        "seconds a stream whose send buffer is full may go without the client reading; then the "
        "stream is reset and its engine request aborted",
        "nginx send_timeout 60s; Go http2 WriteByteTimeout",
    )
    linger_s: float = _limit(
        2.0,
        "seconds a connection the replica ends for a fault (GOAWAY) keeps reading and discarding "
        "before it closes, so the client reads the GOAWAY instead of a TCP reset",
        "nginx lingering_close: lingering_time 30s, lingering_timeout 5s",
    )
    keepalive_s: float = _limit(
        20.0,
        "HTTP/2 PING interval (an unpredictable payload; no answer within it closes the "
        "connection, one more interval once when the replica's own loop stalled past it); 0: off",
        "gRPC keepalive; Envoy connection_keepalive interval",
    )
    # -- rate budgets per connection (token buckets: a burst, then a rate per second) ---------
    reset_burst: int = _limit(
        1000,
        "client RST_STREAMs a connection may send at once before its rate applies; past the "
        "budget: GOAWAY(ENHANCE_YOUR_CALM) (CVE-2023-44487, rapid reset)",
        "Envoy premature_reset_total_stream_count 500; Go and h2o rapid-reset mitigations",
    )
    reset_rate: float = _limit(
        500.0,
        "client RST_STREAMs per second a connection may sustain",
        "Envoy premature_reset_min_stream_lifetime_seconds 1",
    )
    control_burst: int = _limit(
        100,
        "SETTINGS and PING frames (each counted apart) a connection may send at once; past the "
        "budget: GOAWAY(ENHANCE_YOUR_CALM)",
        "Envoy max_outbound_control_frames 1000; Go maxQueuedControlFrames 10000",
    )
    control_rate: float = _limit(
        10.0,
        "SETTINGS and PING frames per second a connection may sustain",
        "CVE-2019-9512 (ping flood) and CVE-2019-9515 (settings flood) mitigations",
    )
    # -- the replica as a whole --------------------------------------------------------------
    max_connections: int = _limit(
        0,
        "open connections; a new one past it is closed at once and logged. 0: the fd limit "
        "(RLIMIT_NOFILE) less a headroom of 64 for the engine, logs and accounting",
        "nginx worker_connections; Envoy max_active_downstream_connections",
    )
    max_request_id_bytes: int = _limit(
        128,
        "bytes of a client's zl-request-id; longer: 400 bad_request",
        "Envoy x-request-id (a 36-byte UUID); nginx $request_id 32 hex digits",
    )
    max_tenants: int = _limit(
        10_000,
        "tenants whose running totals the replica keeps in memory; the least recently seen "
        "are folded into one 'other' row past it (the accounting file keeps every row)",
        "Prometheus' advice to bound label cardinality",
    )

    def write_high_water(self) -> int:
        """Bytes a connection's socket buffer may hold before the replica stops writing into it
        and reading from it (asyncio's ``pause_writing``): a quarter of
        ``connection_buffer_bytes``; the rest is for bodies in progress and the streams' own
        buffers."""
        return self.connection_buffer_bytes // WRITE_BUFFER_SHARE

    def connection_cap(self) -> int:
        """``max_connections``, or the fd limit less its headroom when that is 0."""
        if self.max_connections > 0:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return 1 << 20
        return max(1, soft - FD_HEADROOM)

    def with_overrides(self, overrides: dict[str, str]) -> Limits:
        """A copy with ``NAME=VALUE`` overrides applied; ValueError naming the field when one is
        unknown or out of range (dashes in NAME become underscores)."""
        known = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for raw_name, raw_value in overrides.items():
            name = raw_name.strip().replace("-", "_")
            spec = known.get(name)
            if spec is None:
                raise ValueError(f"unknown limit {raw_name!r}; known: {', '.join(sorted(known))}")
            changes[name] = _convert(name, spec.type, raw_value)
        return dataclasses.replace(self, **changes)


def _convert(name: str, kind: Any, raw: str) -> int | float:
    number_type = int if kind in (int, "int") else float
    try:
        value = number_type(raw)
    except ValueError:
        expected = "an integer" if number_type is int else "a number"
        raise ValueError(f"limit {name}: expected {expected}, got {raw!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"limit {name}: must be >= 0, got {raw!r}")
    return value


def parse_limit(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` from a command line, as (name, value)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


DEFAULT_LIMITS: Final = Limits()


def table() -> list[tuple[str, Any, str, str]]:
    """(name, default, what it bounds, precedent) for each limit: the docs' table."""
    return [
        (f.name, f.default, f.metadata["doc"], f.metadata["precedent"])
        for f in dataclasses.fields(Limits)
    ]


def markdown_table() -> str:
    """The table in ``docs/limits.md`` (a test keeps the file equal to this)."""
    lines = ["| limit | default | what it bounds | precedent |", "|---|---|---|---|"]
    for name, default, doc, precedent in table():
        lines.append(f"| `{name}` | {default:,} | {doc} | {precedent} |")
    return "\n".join(lines) + "\n"
