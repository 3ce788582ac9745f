"""The SDK's health probe on a connection whose every stream slot holds one of its own requests.

A replica whose connection is full of our requests is busy, not down: the probe must neither
crash the client (h2 raises TooManyStreamsError for a stream over the peer's limit) nor mark the
replica down. The peer is a minimal sans-IO h2 server on loopback that advertises
MAX_CONCURRENT_STREAMS 2, answers ``/health`` and holds every POST open.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import uvloop

from zerolayer.client import ZeroLayerClient

LIMIT = 2
HEALTH = b'{"score": 1.0, "draining": false}'


class HoldingServer(asyncio.Protocol):
    """Answers GET /health; holds every other stream open without a word."""

    def __init__(self) -> None:
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: LIMIT},
        )
        self.transport: asyncio.Transport | None = None
        self.held = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                if dict(event.headers).get(":method") == "GET":
                    headers = [(":status", "200"), ("content-length", str(len(HEALTH)))]
                    self.conn.send_headers(event.stream_id, headers)
                    self.conn.send_data(event.stream_id, HEALTH, end_stream=True)
                else:
                    self.held += 1
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        assert self.transport is not None
        self.transport.write(self.conn.data_to_send())


async def _until(predicate: Any, limit_s: float = 10.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def _probe_while_full() -> tuple[bool, int]:
    server = HoldingServer()
    listener = await asyncio.get_running_loop().create_server(lambda: server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    try:
        # No timeout on a slow answer (a loaded host) may mark it down: only a skipped probe
        # or a wrong verdict can.
        async with ZeroLayerClient(
            [url], health_interval_s=0, health_timeout_s=10, down_after=1
        ) as client:
            await client.poll_health()  # opens the connection; the replica answers healthy
            held = [
                asyncio.create_task(client.complete(prompt="hold", max_tokens=2, session="s"))
                for _ in range(LIMIT)
            ]
            await _until(lambda: server.held == LIMIT)
            await client.poll_health()
            up = client.is_up(url)
            for task in held:
                task.cancel()
            for task in held:
                with contextlib.suppress(BaseException):
                    await task
            return up, server.held
    finally:
        listener.close()


def test_a_probe_on_a_connection_full_of_our_requests_leaves_the_replica_up() -> None:
    up, held = uvloop.run(asyncio.wait_for(_probe_while_full(), 30))
    assert held == LIMIT
    assert up
