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
from typing import TYPE_CHECKING, Any

from harness.stacks.clients import Http1Router, open_client
from harness.stacks.spec import StackName, StackSpec
from harness.telemetry import Component, EngineTarget
from serving.engine.settings import EngineSettings

if TYPE_CHECKING:
    from baselines.rayserve.standup import ServeHandle
    from harness.stacks.placed import PlacedProcessHandle
    from harness.stacks.processes import ReplicaProcess, VllmServer
    from zerolayer.client import Http1Client, ZeroLayerClient

    # A zero-layer replica or a vLLM server: started here, or by a node agent on a cluster.
    Replica = ReplicaProcess | PlacedProcessHandle
    Server = VllmServer | PlacedProcessHandle


class Fault(StrEnum):
    """The faults chaos (profile D) injects, as its actions name them in the journal."""

    KILL = "kill"
    PAUSE = "pause"
    DELAY = "delay"
    PARTITION = "partition"
    CPU_STRESS = "cpu_stress"
    KV_PRESSURE = "kv_pressure"
    NODE_LOSS = "node_loss"  # a worker node of the stack's Ray cluster lost (cluster runs only)


ALL_FAULTS: frozenset[Fault] = frozenset(Fault)


class Restore(StrEnum):
    """How a killed engine replica comes back."""

    BY_COMMAND = "by-command"  # chaos starts it again with its own command, on its own port
    BY_CONTROLLER = "by-controller"  # Serve's controller replaces the actor (a new pid)
    NONE = "none"  # nothing here brings it back (no faults are defined for the kind)


class Scaling(StrEnum):
    """How an engine replica joins or leaves the stack (profile G)."""

    BY_COMMAND = "by-command"  # a replica process started or stopped, published to the clients
    BY_CONTROLLER = "by-controller"  # a replica count asked of the orchestrator's controller
    NONE = "none"  # the stack cannot be scaled here (profile G skips it)


class StackKind(ABC):
    """One kind of stack. Class attributes answer the questions with fixed answers:

    ``name``: the stack it is (several kinds may share one: the baselines); ``protocol``: what
    its clients speak (``h2`` or ``http1``); ``client_routes``: the client picks the replica
    (the SDK's ring over every replica URL), so it sees which replica answered, load can be
    pinned to one replica, and the fault proxy stands in front of one replica; otherwise one
    front door carries all traffic. ``engine_role``: the process role of its engine replicas.
    ``faults``: the faults profile D applies to it. ``restore``: how a killed part comes back.
    ``scaling``: how an engine replica joins or leaves (profile G).
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
    scaling: Scaling = Scaling.NONE
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

    def scale_engines(self, replicas: int) -> None:
        """Ask the controller for ``replicas`` engine replicas. Only a kind scaled by its
        controller (:attr:`scaling`) can."""
        del replicas
        raise ValueError(f"the {self.name} stack is not scaled by a controller")

    def running_engines(self) -> list[int]:
        """The pids of the engine replicas the controller reports running (scaled by a
        controller only)."""
        raise ValueError(f"the {self.name} stack is not scaled by a controller")

    def replicas_changing(self) -> int:
        """How many replicas the stack's controller reports starting, stopping or being replaced:
        a scale or a replacement still under way. Zero where no controller starts parts (the
        suite starts them itself and watches the process)."""
        return 0


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
        replicas: Sequence[Replica] = (),
        baseline: ServeHandle | None = None,
        tls_ca: Path | None = None,
        stats_dir: Path | None = None,
        servers: Sequence[Server] = (),
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

    def open_client(
        self, protocol: str | None = None, **options: Any
    ) -> ZeroLayerClient | Http1Client | Http1Router:
        """The SDK client for this stack (options go to the client's constructor, which by
        default names the stack's model and adds its extra body fields); for an HTTP/1.1 stack
        with several replicas an :class:`Http1Router` over one client each. ``protocol``
        speaks another protocol than the stack's own (``http1`` to a zero-layer replica,
        which serves both)."""
        protocol = protocol or self.protocol
        options.setdefault("model", self.model)
        options.setdefault("extra_body", self.extra_body)
        key = None if self.credentials is None else self.credentials.default_key
        return open_client(protocol, self.urls, self.tls_ca, api_key=key, **options)

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
        for parts in (self.replicas, self.servers):
            for stop_many, group in _by_kind(parts):
                stop_many(group)
        if self.baseline is not None:
            self.baseline.close()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _by_kind(parts: Sequence[Any]) -> list[tuple[Any, list[Any]]]:
    """``parts`` grouped by their class, with the class's ``stop_many``: each group is
    stopped at once (they drain together), as its class does it."""
    groups: dict[Any, list[Any]] = {}
    for part in parts:
        groups.setdefault(type(part), []).append(part)
    return [(cls.stop_many, group) for cls, group in groups.items()]
