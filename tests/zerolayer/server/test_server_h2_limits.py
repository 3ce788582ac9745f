"""The HTTP/2 replica against hostile frame sequences: each fault stays on its stream, each
connection's memory and control traffic is budgeted (issue 14, items 1, 3, 4 and 6).

Every test drives a real replica over loopback with ``h2attack.RawH2``, which writes frames no
client library would; the limits are set small so that a handful of frames crosses them.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine import NullEngine, SimConfig, SimEngine
from tests.support.h2attack import ENHANCE_YOUR_CALM, REFUSED_STREAM, RawH2
from tests.support.server_client import run
from zerolayer.server import start_replica
from zerolayer.server.limits import Limits

PROTOCOL_ERROR = 0x1
FRAME_SIZE_ERROR = 0x6
NO_ERROR = 0x0


def completion(max_tokens: int = 2, stream: bool = False, size: int = 0) -> bytes:
    return orjson.dumps({"prompt": "x" * size or "hello", "max_tokens": max_tokens,
                         "stream": stream})  # fmt: skip


def request_head(body_length: int | None) -> list[tuple[bytes, bytes]]:
    """A completion request's HEADERS; with no content-length when ``body_length`` is None."""
    head = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v1/completions"),
            (b":authority", b"replica")]  # fmt: skip
    if body_length is not None:
        head.append((b"content-length", str(body_length).encode()))
    return head


def partial_upload(client: RawH2, sid: int, body: bytes, cut: int) -> bytes:
    """HEADERS declaring all of ``body``, then its first ``cut`` bytes in 8 KiB DATA frames."""
    chunks = [client.data(sid, body[i : min(i + 8192, cut)]) for i in range(0, cut, 8192)]
    return client.headers(sid, request_head(len(body))) + b"".join(chunks)


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- item 1: rapid reset ----------------------------------------------------------------------


@run
async def test_rapid_reset_frees_every_request_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """HEADERS (with no content-length, so the stream's window is opened to the body limit) then
    RST_STREAM for 200 streams in one write: nothing stays counted in ``active``, nothing is
    logged as an error, and the connection still serves."""
    engine = NullEngine()
    async with await start_replica(engine) as handle:
        client = await RawH2.connect(handle.port)
        pairs = [client.headers(sid, request_head(None)) + client.rst(sid)
                 for sid in range(1, 401, 2)]  # fmt: skip
        client.write(b"".join(pairs) + client.request(401, completion()))
        await client.wait_for([401])
        assert client.reply(401).status == 200
        assert handle.replica.active == 0
        assert errors_logged(caplog) == []
        assert client.goaway_code is None
        await client.close()
    await engine.close()


@run
async def test_a_reset_flood_past_the_budget_gets_enhance_your_calm() -> None:
    engine = NullEngine()
    limits = Limits(reset_burst=20, reset_rate=1.0)
    async with await start_replica(engine, limits=limits) as handle:
        client = await RawH2.connect(handle.port)
        pairs = [client.headers(sid, request_head(None)) + client.rst(sid)
                 for sid in range(1, 201, 2)]  # fmt: skip
        client.write(b"".join(pairs))
        await client.wait_closed()
        assert client.goaway_code == ENHANCE_YOUR_CALM
        assert handle.replica.active == 0
        await client.close()
    await engine.close()


# -- item 3: a malformed request is a stream error; excess streams are refused ---------------


MALFORMED: dict[str, list[tuple[bytes, bytes]]] = {
    "uppercase name": [(b"X-Note", b"a")],
    "connection": [(b"connection", b"keep-alive")],
    "te gzip": [(b"te", b"gzip")],
    "keep-alive": [(b"keep-alive", b"timeout=5")],
    "transfer-encoding": [(b"transfer-encoding", b"chunked")],
    "upgrade": [(b"upgrade", b"h2c")],
    "proxy-connection": [(b"proxy-connection", b"close")],
    "status pseudo-header in a request": [(b":status", b"200")],
}


