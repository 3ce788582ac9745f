"""The SDK against a replica that blames a stream for a protocol error, or refuses it.

The peer is a minimal sans-IO h2 server on loopback that misbehaves on purpose: a request with an
``x-poison`` header (legal, but this server calls it malformed) gets RST_STREAM(PROTOCOL_ERROR)
or GOAWAY(PROTOCOL_ERROR) naming it; one with ``x-refuse`` gets RST_STREAM(REFUSED_STREAM). The
call that broke the rules fails as ``bad_request`` and is never retried (a retry would end the
next replica's connection too); the streams that only shared its connection are retried as
before, and the replica is not marked down for a fault that was ours (RFC 9113 sections 5.4.2,
6.8, 8.7).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
import uvloop

from serving.wire import contract
from zerolayer.client import Timing, ZeroLayerClient, ZeroLayerError
from zerolayer.client.timing import STREAM_RESET

BAD_REQUEST = contract.BAD_REQUEST.code
SSE = b'data: {"choices": [{"text": " a"}]}\n\ndata: [DONE]\n\n'


class Peer(asyncio.Protocol):
    """One connection of :class:`MisbehavingServer`."""

    def __init__(self, server: MisbehavingServer) -> None:
        self.server = server
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                headers = {str(k): str(v) for k, v in event.headers or ()}
                if self.on_request(event.stream_id, headers):
                    return
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.transport.write(self.conn.data_to_send())

    def on_request(self, sid: int, headers: dict[str, str]) -> bool:
        """Answer, refuse or hold one request; True when the connection is gone."""
        server = self.server
        server.seen.append(headers)
        if "x-poison" in headers:
            server.poisoned += 1
            if server.poison == "goaway":
                self.goaway(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)
                return True
            self.conn.reset_stream(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)
        elif "x-refuse" in headers and server.refuse:
            self.conn.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
        elif "x-crash" in headers and server.crash:
            self.goaway(0, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            return True
        elif server.hold and headers[":path"] != "/health":
            server.held += 1
        else:
            self.conn.send_headers(sid, [(":status", "200")])
            self.conn.send_data(sid, SSE, end_stream=True)
        return False

    def goaway(self, last_stream_id: int, code: h2.errors.ErrorCodes) -> None:
        assert self.transport is not None
        self.conn.close_connection(error_code=code, last_stream_id=last_stream_id)
        self.transport.write(self.conn.data_to_send())
        self.transport.close()


class MisbehavingServer:
    """Holds (``hold``) or answers healthy requests; punishes ``x-poison`` with ``poison``; with
    ``refuse``, refuses ``x-refuse``; with ``crash``, ends the connection on ``x-crash`` with a
    GOAWAY(PROTOCOL_ERROR) that names no stream."""

    def __init__(
        self, poison: str = "reset", hold: bool = False, refuse: bool = False, crash: bool = False
    ) -> None:
        self.poison = poison
        self.hold = hold
        self.refuse = refuse
        self.crash = crash
        self.seen: list[dict[str, str]] = []
        self.poisoned = 0
        self.held = 0
        self.listener: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> MisbehavingServer:
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(lambda: Peer(self), "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.listener.sockets[0].getsockname()[1]}"
        return self

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()


def run(coro: Coroutine[Any, Any, Any], limit_s: float = 20.0) -> Any:
    return uvloop.run(asyncio.wait_for(coro, limit_s))


async def until(predicate: Any, limit_s: float = 10.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():
            await asyncio.sleep(0.01)


def owned_by(client: ZeroLayerClient, url: str, tag: str) -> str:
    return next(f"{tag}{i}" for i in range(10_000) if client.ring.lookup(f"{tag}{i}") == url)


async def call(client: ZeroLayerClient, **fields: Any) -> Timing:
    """One call's timing record, whether it completed or failed."""
    stream = client.stream(prompt="p", max_tokens=1, **fields)
    try:
        async with stream as s:
            async for _ in s:
                pass
    except ZeroLayerError:
        pass
    return stream.timing


async def pair(first: MisbehavingServer, second: MisbehavingServer) -> list[str]:
    await first.start()
    await second.start()
    return [first.url, second.url]


@pytest.mark.parametrize("poison", ["reset", "goaway"])
def test_a_stream_the_replica_calls_malformed_fails_as_bad_request_and_is_not_retried(
    poison: str,
) -> None:
    async def main() -> tuple[Timing, MisbehavingServer, MisbehavingServer]:
        a, b = MisbehavingServer(poison), MisbehavingServer(poison)
        urls = await pair(a, b)
        try:
            async with ZeroLayerClient(urls, health_interval_s=0) as client:
                timing = await call(client, session=owned_by(client, a.url, "s"),
                                    headers={"x-poison": "1"})  # fmt: skip
                assert client.is_up(a.url)
        finally:
            a.close()
            b.close()
        return timing, a, b

    timing, a, b = run(main())
    assert timing.error_code == BAD_REQUEST, timing
    assert timing.tried == [a.url] and timing.retries == 0
    assert a.poisoned == 1 and b.poisoned == 0


