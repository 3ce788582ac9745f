"""Process control for the stacks' parts: start a ``zl-replica`` or vLLM's own server in a
session of its own, wait until it listens, stop or kill it with everything it started (a
replica over vLLM has an engine-core child, which must not outlive it), and find what a
process started. Knows nothing of stack kinds."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import orjson
import psutil

LISTENING: Final = re.compile(r"zl-replica listening on (https?://\S+)")
READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
POLL_S: Final = 0.05
# vLLM's own server: a bounded start (about 30 s alone on 2 cores; replicas start together).
VLLM_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"
VLLM_READY_TIMEOUT_S: Final = 240.0
VLLM_POLL_S: Final = 0.5
OFFLINE_ENV: Final = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def engine_args(engine: str, options: Mapping[str, Any]) -> list[str]:
    """``zl-replica`` arguments for an engine and its options (``--engine-option KEY=JSON``)."""
    args = ["--engine", engine]
    for key, value in options.items():
        args += ["--engine-option", f"{key}={orjson.dumps(value).decode()}"]
    return args


def spawn_replica(command: Sequence[str], log_path: str | Path) -> subprocess.Popen[bytes]:
    """Start one ``zl-replica`` process, its output appended to ``log_path``, in a session of
    its own (like a pod: what it starts, such as vLLM's engine core, goes with it)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process ``pid`` started, and what those started."""
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and everything it started, as a crashed pod takes its containers with it
    (a killed replica must not leave its vLLM engine core running); returns the pids killed."""
    procs = descendants(pid)
    with contextlib.suppress(psutil.NoSuchProcess):
        procs.insert(0, psutil.Process(pid))
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    deadline = time.monotonic() + 10.0  # gone or a zombie; reaping is its parent's business
    while any(_running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return [p.pid for p in procs]


def wait_listening(log_path: str | Path, proc: subprocess.Popen[bytes], deadline: float) -> str:
    """The URL a replica announces in its log once it listens; raises if it exits or times out."""
    path = Path(log_path)
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        match = LISTENING.search(text)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"zl-replica exited at start: {text[-2000:]}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"zl-replica did not listen in time: {text[-2000:]}")
        time.sleep(POLL_S)


def stop_pids(pids: Sequence[int], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGCONT (a paused process cannot exit), SIGTERM (it drains), then SIGKILL what hangs on,
    the processes each one started included."""
    procs = []
    started = []
    for pid in pids:
        started += descendants(pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.resume()
            proc.terminate()
            procs.append(proc)
    psutil.wait_procs(procs, timeout=timeout_s)
    psutil.wait_procs(started, timeout=1.0)  # children exit with their parent
    left = [p for p in [*procs, *started] if _running(p)]
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(left, timeout=5.0)


class ReplicaProcess:
    """One ``zl-replica`` process, its output in a log file, and the command that started it.

    ``command`` names the port the replica got, so chaos can start a killed replica again on the
    same address with the same command; :meth:`adopt` then makes that process this replica's.
    """

    def __init__(
        self,
        engine: str = "null",
        options: Mapping[str, Any] | None = None,
        *,
        port: int = 0,
        name: str | None = None,
        extra_args: Sequence[str] = (),
        tls: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
        log_path: str | Path | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        wait: bool = True,
    ) -> None:
        args = [*engine_args(engine, dict(options or {})), *extra_args]
        if tls is not None:
            args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        if name:
            args += ["--name", name]
        self._own_log = log_path is None
        if log_path is None:
            fd, tmp = tempfile.mkstemp(prefix="zl-replica-", suffix=".log")
            os.close(fd)
            log_path = tmp
        self.log_path = Path(log_path)
        if not self._own_log:
            self.log_path.unlink(missing_ok=True)  # an old "listening" line is not this one's
        self.command = self._command(args, port)
        self.url = ""
        self._proc = spawn_replica(self.command, self.log_path)
        self._pid = self._proc.pid
        self._args = args
        self._ready_timeout_s = ready_timeout_s
        if wait:
            self.wait_ready()

    @staticmethod
    def _command(args: Sequence[str], port: int) -> list[str]:
        return [sys.executable, "-m", "zerolayer.server", *args,
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    def wait_ready(self) -> str:
        """Wait until the replica listens; fix ``url`` and ``command`` to its port."""
        if self.url:
            return self.url
        try:
            self.url = wait_listening(
                self.log_path, self._proc, time.monotonic() + self._ready_timeout_s
            )
        except BaseException:
            self.kill()
            raise
        self.command = self._command(self._args, self.port)
        return self.url

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def adopt(self, pid: int) -> None:
        """This replica is now served by ``pid`` (started again with ``command``)."""
        self._pid = pid

    def alive(self) -> bool:
        """Running or stopped, not gone and not a zombie waiting to be reaped."""
        try:
            return psutil.Process(self._pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def kill(self) -> None:
        """SIGKILL, like a crashed pod (what it started goes too)."""
        kill_tree(self._pid)
        self._proc.poll()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGCONT (in case it was paused), SIGTERM (it drains), then SIGKILL if it lingers."""
        stop_pids(list(dict.fromkeys([self._pid, self._proc.pid])), timeout_s)
        self._proc.poll()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ReplicaProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _health_ok(url: str, timeout_s: float = 2.0) -> bool:
    import http.client

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class VllmServer:
    """One replica of the ``vllm-serve`` stack: vLLM's own OpenAI server
    (``python -m vllm.entrypoints.openai.api_server``) on a free loopback port, in its own
    process group (vLLM spawns an engine-core child), its output in ``log_path``.

    The engine flags come from :func:`serving.engine.vllm_engine.server_flags`, the same
    settings (and CPU defaults) the zero-layer replica's in-process engine gets.
    """

    def __init__(
        self,
        options: Mapping[str, Any],
        log_path: str | Path,
        *,
        ready_timeout_s: float = VLLM_READY_TIMEOUT_S,
    ) -> None:
        from serving.engine.vllm_engine import server_flags

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.command = [
            sys.executable, "-m", VLLM_SERVER_MODULE, *server_flags(dict(options)),
            # usage on every stream's last event: output tokens in the model's own count
            "--enable-force-include-usage",
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        self._ready_timeout_s = ready_timeout_s
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        self.pid = self._proc.pid

    def _log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]

    def wait_ready(self) -> str:
        """Wait (bounded) until ``/health`` answers 200; raise with the log's tail otherwise."""
        deadline = time.monotonic() + self._ready_timeout_s
        while not _health_ok(self.url):
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server {self.url} exited at start (status {self._proc.returncode}); "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"vLLM server {self.url} not healthy after {self._ready_timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
            time.sleep(VLLM_POLL_S)
        return self.url

    def alive(self) -> bool:
        return self._proc.poll() is None

    def children(self) -> list[int]:
        """The server's descendants (vLLM's engine core and its helpers)."""
        try:
            return [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def group(self) -> list[psutil.Process]:
        """Every live process of the server's process group (its session, started here)."""
        found = []
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(proc.pid) == self.pid:
                    found.append(proc)
        return found

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the whole process group, then SIGKILL to whatever of it is left."""
        procs = self.group()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        _, left = psutil.wait_procs(procs, timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        psutil.wait_procs(left, timeout=5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5.0)
