"""The one way a stack under test is stood up, watched, talked to and stopped.

Used by ``zl-bench run``, chaos (profile D), the overhead benchmark and the tests alike. A
zero-layer replica is its own ``zl-replica`` process (as deployed: the loader and the servers
compete for the cores as they would in production, and chaos can signal it); the baseline is the
Ray Serve deployment from ``baselines.rayserve``. Either stack can also be one that is already
running elsewhere (``StackSpec.urls``): then nothing is started or stopped here, and
:func:`stand_up` only checks that it answers.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import orjson
import psutil

from harness.certs import self_signed
from harness.telemetry import Component, EngineTarget

if TYPE_CHECKING:
    from baselines.rayserve import BaselineHandle
    from zerolayer.client import Http1Client, ZeroLayerClient

LISTENING: Final = re.compile(r"zl-replica listening on (https?://\S+)")
READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
REACH_TIMEOUT_S: Final = 2.0
STATS_DIR: Final = "engine-stats"
STATS_WAIT_S: Final = 10.0
POLL_S: Final = 0.05
# Serve's actor names -> the telemetry roles (harness.telemetry.process.ROLES).
BASELINE_ROLES: Final = {"ingress": "orchestrator"}


class StackName(StrEnum):
    """The two stacks a run compares."""

    ZEROLAYER = "zerolayer"
    BASELINE = "baseline"


STACKS: Final = tuple(s.value for s in StackName)


@dataclass(frozen=True)
class StackSpec:
    """What to stand up: which stack, over which engine, how many engine replicas.

    ``tls``: zero-layer replicas serve TLS with ALPN h2/http1.1 (k6 needs that for HTTP/2).
    ``urls`` non-empty: an external stack, checked for reachability but never started or stopped.
    """

    name: StackName
    engine: str = "sim"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    replicas: int = 2
    tls: bool = False
    urls: tuple[str, ...] = ()
    ray_address: str | None = None


class StackUnreachable(Exception):
    """An external stack's URL does not answer; the message names the URL."""


def engine_args(engine: str, options: Mapping[str, Any]) -> list[str]:
    """``zl-replica`` arguments for an engine and its options (``--engine-option KEY=JSON``)."""
    args = ["--engine", engine]
    for key, value in options.items():
        args += ["--engine-option", f"{key}={orjson.dumps(value).decode()}"]
    return args


def spawn_replica(command: Sequence[str], log_path: str | Path) -> subprocess.Popen[bytes]:
    """Start one ``zl-replica`` process, its output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


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
    """SIGCONT (a paused process cannot exit), SIGTERM (it drains), then SIGKILL what hangs on."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.resume()
            proc.terminate()
            procs.append(proc)
    _, left = psutil.wait_procs(procs, timeout=timeout_s)
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
        """SIGKILL, like a crashed pod."""
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(self._pid)
            proc.kill()
            proc.wait(10)
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


def client_tls(ca: Path | None, alpn: Sequence[str] = ("h2",)) -> ssl.SSLContext | None:
    """A client context that trusts exactly the stack's certificate (None without TLS)."""
    if ca is None:
        return None
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(list(alpn))
    return ctx


def client_for(
    protocol: str, urls: Sequence[str], tls_ca: Path | None = None, **options: Any
) -> ZeroLayerClient | Http1Client:
    """The SDK client for a stack's URLs: ``h2`` routes over all of them with the zero-layer SDK,
    ``http1`` goes to the one front door. ``Stack.open_client`` and chaos (whose load goes
    through its fault proxy) build every client here."""
    from zerolayer.client import Http1Client, ZeroLayerClient

    tls = client_tls(tls_ca, ("h2",) if protocol == "h2" else ("http/1.1",))
    if tls is not None:
        options.setdefault("tls", tls)
    if protocol == "h2":
        return ZeroLayerClient(list(urls), **options)
    if protocol == "http1":
        if len(urls) != 1:
            raise ValueError(f"an HTTP/1.1 client takes exactly one URL, got {list(urls)}")
        return Http1Client(urls[0], **options)
    raise ValueError(f"protocol must be h2 or http1, got {protocol!r}")


def check_reachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A TCP connect to the URL's host and port; raises StackUnreachable naming the URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StackUnreachable(f"{url} is not an http:// or https:// URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        raise StackUnreachable(f"{url} is not reachable: {exc}") from exc


