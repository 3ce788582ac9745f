"""The replica's token path in one process, its CPU per token against a bare h2 echo's.

``nox -s perf`` holds the replica to it (``benchmarks/test_perf.py``): a change that makes the
replica spend more CPU per streamed token fails, whatever the machine, because the figure is a
ratio to a reference measured in the same run on the same core: the bare h2 echo server
(``bench.overhead.echo``), the floor of HTTP/2 in pure Python, answering the same requests.

Each path is a server behind a transport that only collects what it is given: a real
``ReplicaProtocol`` (so HTTP/2 or HTTP/1.1 is chosen as for a client) over a real
``ReplicaCore`` and the per-token null engine, or the echo. Requests arrive as bytes encoded once
beforehand (an h2 client whose windows never need an update, or HTTP/1.1 requests), so the
client costs nothing and every CPU microsecond counted is the server's and its event loop's: the
thread's CPU time (``time.thread_time_ns``), which time spent off the core (a busy shared host)
does not inflate. Targets take turns in a balanced order (A B C, C B A, ...), each turn a batch
of requests one at a time (or ``in_flight`` at once), and the ratio of each turn's CPU per token
to the echo's in the same round is the figure, its median over rounds the verdict's input.

``python -m bench.perf`` prints the figures (and runs under a profiler as it is); with
``--write-baseline FILE`` it stores each path's median ratio as the baseline ``nox -s perf``
holds later runs on this machine to (:func:`regressions`: a ratio past the baseline by more than
its tolerance fails).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import h2.config
import h2.connection
import h2.settings
import orjson
import uvloop

from bench.overhead.echo import EchoProtocol
from serving.engine import NullConfig, NullEngine
from serving.wire.hpackenc import LiteralEncoder
from zerolayer.client.codec import prepare
from zerolayer.server.connection import Connections, ReplicaProtocol
from zerolayer.server.core import ReplicaCore
from zerolayer.server.h2proto import server_state
from zerolayer.server.limits import Limits

TOKENS: Final = 32
PROMPT: Final = "x" * 1024
DONE: Final = b"data: [DONE]"
WINDOW: Final = 1 << 30
PREFIX: Final = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":authority", b"127.0.0.1:8000"),
    (b":path", b"/v1/completions"),
    (b"content-type", b"application/json"),
    (b"accept", b"text/event-stream"),
]
H2C: Final = "replica-h2c"
HTTP1: Final = "replica-http1"
ECHO: Final = "h2-echo"
TARGETS: Final = (H2C, HTTP1, ECHO)
PathLike = str | os.PathLike[str]


class Collector:
    """A transport that collects nothing but a count: each response ends with ``[DONE]``, and
    the waiter for that many is woken."""

    def __init__(self) -> None:
        self.done = 0
        self.bytes = 0
        self.wanted = 0
        self.waiter: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        if DONE in data:
            self.done += data.count(DONE)
            if self.done >= self.wanted and self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    def expect(self, count: int) -> asyncio.Future[None]:
        self.wanted = self.done + count
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """Nothing is ever buffered."""

    def is_closing(self) -> bool:
        return False

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        """Nothing is read but what the driver hands over."""

    def resume_reading(self) -> None:
        """Nothing is read but what the driver hands over."""

    def close(self) -> None:
        """The connection lives as long as the driver."""


def h2_requests(count: int) -> tuple[bytes, list[bytes]]:
    """An h2 client's preface (settings with windows that never run out) and ``count``
    requests, each its HEADERS and DATA, encoded once."""
    config = h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False
    )
    conn = h2.connection.H2Connection(config=config)
    conn.encoder = LiteralEncoder()  # type: ignore[assignment]
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW}
    )
    conn.initiate_connection()
    conn.increment_flow_control_window(WINDOW)
    # The replica's own preface (its settings, its connection window) as if it had arrived, so
    # that the requests are encoded for the windows the replica grants.
    conn.receive_data(server_state(Limits()).data_to_send())
    preface = conn.data_to_send()
    out = []
    for i in range(count):
        req = prepare(prompt=PROMPT, max_tokens=TOKENS, request_id=f"p{i}", session=f"s{i % 64}")
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, PREFIX + req.headers)
        conn.send_data(sid, req.body, end_stream=True)
        out.append(conn.data_to_send())
        del conn.streams[sid]  # never to be answered here: not counted against the stream limit
    return preface, out


def h1_requests(count: int) -> list[bytes]:
    """``count`` HTTP/1.1 requests as one client would send them."""
    out = []
    for i in range(count):
        req = prepare(prompt=PROMPT, max_tokens=TOKENS, request_id=f"p{i}", session=f"s{i % 64}")
        head = [b"POST /v1/completions HTTP/1.1", b"host: 127.0.0.1:8000",
                b"content-type: application/json", b"accept: text/event-stream",
                b"content-length: " + str(len(req.body)).encode()]  # fmt: skip
        head += [name + b": " + value for name, value in req.headers]
        out.append(b"\r\n".join(head) + b"\r\n\r\n" + req.body)
    return out


@dataclass
class ServerPath:
    """One server, fed its requests in turn; ``spent`` is its CPU per turn, in ns."""

    name: str
    feed: Callable[[bytes], None]
    transport: Collector
    requests: list[bytes]
    spent: list[tuple[int, int]] = field(default_factory=list)  # (ns, tokens)

    async def turn(self, count: int, in_flight: int) -> None:
        """``count`` requests, ``in_flight`` at a time; the thread's CPU over them recorded."""
        requests = self.requests
        started = time.thread_time_ns()
        for _ in range(count // in_flight):
            waiter = self.transport.expect(in_flight)
            for _ in range(in_flight):
                self.feed(requests.pop())
            await waiter
        self.spent.append(
            (time.thread_time_ns() - started, count // in_flight * in_flight * TOKENS)
        )


def replica_path(
    name: str, preface: bytes | None, requests: list[bytes], per_token: bool = True
) -> ServerPath:
    """A real ``ReplicaProtocol`` over a ``ReplicaCore`` and the per-token null engine."""
    limits = Limits(keepalive_s=0, idle_timeout_s=0, header_timeout_s=0, body_timeout_s=0)
    engine = NullEngine(NullConfig(per_token=per_token))
    replica = ReplicaCore(engine, name="perf", limits=limits)
    transport = Collector()
    protocol = ReplicaProtocol(replica, Connections(replica))
    protocol.connection_made(transport)  # type: ignore[arg-type]
    if preface is not None:
        protocol.data_received(preface)
    return ServerPath(name, protocol.data_received, transport, requests)


def echo_path(preface: bytes, requests: list[bytes], per_token: bool = True) -> ServerPath:
    transport = Collector()
    protocol = EchoProtocol(per_token=per_token, itl_s=0.0)
    protocol.connection_made(transport)  # type: ignore[arg-type]
    protocol.data_received(preface)
    return ServerPath(ECHO, protocol.data_received, transport, requests)


@dataclass(frozen=True)
class Figures:
    """Per target, each round's CPU per token (us), and per round the ratio to the echo's."""

    per_token_us: dict[str, list[float]]
    ratios: dict[str, list[float]]

    def median_ratio(self, target: str) -> float:
        return statistics.median(self.ratios[target])

    def lines(self) -> list[str]:
        out = []
        for name, values in self.per_token_us.items():
            ratio = f", {self.median_ratio(name):.2f}x the echo's" if name in self.ratios else ""
            out.append(f"{name}: {statistics.median(values):.2f} us CPU per token (median of "
                       f"{len(values)} rounds{ratio})")  # fmt: skip
        return out


# How far a path's ratio may rise over its stored baseline before it is a regression: the
# ratio's spread between runs on this two-core host, loaded or not, stays well inside it.
TOLERANCE: Final = 0.25


@dataclass(frozen=True)
class Baseline:
    """Each path's median ratio to the echo when it was stored, and the tolerance on it."""

    ratios: dict[str, float]
    tolerance: float = TOLERANCE
    note: str = ""

    def limit(self, name: str) -> float:
        return self.ratios[name] * (1 + self.tolerance)


def read_baseline(path: PathLike) -> Baseline:
    data = orjson.loads(Path(path).read_bytes())
    return Baseline(dict(data["ratios"]), float(data["tolerance"]), str(data.get("note", "")))


def write_baseline(path: PathLike, figures: Figures, note: str) -> Baseline:
    baseline = Baseline({n: round(figures.median_ratio(n), 3) for n in figures.ratios}, note=note)
    data = {"ratios": baseline.ratios, "tolerance": baseline.tolerance, "note": note}
    Path(path).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    return baseline


def regressions(figures: Figures, baseline: Baseline) -> list[str]:
    """A line for each path whose median ratio to the echo passed its baseline's limit."""
    out = []
    for name in baseline.ratios:
        ratio = figures.median_ratio(name)
        if ratio > baseline.limit(name):
            out.append(
                f"{name}: {ratio:.2f}x the echo's CPU per token, past its limit "
                f"{baseline.limit(name):.2f}x (baseline {baseline.ratios[name]:.2f}x + "
                f"{baseline.tolerance:.0%})"
            )
    return out


def _order(paths: Sequence[ServerPath], round_: int) -> list[ServerPath]:
    return list(paths) if round_ % 2 == 0 else list(paths)[::-1]


def _paths(total: int, names: Sequence[str], per_token: bool) -> list[ServerPath]:
    preface, h2_reqs = h2_requests(total)
    build = {
        H2C: lambda: replica_path(H2C, preface, h2_reqs[::-1], per_token),
        HTTP1: lambda: replica_path(HTTP1, None, h1_requests(total)[::-1], per_token),
        ECHO: lambda: echo_path(preface, h2_requests(total)[1][::-1], per_token),
    }
    return [build[name]() for name in names]


async def measure(
    rounds: int = 7,
    per_round: int = 100,
    in_flight: int = 1,
    warm: int = 50,
    names: Sequence[str] = TARGETS,
    per_token: bool = True,
) -> Figures:
    """The paths measured in ``rounds`` balanced rounds of ``per_round`` requests each (after
    ``warm`` untimed ones), ``in_flight`` at a time; ``per_token`` False: every answer in one
    chunk (the per-request path; its CPU is still given per token of the answer)."""
    total = warm + rounds * per_round
    paths = _paths(total, names, per_token)
    for path in paths:
        await path.turn(warm, in_flight)
        path.spent.clear()
    for round_ in range(rounds):
        for path in _order(paths, round_):
            await path.turn(per_round, in_flight)
    us_per_token = {p.name: [ns / tokens / 1000 for ns, tokens in p.spent] for p in paths}
    echo = us_per_token.get(ECHO)
    ratios = {
        name: [a / b for a, b in zip(values, echo, strict=True)]
        for name, values in us_per_token.items()
        if name != ECHO and echo is not None
    }
    return Figures(us_per_token, ratios)


def run(
    rounds: int = 7,
    per_round: int = 100,
    in_flight: int = 1,
    names: Sequence[str] = TARGETS,
    per_token: bool = True,
) -> Figures:
    return uvloop.run(measure(rounds, per_round, in_flight, names=names, per_token=per_token))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.perf", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--in-flight", type=int, default=1)
    parser.add_argument("--targets", default=",".join(TARGETS), help="to profile one alone")
    parser.add_argument("--write-baseline", type=Path, metavar="FILE", help="store the ratios")
    parser.add_argument(
        "--per-request", action="store_true", help="every answer in one chunk (per_token=false)"
    )
    args = parser.parse_args(argv)
    names = args.targets.split(",")
    figures = run(args.rounds, args.per_round, args.in_flight, names, not args.per_request)
    for line in figures.lines():
        print(line)
    if args.write_baseline is not None:
        note = f"{args.rounds} rounds of {args.per_round} at {args.in_flight} in flight"
        write_baseline(args.write_baseline, figures, note)
        print(f"wrote {args.write_baseline}")


if __name__ == "__main__":
    main()
