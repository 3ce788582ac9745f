"""``H2State``: h2's connection with cheap stream counting still enforces stream limits exactly."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest

from serving.wire.h2base import RESCAN_MARGIN, H2State

REQUEST = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]


def _pair(server_limit: int) -> tuple[H2State, h2.connection.H2Connection]:
    client = H2State(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.local_settings = h2.settings.Settings(
        client=False,
        initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: server_limit},
    )
    client.initiate_connection()
    server.initiate_connection()
    for _ in range(2):
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    return client, server


def _open(client: H2State) -> int:
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, REQUEST, end_stream=True)
    return sid


def test_the_peer_limit_is_enforced_exactly() -> None:
    client, _ = _pair(server_limit=5)
    sids = [_open(client) for _ in range(5)]
    with pytest.raises(h2.exceptions.TooManyStreamsError):
        _open(client)
    client.reset_stream(sids[0])
    _open(client)  # a closed stream frees its slot at once


def test_closed_streams_are_still_purged() -> None:
    client, server = _pair(server_limit=1000)
    for _ in range(20 * RESCAN_MARGIN):
        sid = _open(client)
        for event in server.receive_data(client.data_to_send()):
            if isinstance(event, h2.events.RequestReceived):
                server.send_headers(sid, [(b":status", b"200")], end_stream=True)
        client.receive_data(server.data_to_send())
    assert len(client.streams) <= 2 * RESCAN_MARGIN + 1
    assert h2.connection.H2Connection._open_streams(client, 1) == 0  # h2's exact count
