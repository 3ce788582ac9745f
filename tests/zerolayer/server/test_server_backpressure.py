"""HTTP/2 outbound backpressure, keepalive and idle timeout in the replica (issue 14, 2 and 7).

A client that reads nothing must not make the replica buffer without bound or keep its engine
generating: a stream's unsent output stops at ``stream_send_buffer_bytes`` and then stops pulling
tokens; a stream that stays there for ``send_stall_s`` is reset and its engine request aborted.
A transport over its high-water mark stops DATA framing and reading. The keepalive PING proves the
client read everything before it; a connection with no stream for ``idle_timeout_s`` is closed.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import h2.config
import h2.connection
import h2.events
import h2.settings
import orjson
from hyperframe.frame import PingFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine import NullConfig, NullEngine
from serving.engine.types import EngineRequest, EngineStats, TokenChunk
from serving.wire.contract import MAX_OUTPUT_TOKENS
from tests.support.server_client import H2Client, run, wait_all
from tests.support.waiting import HandClock
from zerolayer.server import start_replica
from zerolayer.server.core import ReplicaCore
from zerolayer.server.h2guard import ConnectionGuard
from zerolayer.server.h2proto import H2Handler, H2Stream
from zerolayer.server.limits import Limits

CANCEL = 8
NO_ERROR = 0
CHUNK_TOKENS = 64
WORD = "tok "
SEND_BUFFER = 16 << 10
KEEPALIVE_S = 10.0  # on a HandClock: wound by the test, never by the host's pace


class FirehoseEngine:
    """Produces a chunk of CHUNK_TOKENS each time it is pulled, yielding to the loop between
    chunks: as fast as its consumer takes them. Counts what each request pulled."""

    name = "firehose"

    def __init__(self) -> None:
        self.pulled: Counter[str] = Counter()
        self.aborted: set[str] = set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]:
        rid = request.request_id
        done = 0
        while done < request.max_tokens:
            if rid in self.aborted:
                yield TokenChunk([], "", "abort", request.prompt_tokens, done)
                return
            size = min(CHUNK_TOKENS, request.max_tokens - done)
            done += size
            self.pulled[rid] += size
            finish = "length" if done == request.max_tokens else None
            yield TokenChunk([0] * size, WORD * size, finish, request.prompt_tokens, done)
            await asyncio.sleep(0)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(max_num_seqs=1 << 20)

    async def close(self) -> None:
        pass


class MemoryTransport:
    """Keeps what it is given; records the flow-control calls the handler makes on it."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.reading = True
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data

    def get_write_buffer_size(self) -> int:
        return len(self.out)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class Peer:
    """An h2 client state machine wired to one H2Handler through a MemoryTransport."""

    def __init__(
        self, limits: Limits, engine: FirehoseEngine, clock: HandClock | None = None
    ) -> None:
        self.replica = ReplicaCore(engine, name="bp", limits=limits)
        self.transport = MemoryTransport()
        self.handler = H2Handler(self.replica, self.transport)  # type: ignore[arg-type]
        if clock is not None:
            # The connection's clocks on ``clock``: its timers fire when the test winds it, so a
            # stall of the host between a PING and its ACK cannot pass for an unanswered PING.
            self.handler.guard.stop()
            self.handler.guard = ConnectionGuard(limits, cast(Any, clock), self.handler)
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(1 << 30)
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.pings: list[bytes] = []
        self.send()
        self.receive()
        self.send()

    def send(self) -> None:
        """Hand the handler what the client has queued."""
        data = self.conn.data_to_send()
        if data:
            self.handler.data_received(data)

    def receive(self, ack: bool = True) -> list[h2.events.Event]:
        """Read what the handler wrote; acknowledge DATA (WINDOW_UPDATE) when ``ack``."""
        events = self.conn.receive_data(self.transport.take())
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
                if ack:
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.PingReceived):
                self.pings.append(event.ping_data)
        return events

    def completion(self, max_tokens: int) -> int:
        sid = self.conn.get_next_available_stream_id()
        body = orjson.dumps({"prompt": "p", "max_tokens": max_tokens, "stream": True})
        headers = [
            (b":method", b"POST"),
            (b":path", b"/v1/completions"),
            (b":scheme", b"http"),
            (b":authority", b"replica"),
            (b"content-length", str(len(body)).encode()),
        ]
        self.conn.send_headers(sid, headers)
        self.conn.send_data(sid, body, end_stream=True)
        self.send()
        return sid


