"""CPU cost of the replica's per-request work and of HTTP/2 header decoding, without sockets.

``test_replica_request_path`` is one request round trip, in one process, between an h2 client
state machine and a real ``ReplicaCore`` + ``H2Handler`` (null engine) behind a transport that only
collects what it is given: the protocol and application CPU of the zero-layer path without the
sockets (h2 framing both ways, hpack, inbound header validation, admission, the engine call, SSE
framing); compare with ``zl-bench overhead``'s ``cpu us`` + ``srv us``. The decoder pair
shows what ``FastDecoder`` saves over hpack's own on a request's header block.
"""

from __future__ import annotations

import itertools

import h2.config
import h2.connection
import h2.events
import uvloop
from hpack import Decoder

from bench.perf import PREFIX
from serving.engine import make_engine
from serving.wire.hpackdec import FastDecoder
from serving.wire.hpackenc import LiteralEncoder
from zerolayer.client.codec import prepare
from zerolayer.server.core import ReplicaCore
from zerolayer.server.h2proto import H2Handler
from zerolayer.server.limits import Limits


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def get_extra_info(self, name: str) -> None:
        return None

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def take(self) -> bytes:
        data = b"".join(self.out)
        self.out.clear()
        return data


def _client() -> h2.connection.H2Connection:
    config = h2.config.H2Configuration(
        client_side=True, header_encoding=None, validate_outbound_headers=False
    )
    conn = h2.connection.H2Connection(config=config)
    conn.encoder = LiteralEncoder()  # type: ignore[assignment]
    return conn


def _request_block(i: int) -> list[tuple[bytes, bytes]]:
    req = prepare(prompt="x" * 1024, max_tokens=16, request_id=f"r{i}", session=f"s{i % 64}")
    return PREFIX + req.headers


def test_replica_request_path(benchmark) -> None:
    async def main() -> int:
        engine = make_engine("null", per_token=False)  # the per-request path: one chunk
        replica = ReplicaCore(engine, name="bench", limits=Limits(keepalive_s=0))
        transport = _Transport()
        handler = H2Handler(replica, transport)  # type: ignore[arg-type]
        client = _client()
        client.initiate_connection()
        for _ in range(2):
            handler.data_received(client.data_to_send())
            client.receive_data(transport.take())
        ids = itertools.count()

        def one() -> bytes:
            i = next(ids)
            sid = client.get_next_available_stream_id()
            req = prepare(prompt="x" * 1024, max_tokens=16, request_id=f"r{i}", session="s1")
            client.send_headers(sid, PREFIX + req.headers)
            client.send_data(sid, req.body, end_stream=True)
            handler.data_received(client.data_to_send())
            answer = transport.take()
            for event in client.receive_data(answer):
                if isinstance(event, h2.events.DataReceived):
                    client.acknowledge_received_data(event.flow_controlled_length, sid)
            handler.data_received(client.data_to_send())
            return answer

        answer = benchmark(one)
        assert b"[DONE]" in answer  # the null engine answered within the call: no task needed
        return replica.outcomes["completed"]

    assert uvloop.run(main()) > 0


def test_hpack_decode_fast(benchmark) -> None:
    blocks = [LiteralEncoder().encode(_request_block(i)) for i in range(256)]
    decoder = FastDecoder()
    it = itertools.cycle(blocks)
    headers = benchmark(lambda: decoder.decode(next(it), raw=True))
    assert headers[0] == (b":method", b"POST")


def test_hpack_decode_library_for_comparison(benchmark) -> None:
    blocks = [LiteralEncoder().encode(_request_block(i)) for i in range(256)]
    decoder = Decoder()
    it = itertools.cycle(blocks)
    headers = benchmark(lambda: decoder.decode(next(it), raw=True))
    assert headers[0] == (b":method", b"POST")