@run
async def test_a_malformed_request_is_answered_on_its_stream_alone() -> None:
    """RFC 9113 8.1.1: each malformed request gets a 400 (or RST_STREAM) on its own stream, the
    healthy streams around it complete, and the connection takes new streams afterwards."""
    engine = SimEngine(SimConfig(model_shape="llama-3.2-1b"))
    async with await start_replica(engine) as handle:
        client = await RawH2.connect(handle.port)
        healthy_body = completion(max_tokens=30, stream=True)
        healthy = [1, 3, 5]
        client.write(b"".join(client.request(sid, healthy_body) for sid in healthy))
        body = completion()
        frames, bad = [], {}
        sid = 7
        for name, extra in MALFORMED.items():
            frames.append(client.request(sid, body, extra=extra))
            bad[name] = sid
            sid += 2
        for name, declared, sent in (("content-length above the body", len(body) + 10, body),
                                     ("content-length below the body", len(body) - 1, body),
                                     ("content-length not a number", -1, body)):  # fmt: skip
            length = str(declared).encode() if declared >= 0 else b"12x"
            head = [(n, v) for n, v in request_head(0) if n != b"content-length"]
            frames.append(client.headers(sid, [*head, (b"content-length", length)]))
            frames.append(client.data(sid, sent, end_stream=True))
            bad[name] = sid
            sid += 2
        no_path = [(n, v) for n, v in request_head(len(body)) if n != b":path"]
        frames.append(client.headers(sid, no_path) + client.data(sid, body, end_stream=True))
        bad["no :path"] = sid
        client.write(b"".join(frames))
        await client.wait_for([*healthy, *bad.values()], 10)
        for name, bad_sid in bad.items():
            reply = client.reply(bad_sid)
            assert (reply.status, reply.error) == (400, "bad_request") or (
                reply.status == 0 and reply.reset_code == PROTOCOL_ERROR
            ), (name, reply.headers, reply.reset_code)
        for healthy_sid in healthy:
            reply = client.reply(healthy_sid)
            assert (reply.status, reply.reset_code, reply.ended) == (200, None, True)
            assert reply.data.endswith(b"data: [DONE]\n\n")
        assert client.goaway_code is None
        after = sid + 2
        client.write(client.request(after, completion()))
        await client.wait_for([after])
        assert client.reply(after).status == 200
        assert handle.replica.active == 0
        await client.close()
    await engine.close()


@pytest.mark.parametrize("ack_settings", [True, False])
@run
async def test_a_stream_past_max_concurrent_streams_is_refused_alone(ack_settings: bool) -> None:
    """RFC 9113 5.1.2: RST_STREAM(REFUSED_STREAM) for the excess stream, the others carry on;
    also for a client that never acknowledges the SETTINGS carrying the limit."""
    engine = NullEngine()
    body = completion()
    half = len(body) // 2
    async with await start_replica(engine, limits=Limits(max_concurrent_streams=3)) as handle:
        client = await RawH2.connect(handle.port, ack_settings=ack_settings)
        await client.round_trip()
        open_sids = [1, 3, 5]
        client.write(b"".join(client.headers(sid, request_head(len(body)))
                              + client.data(sid, body[:half]) for sid in open_sids))  # fmt: skip
        client.write(client.headers(7, request_head(len(body))) + client.data(7, body[:half]))
        await client.wait_for([7])
        assert client.reply(7).reset_code == REFUSED_STREAM
        assert client.reply(7).status == 0
        client.write(b"".join(client.data(sid, body[half:], end_stream=True) for sid in open_sids))
        await client.wait_for(open_sids)
        assert [client.reply(sid).status for sid in open_sids] == [200, 200, 200]
        client.write(client.request(9, body))
        await client.wait_for([9])
        assert client.reply(9).status == 200
        assert client.goaway_code is None
        assert handle.replica.active == 0
        await client.close()
    await engine.close()


STREAM_FAULTS = ["complete", "reset after headers", "reset mid-body", "malformed", "wrong length"]


async def _faults_on_one_connection(faults: list[str], cuts: list[int]) -> None:
    engine = NullEngine()
    body = completion()
    half = len(body) // 2
    async with await start_replica(engine) as handle:
        # No automatic SETTINGS ACK: it would land inside a frame this test splits.
        client = await RawH2.connect(handle.port, ack_settings=False)
        frames, expected = [], {}
        for i, fault in enumerate(faults):
            sid = 2 * i + 1
            if fault == "complete":
                frames.append(client.request(sid, body))
                expected[sid] = 200
            elif fault == "reset after headers":
                frames.append(client.headers(sid, request_head(None)) + client.rst(sid))
            elif fault == "reset mid-body":
                frames.append(client.headers(sid, request_head(len(body)))
                              + client.data(sid, body[:half]) + client.rst(sid))  # fmt: skip
            elif fault == "malformed":
                frames.append(client.request(sid, body, extra=[(b"connection", b"close")]))
                expected[sid] = 400
            else:
                frames.append(client.headers(sid, request_head(len(body) + 1))
                              + client.data(sid, body, end_stream=True))  # fmt: skip
                expected[sid] = 400
        last = 2 * len(faults) + 1
        stream = b"".join(frames) + client.request(last, body)
        expected[last] = 200
        for start, end in zip([0, *sorted(cuts)], [*sorted(cuts), len(stream)], strict=True):
            client.write(stream[start:end])  # the server's reads split frames anywhere
            await client.writer.drain()
            await asyncio.sleep(0)
        await client.wait_for(list(expected))
        assert {sid: client.reply(sid).status for sid in expected} == expected
        assert client.goaway_code is None
        assert handle.replica.active == 0
        await client.close()
    await engine.close()