class Stack:
    """A stack as everything else sees it: where to send, which processes and engines to watch.

    A context manager; :meth:`close` stops what :func:`stand_up` started (nothing, if external).
    """

    def __init__(
        self,
        spec: StackSpec,
        urls: Sequence[str],
        *,
        metadata: Mapping[str, Any],
        replicas: Sequence[ReplicaProcess] = (),
        baseline: BaselineHandle | None = None,
        tls_ca: Path | None = None,
        stats_dir: Path | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.urls = list(urls)
        self.protocol = "h2" if spec.name is StackName.ZEROLAYER else "http1"
        self.external = bool(spec.urls)
        self.metadata = dict(metadata)
        self.tls_ca = tls_ca
        self.replicas = list(replicas)
        self.baseline = baseline
        self.stats_dir = stats_dir

    def pids(self) -> dict[str, list[int]]:
        """Live process ids by telemetry role (``replica``; or ``orchestrator``, ``proxy``,
        ``controller``, ``engine`` for the baseline, asked of Ray so replaced actors count)."""
        if self.baseline is not None:
            pids = self.baseline.pids()
            return {BASELINE_ROLES.get(role, role): list(p) for role, p in pids.items()}
        if self.external:
            return {}
        return {"replica": [r.pid for r in self.replicas if r.alive()]}

    def components(self) -> list[Component]:
        """Every process of the stack as a telemetry component."""
        return [
            Component(f"{self.name}-{role}-{i}", pid, role, self.name)
            for role, pids in self.pids().items()
            for i, pid in enumerate(pids)
        ]

    def engine_targets(self) -> list[EngineTarget]:
        """Telemetry sources for the stack's engines: each zero-layer replica's ``/metrics``;
        the stats files the baseline's engine replicas publish (waited for briefly)."""
        if self.name is StackName.ZEROLAYER:
            return [
                EngineTarget.metrics(f"zl-{i}", self.name, f"{url}/metrics", tls_ca=self.tls_ca)
                for i, url in enumerate(self.urls)
            ]
        if self.stats_dir is None:
            return []
        return [
            EngineTarget.stats_file(f"serve-{i}", self.name, path)
            for i, path in enumerate(self._stats_files())
        ]

    def _stats_files(self) -> list[Path]:
        assert self.stats_dir is not None
        deadline = time.monotonic() + STATS_WAIT_S
        files = sorted(self.stats_dir.glob("engine-stats-*.jsonl"))
        while len(files) < self.spec.replicas and time.monotonic() < deadline:
            time.sleep(0.2)
            files = sorted(self.stats_dir.glob("engine-stats-*.jsonl"))
        return files

    def open_client(self, **options: Any) -> ZeroLayerClient | Http1Client:
        """The SDK client for this stack (options go to the client's constructor)."""
        return client_for(self.protocol, self.urls, self.tls_ca, **options)

    def replica_restarted(self, url: str, pid: int) -> None:
        """The replica at ``url`` was started again (same command, same port) as ``pid``."""
        for replica in self.replicas:
            if replica.url == url:
                replica.adopt(pid)

    def close(self) -> None:
        if self.replicas:
            stop_pids([r.pid for r in self.replicas])
            for replica in self.replicas:
                replica.stop()
        if self.baseline is not None:
            self.baseline.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stand_up_zerolayer(spec: StackSpec, workdir: Path) -> Stack:
    tls_ca = None
    tls = None
    if spec.tls:
        tls = self_signed(workdir / "tls")
        tls_ca = tls[0]
    started: list[ReplicaProcess] = []
    try:
        for i in range(spec.replicas):
            started.append(
                ReplicaProcess(
                    spec.engine,
                    spec.engine_options,
                    name=f"zl-{i}",
                    tls=tls,
                    log_path=workdir / f"zl-replica-{i}.log",
                    wait=False,
                )
            )
        for replica in started:
            replica.wait_ready()
    except BaseException:
        stop_pids([r.pid for r in started])
        raise
    metadata = {
        "impl": "zl-replica processes",
        "replicas": spec.replicas,
        "engine": spec.engine,
        "engine_options": dict(spec.engine_options),
        "tls": spec.tls,
    }
    urls = [r.url for r in started]
    return Stack(spec, urls, metadata=metadata, replicas=started, tls_ca=tls_ca)


def _stand_up_baseline(spec: StackSpec, workdir: Path) -> Stack:
    from baselines.rayserve.standup import start_baseline

    stats_dir = workdir / STATS_DIR
    stats_dir.mkdir(parents=True, exist_ok=True)
    handle = start_baseline(
        engine=spec.engine,
        replicas=spec.replicas,
        engine_options=dict(spec.engine_options),
        ray_address=spec.ray_address,
        stats_dir=str(stats_dir),
    )
    metadata = {"impl": "ray serve", **handle.metadata}
    return Stack(spec, [handle.url], metadata=metadata, baseline=handle, stats_dir=stats_dir)


def stand_up(spec: StackSpec, workdir: Path) -> Stack:
    """Start the stack (or, for an external one, check every URL answers) and return it.

    Logs, the TLS certificate and the baseline's engine stats go under ``workdir``.
    """
    if spec.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {spec.replicas}")
    if spec.urls:
        for url in spec.urls:
            try:
                check_reachable(url)
            except StackUnreachable as exc:
                raise StackUnreachable(f"{spec.name} stack: {exc}") from exc.__cause__
        metadata = {"impl": "external", "urls": list(spec.urls)}
        return Stack(spec, spec.urls, metadata=metadata)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if spec.name is StackName.ZEROLAYER:
        return _stand_up_zerolayer(spec, workdir)
    return _stand_up_baseline(spec, workdir)
