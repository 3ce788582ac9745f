"""Ports for a server to listen on, picked where no other process is handed one meanwhile.

A port is picked free now and bound a moment later: a replica's once it has imported its
engine, a Serve proxy's only after Ray and Serve's controller have started (seconds on a loaded
host). A port from the kernel's ephemeral range (``ip_local_port_range``: what ``bind`` to port
0 returns, and the source port of every outgoing connection) can go to another process in that
moment: a Serve proxy failed its stand-up with "Failed to bind to address '127.0.0.1:43709'" beside
three other test workers starting Rays and clients. So the pick comes from between Ray's worker
ports and the ephemeral range, where only another such pick can land (at random, and checked).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Final

EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Linux's default start of the ephemeral range, where /proc does not say (macOS starts at 49152).
DEFAULT_EPHEMERAL_LOW: Final = 32768
# Above Ray's worker ports (``--min-worker-port``/``--max-worker-port``: 10002-19999 by default).
LOWEST_PICK: Final = 20000
# Fewer ports than this between the two and the kernel's own pick is used instead.
LEAST_SPAN: Final = 1024
PICK_ATTEMPTS: Final = 64
_PICKER: Final = random.SystemRandom()  # not the seeded module state, which workers may share


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def bindable(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (without ``SO_REUSEADDR``, so a port
    that a closed connection still holds in TIME_WAIT counts as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def kernel_port(host: str) -> int:
    """A port the kernel hands out from its ephemeral range."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ranges other processes are handed ports
    from (the server binds it a moment later)."""
    above = ephemeral_low()
    if above - LOWEST_PICK >= LEAST_SPAN:
        for _ in range(PICK_ATTEMPTS):
            port = _PICKER.randint(LOWEST_PICK, above - 1)
            if bindable(host, port):
                return port
    return kernel_port(host)
