"""Ports picked for a server (``serving.ports``): never from the kernel's ephemeral range, which
another process may be handed in the moment before the server binds, and never one taken."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving import ports
from serving.ports import LEAST_SPAN, LOWEST_PICK, bindable, ephemeral_low, free_port

HOST = "127.0.0.1"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A socket listening on a port of the range ``free_port`` picks from."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    for port in range(LOWEST_PICK, ephemeral_low()):
        try:
            sock.bind((HOST, port))
        except OSError:
            continue
        sock.listen()
        yield sock
        sock.close()
        return
    sock.close()
    pytest.skip("no port of the pick range is free on this host")


def test_a_picked_port_lies_outside_the_kernels_range_and_can_be_bound() -> None:
    port = free_port(HOST)
    assert LOWEST_PICK <= port < ephemeral_low()
    assert bindable(HOST, port)


@settings(max_examples=25, deadline=None)
@given(st.integers(LOWEST_PICK + LEAST_SPAN, 65536))
def test_any_range_with_room_below_it_is_never_picked_from(low: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ports, "ephemeral_low", lambda: low)
        port = free_port(HOST)
    assert LOWEST_PICK <= port < low
    assert bindable(HOST, port)


def test_a_port_something_listens_on_is_not_picked(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = listener.getsockname()[1]
    real_pick = ports._PICKER.randint
    offers: list[int] = []

    def taken_twice(low: int, high: int) -> int:
        offers.append(taken if len(offers) < 2 else real_pick(low, high))
        return offers[-1]

    monkeypatch.setattr(ports._PICKER, "randint", taken_twice)
    assert not bindable(HOST, taken)
    assert free_port(HOST) != taken
    assert offers[:2] == [taken, taken] and len(offers) >= 3


def test_a_host_whose_range_leaves_no_room_gets_the_kernels_pick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{LOWEST_PICK + 10}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", narrow)
    assert ephemeral_low() == LOWEST_PICK + 10
    assert free_port(HOST) >= LOWEST_PICK + 10


def test_an_unreadable_range_is_linuxs_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert ephemeral_low() == ports.DEFAULT_EPHEMERAL_LOW
