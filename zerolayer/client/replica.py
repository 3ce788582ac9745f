"""One replica as the client sees it: its URL, health state and lazily opened HTTP/2 connection.

Apart from the client object, so the callback path (``submit``) and the task path (``sdk``)
share it without importing each other.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

from zerolayer.client.h2conn import H2Connection
from zerolayer.client.health import Hysteresis


def split_url(url: str) -> tuple[str, int, bool]:
    """(host, port, tls) of an ``http://`` or ``https://`` replica URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"replica URL must be http:// or https://host:port, got {url!r}")
    tls = parts.scheme == "https"
    return parts.hostname, parts.port or (443 if tls else 80), tls


def default_tls() -> ssl.SSLContext:
    """A client TLS context offering ALPN ``h2``; trusts the system CA store."""
    ctx = ssl.create_default_context()
    ctx.set_alpn_protocols(["h2"])
    return ctx


class ReplicaEndpoint:
    """The SDK's view of one replica endpoint: its health state and its (lazy) connection.

    ``changed_ns``: when its up/down verdict last changed (wall-clock ns; 0 before the first
    change), stamped as it changes, so a reader that looks later (the chaos load's health log)
    still records when the SDK began routing around the replica or back to it."""

    __slots__ = (
        "_connecting",
        "changed_ns",
        "conn",
        "health",
        "host",
        "last_health",
        "port",
        "tls",
        "url",
    )

    def __init__(self, url: str, down_after: int, up_after: int) -> None:
        self.url = url
        self.host, self.port, self.tls = split_url(url)
        self.health = Hysteresis(down_after, up_after)
        self.changed_ns = 0
        self.conn: H2Connection | None = None
        self.last_health: dict[str, object] | None = None
        self._connecting: asyncio.Task[H2Connection] | None = None

    def observe(self, ok: bool) -> None:
        """One health verdict (a poll's) into the hysteresis."""
        if self.health.observe(ok):
            self.changed_ns = time.time_ns()

    def force_down(self) -> None:
        """Down at once (its connection died, or a request found it broken)."""
        if self.health.force_down():
            self.changed_ns = time.time_ns()

    async def connection(self, tls: ssl.SSLContext | None, timeout: float) -> H2Connection:
        """The live connection, opening one (shared by concurrent callers) when there is none."""
        conn = self.conn
        if conn is not None and conn.usable:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect(tls, timeout))
        task = self._connecting
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    async def _connect(self, tls: ssl.SSLContext | None, timeout: float) -> H2Connection:
        conn = await asyncio.wait_for(
            H2Connection.connect(
                self.host, self.port, tls=tls if self.tls else None, on_lost=self.force_down
            ),
            timeout,
        )
        self.conn = conn
        return conn