@settings(max_examples=25, deadline=None)
@given(
    faults=st.lists(st.sampled_from(STREAM_FAULTS), min_size=1, max_size=12),
    cuts=st.lists(st.integers(1, 2000), max_size=4, unique=True),
)
def test_any_mix_of_stream_faults_stays_on_its_streams(faults: list[str], cuts: list[int]) -> None:
    """Whatever mix of resets and malformed requests shares a connection with healthy ones, and
    however the bytes are split into reads: each healthy request completes, each malformed one
    gets its 400, no GOAWAY, and nothing is left counted in ``active``."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_faults_on_one_connection(faults, cuts))


# -- item 4: client-sized memory --------------------------------------------------------------


@run
async def test_frames_above_the_limits_max_frame_size_end_the_connection() -> None:
    engine = NullEngine()
    async with await start_replica(engine) as handle:
        client = await RawH2.connect(handle.port)
        body = completion(size=20_000)
        client.write(client.headers(1, request_head(len(body))) + client.data(1, body))
        await client.wait_closed()
        assert client.goaway_code == FRAME_SIZE_ERROR
        await client.close()
    await engine.close()


@run
async def test_a_header_block_in_progress_is_bounded() -> None:
    """HEADERS + CONTINUATION without END_HEADERS past max_header_list_size: GOAWAY at once (the
    block cannot be skipped without losing HPACK state), not a buffer held for the client."""
    engine = NullEngine()
    limits = Limits(max_header_list_size=4096)
    async with await start_replica(engine, limits=limits) as handle:
        client = await RawH2.connect(handle.port)
        client.write(client.header_block(1, pieces=3, size=2048))
        await client.wait_closed()
        assert client.goaway_code == ENHANCE_YOUR_CALM
        await client.close()
    await engine.close()


@run
async def test_bodies_in_progress_past_the_connection_budget_are_refused() -> None:
    """Two 48 KiB uploads, each stopped at 40 KiB, on a 64 KiB connection budget: the second
    is refused (503 overloaded) on its stream; the first then completes."""
    engine = NullEngine()
    body = completion(size=48 << 10)
    cut = 40 << 10
    limits = Limits(connection_buffer_bytes=64 << 10)
    async with await start_replica(engine, limits=limits) as handle:
        client = await RawH2.connect(handle.port)
        client.write(partial_upload(client, 1, body, cut))
        client.write(partial_upload(client, 3, body, cut))
        await client.wait_for([3])
        assert (client.reply(3).status, client.reply(3).error) == (503, "overloaded")
        assert client.reply(3).reset_code == NO_ERROR
        assert not client.reply(1).closed
        client.write(client.data(1, body[cut:], end_stream=True))
        await client.wait_for([1])
        assert client.reply(1).status == 200
        assert handle.replica.active == 0
        assert handle.replica.refusals["overloaded"] == 1
        await client.close()
    await engine.close()


@run
async def test_a_body_that_stops_arriving_gets_408_and_its_call_ends() -> None:
    engine = NullEngine()
    body = completion()
    limits = Limits(body_timeout_s=0.2)
    async with await start_replica(engine, limits=limits) as handle:
        client = await RawH2.connect(handle.port)
        client.write(client.headers(1, request_head(len(body))) + client.data(1, body[:5]))
        await client.wait_for([1])
        reply = client.reply(1)
        assert (reply.status, reply.error, reply.reset_code) == (408, "request_timeout", NO_ERROR)
        assert handle.replica.active == 0
        assert handle.replica.refusals["request_timeout"] == 1
        client.write(client.request(3, body))
        await client.wait_for([3])
        assert client.reply(3).status == 200
        await client.close()
    await engine.close()


# -- item 6: control-frame floods -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ping", "settings"])
@run
async def test_control_frames_under_the_budget_are_answered(kind: str) -> None:
    engine = NullEngine()
    limits = Limits(control_burst=20, control_rate=1.0)
    async with await start_replica(engine, limits=limits) as handle:
        client = await RawH2.connect(handle.port)
        frame = client.ping() if kind == "ping" else client.settings()
        client.write(frame * 10 + client.request(1, completion()))
        await client.wait_for([1])
        assert client.reply(1).status == 200
        if kind == "ping":
            assert client.pings_acked == 10
        assert client.goaway_code is None
        await client.close()
    await engine.close()


@pytest.mark.parametrize("kind", ["ping", "settings", "empty data"])
@run
async def test_a_control_frame_flood_gets_enhance_your_calm(kind: str) -> None:
    engine = NullEngine()
    limits = Limits(control_burst=20, control_rate=1.0)
    async with await start_replica(engine, limits=limits) as handle:
        client = await RawH2.connect(handle.port)
        body = completion()
        if kind == "empty data":
            flood = client.headers(1, request_head(len(body))) + client.data(1, b"") * 500
        else:
            flood = (client.ping() if kind == "ping" else client.settings()) * 500
        client.write(flood)
        await client.wait_closed()
        assert client.goaway_code == ENHANCE_YOUR_CALM
        if kind == "ping":
            assert client.pings_acked < 500
        assert handle.replica.active == 0
        await client.close()
    await engine.close()
