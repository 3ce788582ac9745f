"""A loopback TCP proxy in front of one replica that adds delay or a partition on command.

Chaos Mesh injects network faults with netem and iptables inside a pod's namespace; on one
machine the same faults come from standing a proxy in the path: the stack under test is pointed
at the proxy's port, and a small line protocol on a second port switches the fault:

- ``delay MS [down|up|both]``: hold each chunk ``MS`` ms before forwarding it (``down``, the
  default, is the replica's egress, where netem would sit; order is kept per direction);
- ``partition drop``: keep connections open but forward nothing (a black hole: peers time out);
- ``partition refuse``: reset every open connection and reset new ones at once;
- ``heal``: back to a plain pass-through; ``status``: the current mode as JSON.

Every command answers one line (``ok ...`` or ``error ...``). Only loopback addresses are
accepted for the listener and the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Final

import orjson

PASS: Final = "pass"
DELAY: Final = "delay"
DROP: Final = "drop"
REFUSE: Final = "refuse"
DIRECTIONS: Final = ("down", "up", "both")
READ_SIZE: Final = 65536
COMMAND_TIMEOUT_S: Final = 5.0


def _check_loopback(host: str) -> None:
    if host == "localhost":
        return
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"netproxy only talks to loopback addresses, got {host!r}")


@dataclass
class Mode:
    """The fault in force: ``pass``, ``delay`` (with ``delay_ms``, ``direction``), ``drop`` or
    ``refuse``; ``since_ns`` is when it was set (wall clock, for the journal)."""

    kind: str = PASS
    delay_ms: float = 0.0
    direction: str = "down"
    since_ns: int = 0

    def delay_for(self, direction: str) -> float:
        if self.kind != DELAY or self.direction not in (direction, "both"):
            return 0.0
        return self.delay_ms / 1000.0


def parse_command(line: str) -> Mode | None:
    """A command line to the mode it asks for (None for ``status``); ValueError when malformed."""
    words = line.split()
    if not words:
        raise ValueError("empty command")
    verb, args = words[0].lower(), words[1:]
    now = time.time_ns()
    if verb == "status" and not args:
        return None
    if verb == "heal" and not args:
        return Mode(PASS, since_ns=now)
    if verb == "delay" and 1 <= len(args) <= 2:
        delay_ms = float(args[0])
        direction = args[1] if len(args) == 2 else "down"
        if delay_ms < 0 or direction not in DIRECTIONS:
            raise ValueError(f"delay takes MS >= 0 and one of {DIRECTIONS}")
        return Mode(DELAY, delay_ms, direction, now)
    if verb == "partition" and len(args) == 1 and args[0] in (DROP, REFUSE):
        return Mode(args[0], since_ns=now)
    raise ValueError(f"unknown command {line.strip()!r}")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a refused or partitioned peer would see it."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Pipe:
    """One connection pair: two directions, each a reader task and an ordered delayed writer."""

    def __init__(self, proxy: NetProxy, client: tuple, upstream: tuple) -> None:
        self.proxy = proxy
        self.c_reader, self.c_writer = client
        self.u_reader, self.u_writer = upstream
        self.tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        self.tasks = [
            asyncio.create_task(self._direction("up", self.c_reader, self.u_writer)),
            asyncio.create_task(self._direction("down", self.u_reader, self.c_writer)),
        ]
        try:
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.close()

    def close(self, reset: bool = False) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in (self.c_writer, self.u_writer):
            if reset:
                _reset(writer)
            else:
                writer.close()

    async def _direction(
        self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        queue: deque[tuple[float, bytes]] = deque()
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def forward() -> None:
            while True:
                while not queue:
                    ready.clear()
                    await ready.wait()
                due, data = queue.popleft()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    else:
                        writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(forward())
        try:
            while True:
                data = await reader.read(READ_SIZE)
                mode = self.proxy.mode
                if mode.kind == DROP:
                    if not data:
                        return
                    continue
                queue.append((loop.time() + mode.delay_for(name), data))
                ready.set()
                if not data:
                    await sender
                    return
        finally:
            sender.cancel()


class NetProxy:
    """The proxy and its control port, on their own event loop in a daemon thread.

    ``start()`` binds both ports (0: pick free ones) and returns once they listen; ``close()``
    stops everything. ``url`` is what the stack under test is pointed at.
    """

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        up_host, _, up_port = upstream.rpartition(":")
        _check_loopback(up_host)
        _check_loopback(host)
        self.upstream = (up_host, int(up_port))
        self.host = host
        self.port = port
        self.control_port = 0
        self.mode = Mode(since_ns=time.time_ns())
        self.connections = 0
        self._pipes: set[_Pipe] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def control(self) -> str:
        return f"{self.host}:{self.control_port}"

    def start(self) -> NetProxy:
        started = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(self._serve(started))
            except BaseException as exc:  # surfaced to start()'s caller
                errors.append(exc)
                started.set()

        self._thread = threading.Thread(target=main, name="netproxy", daemon=True)
        self._thread.start()
        started.wait(10.0)
        if errors:
            raise errors[0]
        return self

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def __enter__(self) -> NetProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def apply(self, mode: Mode) -> None:
        """Switch mode (on the proxy's loop); ``refuse`` resets every open connection."""
        self.mode = mode
        if mode.kind == REFUSE:
            for pipe in list(self._pipes):
                pipe.close(reset=True)

    async def _serve(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._on_client, self.host, self.port)
        control = await asyncio.start_server(self._on_control, self.host, 0)
        self.port = server.sockets[0].getsockname()[1]
        self.control_port = control.sockets[0].getsockname()[1]
        started.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            control.close()
            for pipe in list(self._pipes):
                pipe.close(reset=True)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode.kind == REFUSE:
            _reset(writer)
            return
        try:
            upstream = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        self.connections += 1
        pipe = _Pipe(self, (reader, writer), upstream)
        self._pipes.add(pipe)
        try:
            await pipe.run()
        finally:
            self._pipes.discard(pipe)

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await reader.readline()).decode("ascii", "replace")
            try:
                mode = parse_command(line)
            except ValueError as exc:
                answer = f"error {exc}"
            else:
                if mode is not None:
                    self.apply(mode)
                answer = (
                    "ok "
                    + orjson.dumps({**asdict(self.mode), "connections": self.connections}).decode()
                )
            writer.write(answer.encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()


def command(control: str, line: str, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, object]:
    """Send one command to a proxy's control address (``host:port``); the mode it is now in."""
    host, _, port = control.rpartition(":")
    _check_loopback(host)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(line.strip().encode("ascii") + b"\n")
        answer = sock.makefile("rb").readline().decode().strip()
    status, _, payload = answer.partition(" ")
    if status != "ok":
        raise ValueError(f"netproxy refused {line!r}: {payload}")
    return orjson.loads(payload)
