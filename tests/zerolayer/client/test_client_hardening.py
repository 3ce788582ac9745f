"""The SDK against bad callers and bad servers (issue 14 items 3 and 10), and API keys.

A caller's bad header must fail only that call, before it reaches the connection every caller
shares; a server that streams without event separators, or answers with a huge error body, must
cost the client linear work and bounded memory. No timed assertions: the SSE test counts the bytes
the parser scans, the body tests count the bytes held.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable, Coroutine
from typing import Any

import h11
import orjson
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.stacks import client_for
from serving.engine import SimConfig, SimEngine
from serving.wire import contract
from zerolayer.client import Http1Client, Timing, ZeroLayerClient, ZeroLayerError
from zerolayer.client.codec import (
    MAX_ERROR_BODY_BYTES,
    MAX_SSE_EVENT_BYTES,
    SSEParser,
    prepare,
)
from zerolayer.client.stream import Response
from zerolayer.server import start_replica

BAD_REQUEST = contract.BAD_REQUEST.code


def run(coro: Coroutine[Any, Any, Any], limit_s: float = 30.0) -> Any:
    """Run on uvloop, as the SDK is meant to; a hang fails at ``limit_s``."""
    return uvloop.run(asyncio.wait_for(coro, limit_s))


# -- 1. caller headers are validated before they reach a shared connection ----------------------

BAD_HEADERS = [
    {"x-note": "a\nb"},  # RFC 9113 8.2.1: no CR, LF or NUL in a value
    {"x-note": "a\rb"},
    {"x-note": "a\x00b"},
    {"x-note": " padded"},  # no leading or trailing whitespace
    {"x-note": "padded\t"},
    {"x-note": "bell\x07"},  # RFC 9110 5.5: a field value is visible characters, SP and HTAB
    {"x note": "v"},  # RFC 9110 5.1: a field name is a token
    {"x-note:": "v"},
    {"x-n\u00f6te": "v"},
    {"": "v"},
    {":path": "/admin"},  # pseudo-headers are the SDK's
    {"connection": "close"},  # RFC 9113 8.2.2: connection-specific
    {"keep-alive": "timeout=5"},
    {"proxy-connection": "keep-alive"},
    {"Transfer-Encoding": "chunked"},
    {"upgrade": "h2c"},
    {"te": "gzip"},
    {"content-length": "1"},  # set by the SDK itself
    {"host": "elsewhere"},
    {"accept": "text/html"},
    {"authorization": "Bearer k"},  # pass api_key= instead
    {"zl-request-id": "mine"},
]


@pytest.mark.parametrize("headers", BAD_HEADERS, ids=repr)
def test_a_bad_caller_header_is_a_bad_request_refused_before_sending(
    headers: dict[str, str],
) -> None:
    with pytest.raises(ZeroLayerError) as info:
        prepare(prompt="p", request_id="r", headers=headers)
    assert info.value.code == BAD_REQUEST and not info.value.retryable
    assert isinstance(info.value, ValueError)  # a bad argument, like every other one


def test_good_caller_headers_are_lowercased_and_te_trailers_passes() -> None:
    req = prepare(
        prompt="p", request_id="r", headers={"X-Trace": "abc", "te": "trailers", "x-q": "a\tb"}
    )
    assert (b"x-trace", b"abc") in req.headers
    assert (b"te", b"trailers") in req.headers
    assert (b"x-q", b"a\tb") in req.headers


def test_the_same_header_set_is_validated_once_and_still_checked_against_the_contract() -> None:
    from zerolayer.client.codec import caller_headers

    caller_headers.cache_clear()
    extra = {"x-trace": "abc", "zl-tenant": "t"}
    for i in range(50):
        prepare(prompt="p", request_id=f"r{i}", tenant="t", headers=extra)
    assert caller_headers.cache_info().misses == 1
    with pytest.raises(ValueError, match="conflicts"):
        prepare(prompt="p", request_id="r", tenant="other", headers=extra)


def test_one_callers_bad_header_fails_only_its_call_on_three_shared_connections() -> None:
    """Issue 14 item 3: on main, ``{"x-note": "a\\nb"}`` went out on the connection the other
    callers share, the replica ended it with GOAWAY(PROTOCOL_ERROR), and the SDK retried the
    call on the next replica and ended that connection too."""
    healthy_per_replica = 4
    max_tokens = 64

    async def main() -> None:
        engines = [SimEngine(SimConfig(model_shape="llama-3.2-1b")) for _ in range(3)]
        replicas = [await start_replica(engine) for engine in engines]
        urls = [r.url for r in replicas]
        try:
            async with ZeroLayerClient(urls, health_interval_s=0) as client:
                sessions = [
                    next(
                        f"{url}-{n}-{i}"
                        for i in range(10_000)
                        if client.ring.lookup(f"{url}-{n}-{i}") == url
                    )
                    for url in urls
                    for n in range(healthy_per_replica)
                ]
                streams = [
                    client.stream(prompt=f"p{i}", max_tokens=max_tokens, session=s)
                    for i, s in enumerate(sessions)
                ]
                # Every healthy stream in flight (first token in) before the bad call.
                await asyncio.gather(*(s.__aenter__() for s in streams))
                in_flight = [r.replica.active for r in replicas]
                conns = {url: client.replicas[url].conn for url in urls}
                for bad in ({"x-note": "a\nb"}, {"te": "gzip"}):
                    with pytest.raises(ZeroLayerError) as info:
                        async with client.stream(
                            prompt="bad", max_tokens=4, session=sessions[0], headers=bad
                        ) as s:
                            async for _ in s:
                                pass
                    assert info.value.code == BAD_REQUEST and not info.value.retryable
                    with pytest.raises(ZeroLayerError) as info:
                        client.submit(lambda t, n: None, prompt="bad", headers=bad)
                    assert info.value.code == BAD_REQUEST
                tokens = []
                for s in streams:
                    tokens.append(sum([c.tokens async for c in s]))
                    await s.__aexit__(None, None, None)
                assert in_flight == [healthy_per_replica] * 3  # still generating when it came
                assert tokens == [max_tokens] * len(streams)
                assert all(s.timing.outcome == "completed" for s in streams)
                assert all(s.timing.retries == 0 for s in streams)
                for url, conn in conns.items():
                    assert client.replicas[url].conn is conn
                    assert conn is not None and conn.usable
                    assert client.is_up(url)
        finally:
            for replica in replicas:
                await replica.close(timeout=5)
            for engine in engines:
                await engine.close()

    run(main())


# -- 3. SSE parsing is linear and an event is bounded -------------------------------------------

PIECES = [b"data:", b"data: ", b"data: [DONE]", b"x", b"{}", b":", b"event: e", b" ",
          b"\n", b"\n\n", b"\r", b"\r\n", b"\r\n\r\n"]  # fmt: skip


def parse_in_chunks(stream: bytes, cuts: list[int]) -> list[bytes]:
    parser = SSEParser()
    out: list[bytes] = []
    start = 0
    for cut in [*sorted(cuts), len(stream)]:
        out += parser.feed(stream[start:cut])
        start = max(start, cut)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=40).map(b"".join),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_any_split_of_a_byte_stream_yields_the_events_of_parsing_it_whole(
    stream: bytes, cuts: list[int]
) -> None:
    whole = SSEParser().feed(stream)
    assert parse_in_chunks(stream, [min(c, len(stream)) for c in cuts]) == whole
    assert all(type(p) is bytes for p in whole)


def test_bytes_scanned_grow_linearly_without_an_event_separator() -> None:
    """Issue 14 item 10: 16 MiB without a separator cost 13.2 s of CPU (the whole buffer was
    copied and split again on every read). Counted here as bytes scanned, not time."""
    size, step = 4 << 20, 1 << 10
    parser = SSEParser(max_event_bytes=2 * size)
    piece = b"x" * step
    for _ in range(size // step):
        assert parser.feed(piece) == []
    assert parser.feed(b"\n\n") == [] and parser.bytes_scanned <= 2 * (size + 2)
    parser.feed(b"data: 1\n\n")
    assert parser.bytes_scanned <= 2 * (size + 11)


def test_an_event_over_the_bound_fails_the_stream_with_a_clear_code() -> None:
    resp = Response(Timing(), chat=False)
    resp.on_response(200, [])
    piece = b"data: " + b"x" * (64 << 10)
    fed = 0
    while not resp.done and fed <= 2 * MAX_SSE_EVENT_BYTES:
        resp.on_data(piece)
        fed += len(piece)
    assert resp.error is not None and resp.error.code == contract.UPSTREAM_FAILED.code
    assert str(MAX_SSE_EVENT_BYTES) in resp.error.message
    assert fed <= MAX_SSE_EVENT_BYTES + len(piece)


# -- 4. error bodies are buffered with a bound ---------------------------------------------------


def held_while(feed: Callable[[bytes], None], total: int) -> int:
    """Bytes still allocated after ``feed`` got ``total`` bytes (one reused 64 KiB piece)."""
    piece = b'{"error": {"message": "' + b"y" * (64 << 10)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(total // len(piece)):
            feed(piece)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_an_error_body_is_kept_up_to_its_bound_and_reported() -> None:
    resp = Response(Timing(), chat=False)
    resp.on_response(500, [(b"zl-error", b"upstream_failed")])
    held = held_while(resp.on_data, 8 << 20)
    resp.on_end()
    assert held <= 2 * MAX_ERROR_BODY_BYTES
    assert resp.error is not None and resp.error.code == "upstream_failed"
    assert resp.error.message.startswith('{"error": {"message": "yyy')


def test_a_health_body_is_kept_up_to_its_bound() -> None:
    from zerolayer.client.h2conn import _Collect

    async def main() -> tuple[int, int]:
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        sink = _Collect(future)
        sink.on_response(503, [])
        held = held_while(sink.on_data, 8 << 20)
        sink.on_end()
        return held, len((await future)[1])

    held, kept = run(main())
    assert kept == MAX_ERROR_BODY_BYTES and held <= 2 * MAX_ERROR_BODY_BYTES


# -- 5. API keys ---------------------------------------------------------------------------------


class RecordingH11Server(asyncio.Protocol):
    """HTTP/1.1: records each request's headers and answers a two-event SSE stream."""

    seen: list[dict[bytes, bytes]] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.conn = h11.Connection(h11.SERVER)

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self.seen.append(dict(event.headers))
            elif isinstance(event, h11.EndOfMessage):
                body = b'data: {"choices": [{"text": " a"}]}\n\ndata: [DONE]\n\n'
                out = self.conn.send(
                    h11.Response(status_code=200, headers=[("content-length", str(len(body)))])
                )
                out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                self.transport.write(out)
                self.conn.start_next_cycle()


