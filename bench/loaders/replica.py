"""Start a real ``zl-replica`` process for a loader run or test, and always stop it.

The replica is its own process (not a coroutine in the loader's loop) so loader and server
compete for the cores as they would in a deployment, and so a test can SIGSTOP it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

LISTENING = re.compile(r"zl-replica listening on (https?://[\w.\[\]:]+)")
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ReplicaProcess:
    """A running replica: its URL and process, for signals (pause, kill) in tests."""

    url: str
    process: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.process.pid

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@contextlib.contextmanager
def spawn_replica(
    engine: str = "null",
    *,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[ReplicaProcess]:
    """Run ``python -m zerolayer.server --engine ENGINE --port 0`` until the block exits."""
    cmd = [
        sys.executable,
        "-m",
        "zerolayer.server",
        "--engine",
        engine,
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        *extra_args,
    ]
    if tls_cert is not None and tls_key is not None:
        cmd += ["--tls-cert", str(tls_cert), "--tls-key", str(tls_key)]
    log = tempfile.NamedTemporaryFile("w+", prefix="zl-replica-", suffix=".log")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while url is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            match = LISTENING.search(Path(log.name).read_text())
            url = match.group(1) if match else None
        if url is None:
            raise RuntimeError(f"zl-replica did not start: {Path(log.name).read_text()[-2000:]}")
        yield ReplicaProcess(url, proc)
    finally:
        _stop(proc)
        log.close()