async def connect_zero_window(port: int) -> H2Client:
    """A client whose streams' receive windows start at 0: it reads nothing until it opens them."""
    return await H2Client.connect("127.0.0.1", port, window=0)


async def settled(engine: FirehoseEngine, quiet: int = 50, steps: int = 5000) -> int:
    """Tokens the engine has been pulled for, once that stopped changing for ``quiet`` loop
    iterations (bounded by ``steps`` iterations in all)."""
    last, still = -1, 0
    for _ in range(steps):
        total = sum(engine.pulled.values())
        still = still + 1 if total == last and total > 0 else 0
        if still >= quiet:
            break
        last = total
        await asyncio.sleep(0)
    return sum(engine.pulled.values())


async def until(condition: Callable[[], object], steps: int = 500, pause: float = 0.01) -> bool:
    """Poll ``condition()`` up to ``steps`` times, ``pause`` seconds apart (bounded in count)."""
    for _ in range(steps):
        if condition():
            return True
        await asyncio.sleep(pause)
    return bool(condition())


# -- 1. the per-stream send buffer is bounded; a stream that does not drain is stalled ----------


@run
async def test_a_client_that_reads_nothing_stops_the_engine_and_is_stalled() -> None:
    engine = FirehoseEngine()
    limits = Limits(stream_send_buffer_bytes=SEND_BUFFER, send_stall_s=0.3, keepalive_s=0)
    async with await start_replica(engine, limits=limits) as replica:
        client = await connect_zero_window(replica.port)
        stream = client.completion("never read", max_tokens=MAX_OUTPUT_TOKENS, stream=True)
        closed = await until(stream.closed.is_set, 300)
        pulled_bytes = sum(engine.pulled.values()) * len(WORD)
        chunk_bytes = CHUNK_TOKENS * len(WORD)
        # Everything pulled went into the stream's buffer (the window is 0), and each chunk's SSE
        # event is longer than its text: only the chunk that crossed the bound may pass it.
        assert pulled_bytes - chunk_bytes < SEND_BUFFER, (pulled_bytes, SEND_BUFFER)
        assert closed, "the stream was never reset"
        assert stream.reset_code == CANCEL
        assert len(stream.data) == 0
        assert engine.aborted == set(engine.pulled)
        assert replica.replica.active == 0
        assert replica.replica.failures["send_stalled"] == 1
        await client.close()


@run
async def test_a_stream_blocked_on_its_window_resumes_when_the_client_reads() -> None:
    engine = FirehoseEngine()
    limits = Limits(stream_send_buffer_bytes=SEND_BUFFER, send_stall_s=30, keepalive_s=0)
    max_tokens = 200 * CHUNK_TOKENS
    async with await start_replica(engine, limits=limits) as replica:
        client = await connect_zero_window(replica.port)
        stream = client.completion("read later", max_tokens=max_tokens, stream=True)
        pulled = await settled(engine)
        assert pulled < max_tokens, "the engine ran to the end for a client that read nothing"
        assert pulled * len(WORD) - CHUNK_TOKENS * len(WORD) < SEND_BUFFER
        client.conn.increment_flow_control_window(1 << 24, stream_id=stream.sid)
        client.flush()
        await wait_all([stream], 5)
        assert stream.reset_code is None
        assert stream.text() == WORD * max_tokens
        assert stream.events()[-2]["usage"]["completion_tokens"] == max_tokens
        assert replica.replica.outcomes["completed"] == 1
        await client.close()


