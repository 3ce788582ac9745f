"""A stack as everything else sees it (:class:`Stack`), and what each kind of stack answers
(:class:`StackKind`): how it stands up, its processes by role, its engines' telemetry, its
client, when it is whole again, how a killed part comes back, which faults apply to it.

Callers ask the kind (``stack.kind``, or ``harness.stacks.registry.stack_kind`` for a name),
never compare a stack's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from harness.stacks.clients import Http1Router, client_for
from harness.stacks.processes import stop_pids
from harness.stacks.spec import StackName, StackSpec
from harness.telemetry import Component, EngineTarget
from serving.engine.settings import EngineSettings

if TYPE_CHECKING:
    from baselines.rayserve.standup import ServeHandle
    from harness.stacks.processes import ReplicaProcess, VllmServer
    from zerolayer.client import Http1Client, ZeroLayerClient


class Fault(StrEnum):
    """The faults chaos (profile D) injects, as its actions name them in the journal."""

    KILL = "kill"
    PAUSE = "pause"
    DELAY = "delay"
    PARTITION = "partition"
    CPU_STRESS = "cpu_stress"
    KV_PRESSURE = "kv_pressure"


ALL_FAULTS: frozenset[Fault] = frozenset(Fault)


class Restore(StrEnum):
    """How a killed engine replica comes back."""

    BY_COMMAND = "by-command"  # chaos starts it again with its own command, on its own port
    BY_CONTROLLER = "by-controller"  # Serve's controller replaces the actor (a new pid)
    NONE = "none"  # nothing here brings it back (no faults are defined for the kind)


class StackKind(ABC):
    """One kind of stack. Class attributes answer the questions with fixed answers:

    ``name``: the stack it is (several kinds may share one: the baselines); ``protocol``: what
    its clients speak (``h2`` or ``http1``); ``client_routes``: the client picks the replica
    (the SDK's ring over every replica URL), so it sees which replica answered, load can be
    pinned to one replica, and the fault proxy stands in front of one replica; otherwise one
    front door carries all traffic. ``engine_role``: the process role of its engine replicas.
    ``faults``: the faults profile D applies to it. ``restore``: how a killed part comes back.
    ``app``: the Ray Serve application whose actors are its processes (``""``: none);
    ``ready_path``: what answers 200 on its front once it serves.
    """

    name: StackName
    summary: str
    protocol: str = "http1"
    client_routes: bool = False
    engine_role: str = "engine"
    faults: frozenset[Fault] = frozenset()
    restore: Restore = Restore.NONE
    app: str = ""
    ready_path: str = "/health"

    def check(self, spec: StackSpec) -> None:
        """ValueError (one line) for a spec this kind cannot serve; nothing by default."""
        del spec

    @abstractmethod
    def stand_up(self, spec: StackSpec, workdir: Path) -> Stack:
        """Start the stack (logs and certificates under ``workdir``) and return it, serving."""

    @abstractmethod
    def pids(self, stack: Stack) -> dict[str, list[int]]:
        """Live process ids of ``stack`` by telemetry role."""

    @abstractmethod
    def engine_targets(self, stack: Stack) -> list[EngineTarget]:
        """Telemetry sources for the engines of ``stack``."""

    def engine_settings(self, stack: Stack) -> dict[str, EngineSettings]:
        """Each engine replica's effective settings as its engine reports them, by replica name
        (named as its telemetry target is); empty where this kind has no way to read them."""
        del stack
        return {}

    def cluster_pids(self) -> dict[str, list[int]] | None:
        """Process ids by chaos role asked of the cluster the stack runs on, when this process
        is attached to it (its controller replaces lost parts with new pids); None: there is
        no such cluster, the pids written down at stand-up are the truth."""
        return None

    def is_whole(self, pids: Mapping[str, Sequence[int]], engine_replicas: int) -> bool:
        """Every engine replica, and the front where there is one, is alive (``pids``: the live
        processes by chaos role)."""
        return len(pids.get(self.engine_role, ())) >= engine_replicas

    def restart(self, command: Sequence[str], log_path: str | Path) -> int:
        """Start a killed part again with ``command``; the new pid. Only a kind whose parts
        come back by command (:attr:`restore`) can."""
        del command, log_path
        raise ValueError(f"the {self.name} stack's parts are not restarted by command")


class Stack:
    """A stack as everything else sees it: where to send, which processes and engines to watch.

    ``kind`` answers everything that differs between stacks; the fields hold the parts the
    kind started (zero-layer replicas, the baseline's Serve handle, vLLM servers), empty for
    a kind without them. A context manager; :meth:`close` stops what the stand-up started
    (nothing, if external).
    """

    def __init__(
        self,
        spec: StackSpec,
        urls: Sequence[str],
        *,
        kind: StackKind,
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
        self.kind = kind
        self.urls = list(urls)
        self.protocol = kind.protocol
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
        """Live process ids by telemetry role (``replica``, ``engine``, ``orchestrator`` ...)."""
        return self.kind.pids(self)

    def components(self) -> list[Component]:
        """Every process of the stack as a telemetry component."""
        return [
            Component(f"{self.name}-{role}-{i}", pid, role, self.name)
            for role, pids in self.pids().items()
            for i, pid in enumerate(pids)
        ]

    def engine_targets(self) -> list[EngineTarget]:
        """Telemetry sources for the stack's engines (see each kind)."""
        return self.kind.engine_targets(self)

    def engine_settings(self) -> dict[str, EngineSettings]:
        """Each engine replica's effective settings, as the engines report them (see each kind)."""
        return self.kind.engine_settings(self)

    def open_client(self, **options: Any) -> ZeroLayerClient | Http1Client | Http1Router:
        """The SDK client for this stack (options go to the client's constructor, which by
        default names the stack's model and adds its extra body fields); for an HTTP/1.1 stack
        with several replicas an :class:`Http1Router` over one client each."""
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