def test_api_keys_reach_the_wire_as_bearer_tokens_per_client_and_per_request() -> None:
    async def main() -> list[dict[bytes, bytes]]:
        RecordingH11Server.seen = []
        server = await asyncio.get_running_loop().create_server(RecordingH11Server, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with Http1Client(url, api_key="k-client") as client:
                await client.complete(prompt="a", max_tokens=1)
                await client.complete(prompt="b", max_tokens=1, api_key="k-tenant2")
            routed = client_for("http1", [url], api_key="k-routed")
            await routed.complete(prompt="c", max_tokens=1)
            await routed.close()
            async with Http1Client(url) as anonymous:
                await anonymous.complete(prompt="d", max_tokens=1)
        finally:
            server.close()
        return RecordingH11Server.seen

    seen = run(main())
    assert [h.get(b"authorization") for h in seen] == [
        b"Bearer k-client",
        b"Bearer k-tenant2",
        b"Bearer k-routed",
        None,
    ]


@pytest.mark.parametrize("key", ["", "has space", "tab\tin", "new\nline", "caf\u00e9", "\x7f"])
def test_a_malformed_api_key_is_refused_without_being_echoed(key: str) -> None:
    for make in (
        lambda: ZeroLayerClient(["http://127.0.0.1:1"], api_key=key),
        lambda: Http1Client("http://127.0.0.1:1", api_key=key),
    ):
        with pytest.raises(ValueError) as info:
            make()
        assert not key or key not in str(info.value)
    with pytest.raises(ZeroLayerError) as err:
        prepare(prompt="p", request_id="r", api_key=key)
    assert err.value.code == BAD_REQUEST and (not key or key not in str(err.value))


def test_the_key_stays_out_of_reprs() -> None:
    req = prepare(prompt="p", request_id="r", api_key="sekrit-key")
    assert (b"authorization", b"Bearer sekrit-key") in req.headers
    assert "sekrit-key" not in repr(req)
    assert orjson.loads(req.body) == {"prompt": "p", "max_tokens": 16, "stream": True}
