"""The one way a stack under test is stood up, watched, talked to and stopped.

Used by ``zl-bench run``, chaos (profile D), the overhead benchmark and the tests alike. A
zero-layer replica is its own ``zl-replica`` process (as deployed: the loader and the servers
compete for the cores as they would in production, and chaos can signal it); the baseline is the
Ray Serve deployment from ``baselines.rayserve``; ``vllm-serve`` (the peer, ``--engine vllm``
only) is vLLM's own OpenAI server, one process group per replica, load spread over them by the
SDK's ring. Any stack can also be one that is already running elsewhere (``StackSpec.urls``):
then nothing is started or stopped here, and :func:`stand_up` only checks that it answers.
With ``StackSpec.credentials`` (the bench's ``--auth``) the zero-layer replicas and the baseline
start with a key file (``--api-keys``) and every client of the stack sends its tenant's key.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
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
from typing import TYPE_CHECKING, Any, Final, Unpack, cast
from urllib.parse import urlsplit

import orjson
import psutil

from baselines.rayserve.config import BaselineRouter, orchestrator_router, parse_router
from harness.certs import self_signed
from harness.telemetry import Component, EngineTarget
from zerolayer.client.ring import DEFAULT_VNODES, HashRing

if TYPE_CHECKING:
    from baselines.rayserve.standup import ServeHandle
    from zerolayer.client import Http1Client, ZeroLayerClient
    from zerolayer.client.stream import Completion, Stream
    from zerolayer.client.wire import RequestFields

LISTENING: Final = re.compile(r"zl-replica listening on (https?://\S+)")
READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
REACH_TIMEOUT_S: Final = 2.0
STATS_DIR: Final = "engine-stats"
STATS_WAIT_S: Final = 10.0
POLL_S: Final = 0.05
# The baselines' process roles -> the telemetry roles (harness.telemetry.process.ROLES): the
# orchestrator's ingress, and Ray Serve LLM's ingress, router and vLLM engine-core children.
BASELINE_ROLES: Final = {
    "ingress": "orchestrator",
    "router": "orchestrator",
    "engine_core": "engine",
}
# vLLM's own server: a bounded start (about 30 s alone on 2 cores; replicas start together).
VLLM_SERVER_MODULE: Final = "vllm.entrypoints.openai.api_server"
VLLM_READY_TIMEOUT_S: Final = 240.0
VLLM_POLL_S: Final = 0.5
LLM_BASELINE_IMPL: Final = "ray serve llm"
OFFLINE_ENV: Final = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class StackName(StrEnum):
    """The stacks a run can compare: the system under test, the baseline, and the peer
    ``vllm-serve`` (vLLM's own OpenAI server, real vLLM engine only)."""

    ZEROLAYER = "zerolayer"
    BASELINE = "baseline"
    VLLM_SERVE = "vllm-serve"


# The stacks a run compares by default and chaos knows faults for; vllm-serve is asked for by name.
STACKS: Final = (StackName.ZEROLAYER.value, StackName.BASELINE.value)
ALL_STACKS: Final = tuple(s.value for s in StackName)
# Stacks whose clients pick the replica (the SDK's ring over every URL); others have a front door.
ROUTED: Final = frozenset({StackName.ZEROLAYER, StackName.VLLM_SERVE})


@dataclass(frozen=True)
class Credentials:
    """A key file the stacks start with (``--api-keys``, ``serving.auth``) and the key
    each tenant's requests carry (``keys``: tenant -> API key, the first one also the key of
    requests that name no tenant: warm-up, probes)."""

    key_file: Path
    keys: Mapping[str, str] = field(repr=False)  # secrets: never in a log line

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("credentials need at least one tenant's key")

    @property
    def default_key(self) -> str:
        return next(iter(self.keys.values()))

    def key_for(self, tenant: str) -> str:
        """The key of ``tenant``'s requests (the default key for a tenant with none)."""
        return self.keys.get(tenant) or self.default_key

    def headers(self) -> dict[str, str]:
        """tenant -> its ``authorization`` header value, for a loader in another process."""
        return {tenant: f"Bearer {key}" for tenant, key in self.keys.items()}


@dataclass(frozen=True)
class StackSpec:
    """What to stand up: which stack, over which engine, how many engine replicas.

    ``tls``: zero-layer replicas serve TLS with ALPN h2/http1.1 (k6 needs that for HTTP/2).
    ``urls`` non-empty: an external stack, checked for reachability but never started or stopped.
    ``baseline_router``: the baseline's request router (:func:`baseline_router`; ``None``: that
    baseline's own default). ``credentials``: authentication on (see the module
    docstring); the stacks that check no keys (Ray Serve LLM, vllm-serve) ignore it and say so
    in their metadata.
    """

    name: StackName
    engine: str = "sim"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    replicas: int = 2
    tls: bool = False
    urls: tuple[str, ...] = ()
    ray_address: str | None = None
    baseline_router: BaselineRouter | None = None
    credentials: Credentials | None = None


class StackUnreachable(Exception):
    """An external stack's URL does not answer; the message names the URL."""


def baseline_router(spec: StackSpec) -> BaselineRouter:
    """The router the baseline of ``spec`` runs: the one asked for, else that baseline's own
    default (the orchestrator: consistent-hash, as DESIGN.md asks; Ray Serve LLM over ``vllm``:
    pow2, Serve's default). ValueError (one line) for one that baseline cannot run."""
    if spec.engine == "vllm":
        return parse_router(spec.baseline_router or BaselineRouter.POW2)
    return orchestrator_router(spec.baseline_router or BaselineRouter.CONSISTENT_HASH)


def check_baseline_router(spec: StackSpec) -> None:
    """ValueError (one line) for a router the baseline of ``spec`` cannot run, or one asked of a
    baseline already running (its router is its own)."""
    if not spec.urls:
        baseline_router(spec)
    elif spec.baseline_router is not None:
        raise ValueError(
            f"baseline router {spec.baseline_router}: a running baseline ({spec.urls[0]}) keeps "
            "the router it was started with"
        )


def check_spec(spec: StackSpec) -> None:
    """Raise ValueError (one line) for a spec no stack can serve: too few replicas, a baseline
    router that baseline cannot run, or ``vllm-serve`` over an engine other than ``vllm``.
    ``stand_up`` checks this first."""
    if spec.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {spec.replicas}")
    if spec.name is StackName.BASELINE:
        check_baseline_router(spec)
    if spec.name is StackName.VLLM_SERVE and spec.engine != "vllm" and not spec.urls:
        raise ValueError(
            f"the vllm-serve stack is vLLM's own server: it needs --engine vllm, "
            f"not {spec.engine!r}"
        )


def openai_server_body(engine_options: Mapping[str, Any]) -> dict[str, Any]:
    """Body fields for a stack whose front is vLLM's OpenAI server code (``vllm-serve``, Ray
    Serve LLM) so it serves what the zero-layer replica's engine serves: exactly ``max_tokens``
    (``ignore_eos``), the engine's temperature, and usage in the stream's last event."""
    from serving.engine.vllm_engine import VllmEngineConfig

    return {
        "ignore_eos": True,
        "temperature": VllmEngineConfig(**engine_options).temperature,
        "stream_options": {"include_usage": True},
    }


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


def client_tls(ca: Path | None, alpn: Sequence[str] = ("h2",)) -> ssl.SSLContext | None:
    """A client context that trusts exactly the stack's certificate (None without TLS)."""
    if ca is None:
        return None
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(list(alpn))
    return ctx


class Http1Router:
    """HTTP/1.1 to several replicas, each request to the one the SDK's ring picks: keyed by its
    session, or (like the SDK, which places a sessionless request by its own request id) by a
    fresh id. One ``Http1Client`` per replica URL; ``stream``/``complete`` as theirs."""

    def __init__(self, clients: Sequence[Http1Client]) -> None:
        self.clients = {c.url: c for c in clients}
        self.ring = HashRing(dict.fromkeys(self.clients), DEFAULT_VNODES)
        self._ids = itertools.count()
        self._prefix = f"r{os.getpid():x}-"

    def pick(self, session: str = "") -> Http1Client:
        """The client of the replica the ring gives ``session`` (or a fresh id)."""
        return self.clients[self.ring.lookup(session or f"{self._prefix}{next(self._ids)}")]

    def stream(self, **fields: Unpack[RequestFields]) -> Stream:
        return self.pick(fields.get("session", "")).stream(**fields)

    async def complete(self, **fields: Unpack[RequestFields]) -> Completion:
        return await self.pick(fields.get("session", "")).complete(**fields)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def __aenter__(self) -> Http1Router:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def client_for(
    protocol: str, urls: Sequence[str], tls_ca: Path | None = None, **options: Any
) -> ZeroLayerClient | Http1Client:
    """The SDK client for a stack's URLs: ``h2`` routes over all of them with the zero-layer SDK,
    ``http1`` goes to the one front door. ``Stack.open_client`` (which puts an
    :class:`Http1Router` over one of these per replica for vllm-serve) and chaos (whose load goes
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
        baseline: ServeHandle | None = None,
        tls_ca: Path | None = None,
        stats_dir: Path | None = None,
        servers: Sequence[VllmServer] = (),
        model: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
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
        self.servers = list(servers)
        # What every request body names and adds (the served model id; vLLM's ignore_eos ...).
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.credentials = spec.credentials

    def pids(self) -> dict[str, list[int]]:
        """Live process ids by telemetry role: ``replica``, and their children (vLLM's engine
        cores) as ``engine``, for zero-layer and vllm-serve; ``orchestrator``, ``proxy``,
        ``controller``, ``engine`` for the baselines, asked of Ray so replaced actors count."""
        if self.servers:
            return {
                "replica": [s.pid for s in self.servers if s.alive()],
                "engine": [pid for s in self.servers for pid in s.children()],
            }
        if self.baseline is not None:
            merged: dict[str, list[int]] = {}
            for role, found in self.baseline.pids().items():  # several roles map to one
                merged.setdefault(BASELINE_ROLES.get(role, role), []).extend(found)
            return merged
        if self.external:
            return {}
        live = [r.pid for r in self.replicas if r.alive()]
        engines = [p.pid for pid in live for p in descendants(pid)]  # vLLM's engine cores
        return {"replica": live, "engine": engines} if engines else {"replica": live}

    def components(self) -> list[Component]:
        """Every process of the stack as a telemetry component."""
        return [
            Component(f"{self.name}-{role}-{i}", pid, role, self.name)
            for role, pids in self.pids().items()
            for i, pid in enumerate(pids)
        ]

    def engine_targets(self) -> list[EngineTarget]:
        """Telemetry sources for the stack's engines: each zero-layer replica's ``/metrics``;
        each vLLM server's own ``/metrics``; the stats files the baseline's engine replicas publish
        (waited for briefly)."""
        if self.name in ROUTED:
            prefix = "zl" if self.name is StackName.ZEROLAYER else "vllm"
            return [
                EngineTarget.metrics(
                    f"{prefix}-{i}", self.name, f"{url}/metrics", tls_ca=self.tls_ca
                )
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

    def open_client(self, **options: Any) -> ZeroLayerClient | Http1Client | Http1Router:
        """The SDK client for this stack (options go to the client's constructor, which by
        default names the stack's model and adds its extra body fields); for vllm-serve with
        several replicas an :class:`Http1Router` over one client each."""
        options.setdefault("model", self.model)
        options.setdefault("extra_body", self.extra_body)
        if self.credentials is not None:
            options.setdefault("api_key", self.credentials.default_key)
        if self.protocol == "http1" and len(self.urls) > 1:
            clients = [client_for("http1", [url], self.tls_ca, **options) for url in self.urls]
            return Http1Router([cast("Http1Client", c) for c in clients])
        return client_for(self.protocol, self.urls, self.tls_ca, **options)

    def body_fields(self) -> dict[str, Any]:
        """What a loader in another process (k6, locust) adds to every request body: the
        stack's model id and extra fields, as :meth:`open_client`'s client does."""
        return ({"model": self.model} if self.model else {}) | self.extra_body

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
        for server in self.servers:
            server.stop()

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
    auth_args = [] if spec.credentials is None else ["--api-keys", str(spec.credentials.key_file)]
    # A real vLLM engine starts in ~30 s alone on 2 cores; replicas start together.
    ready_timeout_s = VLLM_READY_TIMEOUT_S if spec.engine == "vllm" else READY_TIMEOUT_S
    try:
        for i in range(spec.replicas):
            started.append(
                ReplicaProcess(
                    spec.engine,
                    spec.engine_options,
                    name=f"zl-{i}",
                    extra_args=auth_args,
                    tls=tls,
                    log_path=workdir / f"zl-replica-{i}.log",
                    ready_timeout_s=ready_timeout_s,
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
        "label": f"zero-layer: zl-replica x{spec.replicas}, {spec.engine} engine",
        "replicas": spec.replicas,
        "engine": spec.engine,
        "engine_options": dict(spec.engine_options),
        "tls": spec.tls,
        "auth": auth_label(spec),
    }
    urls = [r.url for r in started]
    return Stack(spec, urls, metadata=metadata, replicas=started, tls_ca=tls_ca)


def _stand_up_baseline(spec: StackSpec, workdir: Path) -> Stack:
    if spec.engine == "vllm":
        return _stand_up_llm_baseline(spec)
    from baselines.rayserve.standup import start_baseline

    stats_dir = workdir / STATS_DIR
    stats_dir.mkdir(parents=True, exist_ok=True)
    handle = start_baseline(
        engine=spec.engine,
        replicas=spec.replicas,
        engine_options=dict(spec.engine_options),
        router=baseline_router(spec),
        ray_address=spec.ray_address,
        stats_dir=str(stats_dir),
        api_keys=None if spec.credentials is None else str(spec.credentials.key_file),
    )
    metadata = {
        "impl": "ray serve",
        "auth": auth_label(spec),
        "label": f"Ray Serve orchestrator (ours) x{spec.replicas}, {spec.engine} engine, "
        f"{handle.config.router} router",
        **handle.metadata,
    }
    return Stack(spec, [handle.url], metadata=metadata, baseline=handle, stats_dir=stats_dir)


def _stand_up_llm_baseline(spec: StackSpec) -> Stack:
    """Ray Serve LLM over vLLM: the baseline users deploy for a real engine. Its engines publish
    no stats file, so the stack has no engine telemetry targets (vLLM's metrics go to Ray's)."""
    from baselines.rayserve_llm import start_llm_baseline

    options = dict(spec.engine_options)
    handle = start_llm_baseline(
        model=str(options.get("model", "")),
        replicas=spec.replicas,
        engine_options=options,
        router=baseline_router(spec),
        ray_address=spec.ray_address,
    )
    metadata = {
        "impl": LLM_BASELINE_IMPL,
        "label": f"Ray Serve LLM {handle.metadata['ray_version']} x{spec.replicas}, "
        f"{handle.config.router} router, vllm engine",
        "auth": auth_label(spec, checks_keys=False),
        **handle.metadata,
    }
    return Stack(
        spec,
        [handle.url],
        metadata=metadata,
        baseline=handle,
        model=handle.config.model_id,
        extra_body=openai_server_body(options),
    )


def _stand_up_vllm_serve(spec: StackSpec, workdir: Path) -> Stack:
    started: list[VllmServer] = []
    try:
        for i in range(spec.replicas):  # all start at once, then each is waited for
            started.append(VllmServer(spec.engine_options, workdir / f"vllm-serve-{i}.log"))
        for server in started:
            server.wait_ready()
    except BaseException:
        for server in started:
            server.stop()
        raise
    metadata = {
        "impl": "vllm api_server processes",
        "label": f"vLLM's own server x{spec.replicas}",
        "replicas": spec.replicas,
        "engine": spec.engine,
        "engine_options": dict(spec.engine_options),
        "command": started[0].command[:-2],
        "auth": auth_label(spec, checks_keys=False),
    }
    return Stack(
        spec,
        [s.url for s in started],
        metadata=metadata,
        servers=started,
        model=str(spec.engine_options.get("model", "")),
        extra_body=openai_server_body(spec.engine_options),
    )


def auth_label(spec: StackSpec, checks_keys: bool = True) -> str:
    """What a stack's metadata says of authentication: off, on (the key file's name), or asked
    for of a stack that checks no keys (Ray Serve LLM, vllm-serve), which runs without."""
    if spec.credentials is None:
        return "off"
    if not checks_keys:
        return "off (asked for; this stack checks no API keys)"
    return f"api keys ({spec.credentials.key_file.name})"


def stand_up(spec: StackSpec, workdir: Path) -> Stack:
    """Start the stack (or, for an external one, check every URL answers) and return it.

    Logs, the TLS certificate and the baseline's engine stats go under ``workdir``. Raises
    ValueError for a spec :func:`check_spec` refuses (vllm-serve needs ``engine="vllm"``).
    """
    check_spec(spec)
    if spec.urls:
        for url in spec.urls:
            try:
                check_reachable(url)
            except StackUnreachable as exc:
                raise StackUnreachable(f"{spec.name} stack: {exc}") from exc.__cause__
        metadata = {"impl": "external", "label": "external", "urls": list(spec.urls)}
        return Stack(spec, spec.urls, metadata=metadata)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if spec.name is StackName.ZEROLAYER:
        return _stand_up_zerolayer(spec, workdir)
    if spec.name is StackName.VLLM_SERVE:
        return _stand_up_vllm_serve(spec, workdir)
    return _stand_up_baseline(spec, workdir)