def test_goaway_blaming_a_stream_retries_the_others_that_shared_its_connection() -> None:
    async def main() -> tuple[dict[str, Timing], MisbehavingServer, MisbehavingServer]:
        a, b = MisbehavingServer("goaway", hold=True), MisbehavingServer("goaway")
        urls = await pair(a, b)
        ended: dict[str, Timing] = {}
        all_ended = asyncio.Event()

        def send(name: str, session: str, **fields: Any) -> None:
            def on_done(timing: Timing, tokens: int) -> None:
                ended[name] = timing
                if len(ended) == 7:
                    all_ended.set()

            client.submit(on_done, prompt="p", max_tokens=1, session=session, **fields)

        try:
            # A poll slower than its timeout would mark a replica down: give it a hang guard's.
            async with ZeroLayerClient(urls, health_interval_s=0, health_timeout_s=10) as client:
                await client.poll_health()  # the connection is up: submit sends synchronously
                on_a = [owned_by(client, a.url, f"h{n}-") for n in range(6)]
                # Three healthy streams the replica holds (no answer yet); then, in one go, the
                # bad one and three more that go out before its GOAWAY (above last_stream_id).
                for n in range(3):
                    send(f"early{n}", on_a[n])
                await until(lambda: a.held == 3)
                send("bad", on_a[0], headers={"x-poison": "1"})
                for n in range(3, 6):
                    send(f"late{n}", on_a[n])
                await all_ended.wait()
        finally:
            a.close()
            b.close()
        return ended, a, b

    ended, a, b = run(main())
    blamed = ended.pop("bad")
    assert blamed.error_code == BAD_REQUEST and blamed.tried == [a.url]
    assert b.poisoned == 0 and a.held == 3
    assert {name: t.outcome for name, t in ended.items()} == dict.fromkeys(ended, "completed")
    assert all(t.tried == [a.url, b.url] for t in ended.values())


def test_goaway_protocol_error_that_names_no_stream_of_ours_is_the_replicas_fault() -> None:
    async def main() -> tuple[Timing, MisbehavingServer, bool]:
        a, b = MisbehavingServer(crash=True), MisbehavingServer()
        urls = await pair(a, b)
        try:
            async with ZeroLayerClient(urls, health_interval_s=0) as client:
                timing = await call(client, session=owned_by(client, a.url, "s"),
                                    headers={"x-crash": "1"})  # fmt: skip
                up = client.is_up(a.url)
        finally:
            a.close()
            b.close()
        return timing, a, up

    timing, a, up = run(main())
    assert timing.outcome == "completed" and timing.tried[0] == a.url and timing.retries == 1
    assert not up


def test_a_refused_stream_is_retried_on_the_next_replica_before_the_first_token() -> None:
    async def main() -> tuple[Timing, Timing, MisbehavingServer, MisbehavingServer]:
        a, b = MisbehavingServer(refuse=True), MisbehavingServer()
        urls = await pair(a, b)
        try:
            async with ZeroLayerClient(urls, health_interval_s=0) as client:
                session = owned_by(client, a.url, "s")
                streamed = await call(client, session=session, headers={"x-refuse": "1"})
                done: asyncio.Future[Timing] = asyncio.get_running_loop().create_future()
                client.submit(lambda t, n: done.set_result(t), prompt="p", max_tokens=1,
                              session=session, headers={"x-refuse": "1"})  # fmt: skip
                submitted = await done
        finally:
            a.close()
            b.close()
        return streamed, submitted, a, b

    streamed, submitted, a, b = run(main())
    for timing in (streamed, submitted):
        assert timing.outcome == "completed", timing
        assert timing.tried == [a.url, b.url]


def test_a_refused_stream_with_no_replica_left_reports_the_reset() -> None:
    async def main() -> Timing:
        a = await MisbehavingServer(refuse=True).start()
        try:
            async with ZeroLayerClient([a.url], health_interval_s=0) as client:
                return await call(client, headers={"x-refuse": "1"})
        finally:
            a.close()

    assert run(main()).error_code == STREAM_RESET


def test_the_h2_client_sends_its_api_key_and_a_per_request_override() -> None:
    async def main() -> list[str | None]:
        a = await MisbehavingServer().start()
        try:
            async with ZeroLayerClient([a.url], health_interval_s=0, api_key="k1") as client:
                await call(client)
                await call(client, api_key="k2")
                done: asyncio.Future[Timing] = asyncio.get_running_loop().create_future()
                client.submit(lambda t, n: done.set_result(t), prompt="p", api_key="k3")
                await done
            async with ZeroLayerClient([a.url], health_interval_s=0) as anonymous:
                await call(anonymous)
        finally:
            a.close()
        return [h.get("authorization") for h in a.seen]

    assert run(main()) == ["Bearer k1", "Bearer k2", "Bearer k3", None]
