"""The attacks' raw HTTP/2 client against a server of our own (h2, sans-IO, in a thread) that
reads late, as a replica on a loaded host does: the attack's judgement must wait for the server
to read what was sent (the barrier), not judge after a fixed wait (CI's rapid-reset case failed
so on a loaded host: 17,900 resets sent, the replica had not read past its budget yet)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import pytest
from h2.errors import ErrorCodes

from chaos.attacks.h2raw import HostileH2, request_headers

RESETS_ALLOWED = 10
PAIRS = 50
SERVER_LIFE_S = 30.0


class LateServer:
    """One connection: SETTINGS at once, then nothing read until ``go`` is set; past
    ``RESETS_ALLOWED`` RST_STREAMs it sends GOAWAY(ENHANCE_YOUR_CALM), as the replica's guard
    does. PINGs are ACKed by h2 itself, in the order read."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        sock.settimeout(SERVER_LIFE_S)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        self.go.wait(SERVER_LIFE_S)
        resets = 0
        with sock, contextlib.suppress(h2.exceptions.ProtocolError, OSError):  # after GOAWAY
            while data := sock.recv(1 << 16):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.StreamReset):
                        resets += 1
                        if resets == RESETS_ALLOWED + 1:
                            conn.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
                sock.sendall(conn.data_to_send())

    def close(self) -> None:
        self.go.set()
        self.listener.close()
        self.thread.join(SERVER_LIFE_S)


@pytest.fixture
def server() -> Iterator[LateServer]:
    late = LateServer()
    yield late
    late.close()


def test_the_barrier_waits_for_a_late_reader_to_say_what_it_thinks(server: LateServer) -> None:
    conn = HostileH2("127.0.0.1", server.port)
    try:
        for _ in range(PAIRS):
            sid = conn.open_stream(request_headers(server.port))
            conn.h2.reset_stream(sid, ErrorCodes.CANCEL)
        assert conn.flush()
        conn.pump(0.2)
        assert not conn.tally.goaway  # nothing read yet: a fixed wait would judge here
        threading.Timer(0.3, server.go.set).start()
        assert conn.barrier(), "the server read everything and ACKed the barrier's PING"
        conn.pump(0.5)
        assert conn.tally.goaway == "ENHANCE_YOUR_CALM"
        assert not conn.barrier()  # after GOAWAY there is nothing to wait for
    finally:
        conn.close()