@run
async def test_many_unread_streams_share_the_connection_budget() -> None:
    """Each stream may hold its own bound, but all of a connection's streams together hold at
    most ``connection_buffer_bytes`` (plus the chunk each was writing when it crossed)."""
    engine = FirehoseEngine()
    streams = 24
    budget = 4 * SEND_BUFFER  # a sixth of what 24 streams could hold at their own bound
    limits = Limits(
        stream_send_buffer_bytes=SEND_BUFFER,
        connection_buffer_bytes=budget,
        send_stall_s=30,
        keepalive_s=0,
    )
    async with await start_replica(engine, limits=limits) as replica:
        client = await connect_zero_window(replica.port)
        opened = [
            client.completion(f"s{i}", max_tokens=200 * CHUNK_TOKENS, stream=True)
            for i in range(streams)
        ]
        pulled = await settled(engine)
        chunk_bytes = CHUNK_TOKENS * len(WORD)
        # What was pulled sits in the streams' buffers (nothing was read); each SSE event is
        # longer than its text, so the text pulled bounds the bytes held from below.
        assert pulled * len(WORD) <= budget + streams * 2 * chunk_bytes, (pulled, budget)
        (handler,) = [p.handler for p in replica._protocols]
        assert handler.buffer.unsent <= budget + streams * 2 * (chunk_bytes + 256)
        for stream in opened:
            client.conn.increment_flow_control_window(1 << 24, stream_id=stream.sid)
        client.flush()
        await wait_all(opened, 10)
        assert all(stream.text() == WORD * 200 * CHUNK_TOKENS for stream in opened)
        assert handler.buffer.unsent == 0
        assert replica.replica.active == 0
        await client.close()


# -- 2. a transport over its high-water mark: no more DATA framed, no more reading ---------------


@run
async def test_pause_writing_holds_data_in_bounded_stream_buffers_and_stops_reading() -> None:
    engine = FirehoseEngine()
    limits = Limits(stream_send_buffer_bytes=SEND_BUFFER, send_stall_s=30, keepalive_s=0)
    peer = Peer(limits, engine)
    handler = peer.handler
    max_tokens = 200 * CHUNK_TOKENS
    sid = peer.completion(max_tokens)
    for _ in range(100):
        peer.receive()
        if sid in peer.data:
            break
        await asyncio.sleep(0)
    event_bytes = max(len(event) + 2 for event in peer.data[sid].split(b"\n\n"))
    handler.pause_writing()
    assert not peer.transport.reading
    peer.receive()
    pulled = await settled(engine)
    assert pulled < max_tokens, "the engine ran to the end while the transport was full"
    stream = handler.streams[sid]
    assert stream.pending is not None
    assert len(stream.pending) - event_bytes < SEND_BUFFER, (len(stream.pending), event_bytes)
    assert not any(isinstance(e, h2.events.DataReceived) for e in peer.receive())
    handler.resume_writing()
    assert peer.transport.reading
    for _ in range(2000):
        peer.receive()
        peer.send()
        if sid in peer.ended:
            break
        await asyncio.sleep(0)
    assert sid in peer.ended
    assert peer.replica.outcomes["completed"] == 1
    assert sum(engine.pulled.values()) == max_tokens


# -- 3. keepalive: an unpredictable PING that only counts when its own ACK comes back ------------


@run
async def test_keepalive_pings_are_unpredictable_and_acked_pings_keep_the_connection() -> None:
    clock = HandClock()
    peer = Peer(Limits(keepalive_s=KEEPALIVE_S, idle_timeout_s=0), FirehoseEngine(), clock)
    for count in range(1, 4):
        clock.advance(KEEPALIVE_S)  # closes here if the last PING's ACK did not count
        peer.receive()
        assert len(peer.pings) == count and not peer.transport.closed
        peer.send()  # h2 answers each PING with its own payload
    assert all(len(payload) == 8 for payload in peer.pings)
    assert len(set(peer.pings)) == 3, peer.pings


