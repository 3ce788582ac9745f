"""CPU cost of the client SDK's per-request and per-chunk work, without sockets.

These are the parts of the zero-layer path's added latency that the SDK controls: encoding a
request (contract headers, body, HPACK) and parsing a streamed chunk. Compare them with the
round trip that ``zl-bench overhead`` measures.
"""

from __future__ import annotations

import itertools

import orjson
from hpack import Encoder

from serving.wire.hpackenc import LiteralEncoder
from zerolayer.client.codec import prepare
from zerolayer.client.ring import HashRing
from zerolayer.client.stream import Response
from zerolayer.client.timing import Timing

PROMPT = "x" * 1024
PREFIX = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":authority", b"127.0.0.1:8000"),
    (b":path", b"/v1/completions"),
    (b"content-type", b"application/json"),
]


def _requests(n: int = 2048) -> list[list[tuple[bytes, bytes]]]:
    return [
        PREFIX
        + prepare(prompt=PROMPT, max_tokens=128, request_id=f"r{i}", session=f"s{i % 512}").headers
        for i in range(n)
    ]


def test_prepare_request(benchmark) -> None:
    ids = itertools.count()
    req = benchmark(
        lambda: prepare(prompt=PROMPT, max_tokens=128, request_id=f"r{next(ids)}", session="s1")
    )
    assert req.body.startswith(b'{"prompt"')


def test_hpack_literal_encoder(benchmark) -> None:
    blocks = itertools.cycle(_requests())
    encoder = LiteralEncoder()
    out = benchmark(lambda: encoder.encode(next(blocks)))
    assert out


def test_hpack_library_encoder_for_comparison(benchmark) -> None:
    blocks = itertools.cycle(_requests())
    encoder = Encoder()
    out = benchmark(lambda: encoder.encode(next(blocks)))
    assert out


def test_parse_one_stream_of_16_chunks(benchmark) -> None:
    events = [
        b"data: "
        + orjson.dumps(
            {"id": "c", "choices": [{"index": 0, "text": " kalo", "finish_reason": None}]}
        )
        + b"\n\n"
        for _ in range(16)
    ]

    def one() -> Response:
        resp = Response(Timing(), chat=False)
        resp.on_response(200, [])
        for event in events:
            resp.on_data(event)
        resp.on_end()
        return resp

    resp = benchmark(one)
    assert len(resp.chunks) == 16


def test_ring_failover_order(benchmark) -> None:
    ring = HashRing([f"http://127.0.0.1:{8000 + i}" for i in range(8)])
    keys = itertools.cycle([f"s{i}" for i in range(4096)])
    first = benchmark(lambda: next(ring.preference(next(keys))))
    assert first in ring
