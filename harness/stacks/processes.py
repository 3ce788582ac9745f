"""Process control for the stacks' parts: start a ``zl-replica`` or vLLM's own server in a
session of its own, wait until it listens, stop or kill it with everything it started (a
replica over vLLM has an engine-core child, which must not outlive it), and find what a
process started. Knows nothing of stack kinds."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import orjson
import psutil

from harness.errors import StartFailed
from serving.cpus import CpuLayout, engine_cores, pin_threads
from serving.ports import free_port

LISTENING: Final = re.compile(r"zl-replica listening on (https?://\S+)")
STOP_TIMEOUT_S: Final = 10.0
POLL_S: Final = 0.05
VLLM_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"
START_GUARD_S: Final = 600.0
"""A process start's hang guard, not a pace: a start that fails exits, and that is caught at
once; one still running is still starting (CI's loaded host took minutes to import a replica;
tests-under-load saw a sim replica not listening after the fixed 60 s it once had)."""
VLLM_READY_TIMEOUT_S: Final = START_GUARD_S
"""A vLLM engine's start (its replica's or vLLM's own server's). It takes about 30 s alone on 2
cores, but replicas start together, and CI saw one past 240 s beside the tests session."""
VLLM_POLL_S: Final = 0.5
PORT_TAKEN: Final = "address already in use"  # the bind error's text, lower-cased
PORT_TRIES: Final = 3
OFFLINE_ENV: Final = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def engine_args(engine: str, options: Mapping[str, Any]) -> list[str]:
    """``zl-replica`` arguments for an engine and its options (``--engine-option KEY=JSON``)."""
    args = ["--engine", engine]
    for key, value in options.items():
        args += ["--engine-option", f"{key}={orjson.dumps(value).decode()}"]
    return args


def spawn_replica(
    command: Sequence[str],
    log_path: str | Path,
    preexec: Callable[[], None] | None = None,
    cpus: CpuLayout | None = None,
    replica: int = 0,
) -> subprocess.Popen[bytes]:
    """Start one ``zl-replica`` process, its output appended to ``log_path``, in a session of
    its own (like a pod: what it starts, such as vLLM's engine core, goes with it); ``preexec``
    runs in the child before it starts (a node agent's fate-sharing); with ``cpus``, its engine
    computes on engine ``replica``'s cores (its front end moves to the rest once it listens)."""
    with open(log_path, "ab") as log, engine_cores(cpus, replica):
        return subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=preexec,
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


# An exception's last line in a traceback (``ValueError: ...``, ``pkg.mod.SomeError: ...``),
# also as vLLM's engine core prints it: ``(EngineCore pid=N) [ERROR 12-02 17:04:43 [f.py:1]] ``.
EXCEPTION_LINE: Final = re.compile(
    r"^(?:\([^)]*\)\s+)?(?:[A-Z]+ [\d-]+ [\d:]+ \[[^\]]*\]\s+)?"
    r"(?:[A-Za-z_][\w.]*\.)?(\w*(?:Error|Exception)): (.+)$"
)
ROOT_CAUSE_ABOVE: Final = "root cause above"  # vLLM's engine core failed; its error is above
REASON_CHARS: Final = 400


def _exception_lines(lines: list[str]) -> list[str]:
    """Each exception's line in the log, with the fields pydantic lists under a validation
    error (vLLM's config classes) joined on: ``ValidationError: ModelConfig: ...``."""
    found = []
    for i, line in enumerate(lines):
        match = EXCEPTION_LINE.match(line)
        if not match:
            continue
        text = f"{match.group(1)}: {match.group(2)}"
        if "validation error" in match.group(2):
            details = []
            for more in lines[i + 1 :]:
                if not more.startswith(" ") or more.strip().startswith("For further information"):
                    break
                details.append(more.strip().removeprefix("Value error, "))
            text = f"{match.group(1)}: {match.group(2).split(' for ')[-1]}: {' '.join(details)}"
        found.append(text)
    return found


def exit_reason(text: str, prog: str = "zl-replica") -> str:
    """Why a process exited at start, in one line, from its log: its own ``PROG: error:`` line
    (with the engine core's error when that line says to look above), else the last exception
    of a traceback, else its last line."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [
        line.split(": error: ", 1)[1] for line in lines if line.startswith(f"{prog}: error: ")
    ]
    exceptions = _exception_lines(lines)
    if errors:
        reason = errors[-1]
        causes = [e for e in exceptions if e not in reason and ROOT_CAUSE_ABOVE not in e]
        if ROOT_CAUSE_ABOVE in reason and causes:
            reason += f" Root cause: {causes[-1]}"
    elif exceptions:
        reason = exceptions[-1]
    else:
        reason = lines[-1] if lines else "no output"
    reason = " ".join(reason.split())
    return reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + "..."


def wait_listening(log_path: str | Path, proc: subprocess.Popen[bytes], deadline: float) -> str:
    """The URL a replica announces in its log once it listens; StartFailed (its reason and log)
    if it exits or times out first."""
    path = Path(log_path)
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        match = LISTENING.search(text)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            raise StartFailed("zl-replica", exit_reason(text), path)
        if time.monotonic() >= deadline:
            raise StartFailed("zl-replica", f"not listening in time; {exit_reason(text)}", path)
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
    ``host`` is the address it listens on (loopback here; a cluster node's own address when a
    node agent starts it), ``preexec`` runs in the child before it starts.
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
        ready_timeout_s: float = START_GUARD_S,
        wait: bool = True,
        host: str = "127.0.0.1",
        preexec: Callable[[], None] | None = None,
        cpus: CpuLayout | None = None,
        replica: int = 0,
    ) -> None:
        args = [*engine_args(engine, dict(options or {})), *extra_args]
        self.name = name or "zl-replica"
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
        self.host = host
        self.command = self._command(args, host, port)
        self.url = ""
        self.cpus = cpus
        self._proc = spawn_replica(self.command, self.log_path, preexec, cpus, replica)
        self._pid = self._proc.pid
        self._args = args
        self._ready_timeout_s = ready_timeout_s
        if wait:
            self.wait_ready()

    @staticmethod
    def _command(args: Sequence[str], host: str, port: int) -> list[str]:
        return [sys.executable, "-m", "zerolayer.server", *args,
                "--host", host, "--port", str(port)]  # fmt: skip

    def wait_ready(self) -> str:
        """Wait until the replica listens; fix ``url`` and ``command`` to its port."""
        if self.url:
            return self.url
        try:
            self.url = wait_listening(
                self.log_path, self._proc, time.monotonic() + self._ready_timeout_s
            )
        except StartFailed as exc:
            self.kill()
            raise StartFailed(f"replica {self.name}", exc.reason, exc.log) from None
        except BaseException:
            self.kill()
            raise
        self.command = self._command(self._args, self.host, self.port)
        if self.cpus is not None:  # its engine computes on the engine's cores still
            pin_threads(self._pid, self.cpus.rest)
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

    def children(self) -> list[int]:
        """The replica's live descendants (a vLLM engine core)."""
        return [p.pid for p in descendants(self._pid)]

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

    @staticmethod
    def stop_many(replicas: Sequence[ReplicaProcess]) -> None:
        """Stop every replica at once (they drain together), then each one's leftovers."""
        stop_pids([r.pid for r in replicas])
        for replica in replicas:
            replica.stop()

    def __enter__(self) -> ReplicaProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on TCP ``port``: the server answering there is
    the one started here, not another that took the port first."""
    try:
        sockets = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(s.status == psutil.CONN_LISTEN and s.laddr.port == port for s in sockets)


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
    settings (and CPU defaults) the zero-layer replica's in-process engine gets. ``host`` and
    ``preexec`` as for :class:`ReplicaProcess`.
    """

    def __init__(
        self,
        options: Mapping[str, Any],
        log_path: str | Path,
        *,
        ready_timeout_s: float = VLLM_READY_TIMEOUT_S,
        host: str = "127.0.0.1",
        preexec: Callable[[], None] | None = None,
        cpus: CpuLayout | None = None,
        replica: int = 0,
    ) -> None:
        self.log_path = Path(log_path)
        self._options, self._host, self._preexec = dict(options), host, preexec
        self._ready_timeout_s = ready_timeout_s
        self.cpus, self._replica = cpus, replica
        self._launch()

    def _launch(self) -> None:
        """Start the server on a port picked free now."""
        from serving.engine.vllm_engine import server_flags

        self.port = free_port(self._host)
        self.url = f"http://{self._host}:{self.port}"
        self.command = [
            sys.executable, "-m", VLLM_SERVER_MODULE, *server_flags(self._options),
            # usage on every stream's last event: output tokens in the model's own count
            "--enable-force-include-usage",
            "--host", self._host, "--port", str(self.port),
        ]  # fmt: skip
        with open(self.log_path, "wb") as log, engine_cores(self.cpus, self._replica):
            self._proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
                preexec_fn=self._preexec,
            )
        self.pid = self._proc.pid

    def _log_tail(self, chars: int = 20_000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]

    def wait_ready(self) -> str:
        """Wait (bounded) until the server itself listens on its port and ``/health`` answers
        200 there; raise with the log's tail otherwise. Its port was picked free before it
        started, and another process may bind it first (a replica on an ephemeral port, say):
        the server then exits, and is started again on a fresh port, up to PORT_TRIES times."""
        deadline = time.monotonic() + self._ready_timeout_s
        tries = 1
        while not (listens_on(self.pid, self.port) and _health_ok(self.url)):
            if self._proc.poll() is not None:
                tail = self._log_tail()
                if PORT_TAKEN in tail.lower() and tries < PORT_TRIES:
                    tries += 1
                    self._launch()
                    continue
                why = exit_reason(tail, "api_server")
                what = f"vLLM server {self.url}"
                raise StartFailed(what, f"exited ({self._proc.returncode}): {why}", self.log_path)
            if time.monotonic() >= deadline:
                why = exit_reason(self._log_tail(), "api_server")
                late = f"not healthy after {self._ready_timeout_s:.0f} s"
                raise StartFailed(f"vLLM server {self.url}", f"{late}; {why}", self.log_path)
            time.sleep(VLLM_POLL_S)
        if self.cpus is not None:  # its engine computes on the engine's cores still
            pin_threads(self.pid, self.cpus.rest)
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

    @staticmethod
    def stop_many(servers: Sequence[VllmServer]) -> None:
        for server in servers:
            server.stop()