@run
async def test_an_ack_with_another_payload_does_not_count() -> None:
    clock = HandClock()
    peer = Peer(Limits(keepalive_s=KEEPALIVE_S, idle_timeout_s=0), FirehoseEngine(), clock)
    clock.advance(KEEPALIVE_S)
    peer.receive()
    assert len(peer.pings) == 1
    peer.conn.data_to_send()  # drop h2's own (correct) ACK
    forged = PingFrame(0)
    forged.flags.add("ACK")
    forged.opaque_data = bytes(b ^ 0xFF for b in peer.pings[0])
    peer.handler.data_received(forged.serialize())
    clock.advance(KEEPALIVE_S)
    assert peer.transport.closed
    peer.receive()
    assert len(peer.pings) == 1, "the forged ACK counted: the replica sent another PING"


@run
async def test_a_connection_closed_on_a_client_that_reads_nothing_is_aborted_after_linger() -> None:
    """A close waits for the socket to take what is buffered: for a client that reads nothing
    (its PING unanswered) that would hold the connection and its descriptor for ever."""
    keepalive, linger = 0.2, 0.2
    limits = Limits(keepalive_s=keepalive, linger_s=linger)
    # Whole answers in one chunk each (the per-request null engine), framed in one loop turn.
    whole = NullEngine(NullConfig(per_token=False))
    async with await start_replica(whole, limits=limits) as replica:
        sock = socket.create_connection(("127.0.0.1", replica.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        conn = h2.connection.H2Connection(config)
        conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 30}
        )
        conn.initiate_connection()
        conn.increment_flow_control_window(1 << 30)
        body = orjson.dumps({"prompt": "p", "max_tokens": MAX_OUTPUT_TOKENS})
        for _ in range(32):  # ~10 MB of answers: more than the socket buffers on both sides
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(b":method", b"POST"), (b":path", b"/v1/completions"),
                                    (b":scheme", b"http"), (b":authority", b"r"),
                                    (b"content-length", str(len(body)).encode())])  # fmt: skip
            conn.send_data(sid, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        try:
            assert await until(lambda: replica.replica.outcomes["completed"] == 32)
            # All 32 answers were framed in one loop turn: the socket's buffer still stops near
            # its high-water mark (one frame past it), the rest waits in the streams' buffers.
            (protocol,) = replica._protocols
            assert protocol.transport is not None and isinstance(protocol.handler, H2Handler)
            # Past the mark by at most the DATA frame that crossed it and the frames around it
            # (HEADERS) that the count of DATA framed leaves out.
            frame = protocol.handler.h2.max_outbound_frame_size + 9
            slack = 2 * frame
            assert protocol.transport.get_write_buffer_size() <= limits.write_high_water() + slack
            assert protocol.handler.buffer.unsent <= limits.connection_buffer_bytes
            # Two keepalive intervals close it, then linger_s aborts it: allow ten times that.
            gone = await until(
                lambda: replica.replica.connections == 0, 100, (2 * keepalive + linger) / 10
            )
            assert gone, "a connection whose client reads nothing was never let go"
            assert replica.replica.active == 0
        finally:
            sock.close()


# -- 4. idle timeout: GOAWAY(NO_ERROR) and close after idle_timeout_s with no open stream ---------


@run
async def test_an_idle_connection_is_closed_with_goaway_but_not_while_a_stream_is_open() -> None:
    engine = FirehoseEngine()
    idle = 0.2
    limits = Limits(
        idle_timeout_s=idle, stream_send_buffer_bytes=SEND_BUFFER, send_stall_s=30, keepalive_s=0
    )
    async with await start_replica(engine, limits=limits) as replica:
        client = await connect_zero_window(replica.port)
        stream = client.completion("held open", max_tokens=MAX_OUTPUT_TOKENS, stream=True)
        await asyncio.sleep(3 * idle)  # the stream is open all along: the connection stays
        assert not client.lost.is_set()
        client.reset(stream)
        assert await until(client.lost.is_set, 500)
        assert client.terminated is not None
        assert client.terminated.error_code == NO_ERROR
        assert replica.replica.active == 0
        await client.close()


# -- 5. a finished response that is never read is not held for ever ------------------------------


@run
async def test_a_finished_response_the_client_never_reads_is_reset_after_the_stall_time() -> None:
    """No engine run is left to stall: the handler itself resets the stream and frees it."""
    engine = FirehoseEngine()
    limits = Limits(send_stall_s=0.3, keepalive_s=0)
    async with await start_replica(engine, limits=limits) as replica:
        client = await connect_zero_window(replica.port)
        stream = client.completion("never read", max_tokens=MAX_OUTPUT_TOKENS)
        assert await until(stream.closed.is_set, 300), "the unread response is held for ever"
        assert stream.reset_code == CANCEL
        assert replica.replica.outcomes["completed"] == 1
        (protocol,) = replica._protocols
        assert protocol.idle
        await client.close()


# -- the invariant under any interleaving of writes, window updates, pauses and resumes ----------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(1, 3000)),
        st.tuples(st.just("window"), st.integers(1, 40_000)),
        st.tuples(st.just("pause"), st.just(0)),
        st.tuples(st.just("resume"), st.just(0)),
    ),
    max_size=60,
)
BOUND = 8192
MAX_WRITE = 3000


