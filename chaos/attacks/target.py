"""The replica under attack: a fresh ``zl-replica`` process on 127.0.0.1, watched from outside.

Black box on purpose: the suite sees only what a client sees (sockets, ``GET /health``) and what
the kernel says of the process (``VmRSS`` in ``/proc/<pid>/status``), so it judges whatever the
replica's code is, today's or a fixed one.
"""

from __future__ import annotations

import contextlib
import http.client
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import orjson

from harness.stacks import ReplicaProcess
from zerolayer.server.limits import DEFAULT_LIMITS, Limits

SUITE_LIMITS: Final[Mapping[str, str]] = {
    "header_timeout_s": "1",
    "body_timeout_s": "1",
    "idle_timeout_s": "2",
    "send_stall_s": "1",
    "keepalive_s": "1",
    "connection_buffer_bytes": str(2 << 20),
}
"""The replica's limits for the suite (``zl-replica --limit``): every timeout shrunk to a second
or two so the timeout attacks end within seconds, and a 2 MiB per-connection memory budget so
the RSS bound (``outcome.RssBound``) is tight."""
RSS_SAMPLE_S: Final = 0.05
HEALTH_TIMEOUT_S: Final = 2.0
POLL_S: Final = 0.1
LOG_LEVEL: Final = "INFO"
"""The replica under attack logs what its limits did (a PING unanswered, a preface late, a
stream reset for an unread response), so a failed attack shows why a connection went."""
LOG_TAIL_LINES: Final = 20


class RssSampler:
    """Samples a process's resident set size in a thread until stopped: before, peak, after."""

    def __init__(self, pid: int) -> None:
        self.path = Path(f"/proc/{pid}/status")
        self.peak = self.last = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def read(self) -> int:
        """VmRSS in bytes; the last value seen once the process is gone."""
        try:
            text = self.path.read_text()
        except OSError:
            return getattr(self, "last", 0)
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return getattr(self, "last", 0)

    def sample(self) -> int:
        self.last = self.read()
        self.peak = max(self.peak, self.last)
        return self.last

    def restart_peak(self) -> int:
        """Start a new peak from now (the attack's, not the start-up's); returns RSS now."""
        self.peak = self.sample()
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_S):
            self.sample()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@cache
def replica_flags() -> frozenset[str]:
    """The options this checkout's ``zl-replica`` takes (from ``--help``): attacks that need a
    flag another change adds skip, with the reason, until it is there."""
    done = subprocess.run(
        [sys.executable, "-m", "zerolayer.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return frozenset(word.rstrip(",") for word in done.stdout.split() if word.startswith("--"))


class Target:
    """One ``zl-replica`` process started for one attack; stopped by :meth:`stop`."""

    def __init__(
        self,
        engine: str,
        limits: Mapping[str, str],
        extra_args: Sequence[str] = (),
    ) -> None:
        self.limits: Limits = DEFAULT_LIMITS.with_overrides(dict(limits))
        args = [arg for name, value in limits.items() for arg in ("--limit", f"{name}={value}")]
        self.process = ReplicaProcess(
            engine, extra_args=[*args, "--log-level", LOG_LEVEL, *extra_args]
        )
        parts = urlsplit(self.process.url)
        self.url = self.process.url
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.killed = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def get(self, path: str) -> tuple[int, bytes]:
        """One HTTP/1.1 GET on a connection of its own: (status, body)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=HEALTH_TIMEOUT_S)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def health(self) -> dict[str, Any]:
        status, body = self.get("/health")
        if status != 200:
            raise OSError(f"/health answered {status}")
        payload = orjson.loads(body)
        if not isinstance(payload, dict):
            raise OSError("/health is not a JSON object")
        return payload

    def settle(self, timeout_s: float) -> int | None:
        """``active`` once it is 0, or its last value when ``timeout_s`` passes first (None
        if ``/health`` never answered)."""
        deadline = time.monotonic() + timeout_s
        active: int | None = None
        while True:
            with contextlib.suppress(OSError, KeyError, ValueError, TypeError):
                active = int(self.health()["active"])
            if active == 0 or time.monotonic() >= deadline:
                return active
            time.sleep(POLL_S)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
        """The last ``lines`` lines of the replica's output (read before :meth:`stop`, which
        removes the file)."""
        try:
            text = self.process.log_path.read_text(errors="replace")
        except OSError:
            return ()
        return tuple(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crash would (the accounting attack)."""
        self.killed = True
        self.process.kill()

    def stop(self) -> None:
        self.process.stop()