def open_stream(peer: Peer) -> H2Stream:
    """A stream the client opened, handed to no request handler: the test writes to it as
    core's engine loop would."""
    sid = peer.conn.get_next_available_stream_id()
    headers = [(b":method", b"GET"), (b":path", b"/x"), (b":scheme", b"http"),
               (b":authority", b"replica")]  # fmt: skip
    peer.conn.send_headers(sid, headers, end_stream=True)
    peer.handler.h2.receive_data(peer.conn.data_to_send())
    stream = H2Stream(peer.handler, sid)
    stream.remote_ended = True
    peer.handler.streams[sid] = stream
    stream.start(200, [])
    return stream


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_the_send_buffer_stays_bounded_and_every_byte_arrives_in_order(
    ops: list[tuple[str, int]],
) -> None:
    @run
    async def check() -> None:
        limits = Limits(stream_send_buffer_bytes=BOUND, keepalive_s=0, idle_timeout_s=0)
        peer = Peer(limits, FirehoseEngine())
        handler = peer.handler
        stream = open_stream(peer)
        written = bytearray()
        waiter: asyncio.Future[None] | None = None
        paused = False
        for op, size in ops:
            if op == "write" and (waiter is None or waiter.done()):
                data = bytes([len(written) % 251]) * size
                written += data
                stream.write(data)
                waiter = stream.writable()
            elif op == "window":
                peer.conn.increment_flow_control_window(size, stream_id=stream.sid)
                peer.send()
            elif op == "pause":
                handler.pause_writing()
                paused = True
            elif op == "resume":
                handler.resume_writing()
                paused = False
            handler.flush()
            before = len(peer.data.get(stream.sid, b""))
            peer.receive(ack=False)
            received = bytes(peer.data.get(stream.sid, b""))
            assert not (paused and len(received) > before), "DATA framed while paused"
            assert received == written[: len(received)]
            unsent = len(stream.pending or b"")
            assert unsent < BOUND + MAX_WRITE
            assert len(received) + unsent == len(written)
            if waiter is not None and waiter.done():
                assert unsent < BOUND
        handler.resume_writing()
        peer.conn.increment_flow_control_window(1 << 24, stream_id=stream.sid)
        peer.send()
        handler.flush()
        peer.receive(ack=False)
        assert bytes(peer.data.get(stream.sid, b"")) == written
        assert waiter is None or waiter.done()

    check()


# -- 2, end to end: asyncio's flow control through the real transport ----------------------------


class SilentClient:
    """A raw HTTP/2 client with a small socket receive buffer that sends its requests and then
    reads nothing until told to: the replica's transport fills up behind it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()

    @classmethod
    async def connect(cls, port: int) -> SilentClient:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        self = cls(sock)
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24}
        )
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window((1 << 31) - 1 - 65_535)
        return self

    async def completions(self, count: int, max_tokens: int) -> list[int]:
        sids = []
        for _ in range(count):
            sid = self.conn.get_next_available_stream_id()
            body = orjson.dumps({"prompt": "p", "max_tokens": max_tokens, "stream": True})
            headers = [(b":method", b"POST"), (b":path", b"/v1/completions"),
                       (b":scheme", b"http"), (b":authority", b"replica"),
                       (b"content-length", str(len(body)).encode())]  # fmt: skip
            self.conn.send_headers(sid, headers)
            self.conn.send_data(sid, body, end_stream=True)
            sids.append(sid)
        await asyncio.get_running_loop().sock_sendall(self.sock, self.conn.data_to_send())
        return sids

    async def read_until_ended(self, sids: list[int], max_reads: int = 100_000) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(max_reads):
            if self.ended.issuperset(sids):
                return
            data = await asyncio.wait_for(loop.sock_recv(self.sock, 1 << 16), 5)
            assert data, "the replica closed the connection"
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    self.ended.add(event.stream_id)
            outgoing = self.conn.data_to_send()
            if outgoing:
                await loop.sock_sendall(self.sock, outgoing)

    def close(self) -> None:
        self.sock.close()


@run
async def test_a_full_transport_stops_the_engine_until_the_client_reads_again() -> None:
    """End to end through asyncio's flow control: the replica's transport passes its high-water
    mark behind a client that does not read, the handler pauses, the streams' buffers fill and
    the engine stops; once the client reads, every byte arrives."""
    engine = FirehoseEngine()
    limits = Limits(
        connection_buffer_bytes=64 << 10, stream_send_buffer_bytes=SEND_BUFFER, keepalive_s=0
    )
    streams, max_tokens = 4, MAX_OUTPUT_TOKENS
    async with await start_replica(engine, limits=limits) as replica:
        client = await SilentClient.connect(replica.port)
        assert await until(lambda: len(replica._protocols) == 1)
        (protocol,) = replica._protocols
        assert protocol.transport is not None
        # A small kernel send buffer, so the transport's own buffer fills within the test.
        server_socket = protocol.transport.get_extra_info("socket")
        server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sids = await client.completions(streams, max_tokens)
        pulled = await settled(engine, quiet=200)
        assert pulled < streams * max_tokens, "the engine ran to the end behind a full socket"
        await client.read_until_ended(sids)
        for sid in sids:
            text = "".join(
                event["choices"][0]["text"]
                for block in bytes(client.data[sid]).split(b"\n\n")
                if block.startswith(b"data: {")
                for event in [orjson.loads(block[6:])]
            )
            assert text == WORD * max_tokens
        assert replica.replica.outcomes["completed"] == streams
        client.close()


@run
async def test_the_per_token_null_engine_stops_for_a_client_that_reads_nothing() -> None:
    """The null engine streams a chunk per token: a client that never opens its window makes
    the replica hold at most its stream's bound, not the whole answer (issue 28: the
    one-chunk null engine held 65,536 tokens' SSE per such stream)."""
    limits = Limits(stream_send_buffer_bytes=SEND_BUFFER, send_stall_s=0, keepalive_s=0)
    async with await start_replica(NullEngine(), limits=limits) as replica:
        client = await connect_zero_window(replica.port)
        streams = [client.completion("never read", max_tokens=MAX_OUTPUT_TOKENS, stream=True)
                   for _ in range(4)]  # fmt: skip
        (protocol,) = replica._protocols
        assert isinstance(protocol.handler, H2Handler)
        handler = protocol.handler
        held = await until(lambda: handler.buffer.unsent >= 4 * SEND_BUFFER, 300)
        assert held, handler.buffer.unsent
        for _ in range(200):  # the engines would run on if nothing stopped them
            await asyncio.sleep(0)
        event = 400  # an SSE event of one token is well under this
        assert handler.buffer.unsent < 4 * (SEND_BUFFER + event), handler.buffer.unsent
        assert replica.replica.active == 4 and not any(s.closed.is_set() for s in streams)
        await client.close()
