"""Stacks placed on a Ray cluster (``StackSpec.ray_address``): zero-layer replicas and vLLM's
own servers started on the placement's nodes by each node's agent (``harness.stacks.nodeagent``),
and what the stack, chaos and telemetry hold of them here.

A :class:`PlacedProcessHandle` (a replica or a vLLM server) answers as a ``ReplicaProcess``
(``VllmServer``) does: its URL (the node's own address, loopback on a one-machine cluster), pid,
port, command and log; whether it lives, its children, a kill, a stop, all asked of the agent on
its node. The replicas of a stack are started at once, each waited for, all stopped if one
fails; each is recorded in the run's cluster record (node, address, resources, log).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from harness.cluster.nodes import ClusterNode, actor_places
from harness.cluster.placement import pool_resource
from harness.cluster.session import ClusterSession, current, session_for
from harness.schema import PlacedProcess
from harness.stacks.nodeagent import AGENT_PREFIX, NodeAgent, Started
from harness.stacks.spec import StackSpec
from harness.telemetry import Availability
from serving.engine.kinds import engine_kind

if TYPE_CHECKING:
    from harness.telemetry import Component

AGENT_THREADS: Final = 8
CALL_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 60.0
AGENT_ROLE: Final = "node-agent"
AGENT_GROUP: Final = "cluster"
# How much of its node's (or pool's) custom resource one Serve replica asks for: a token, so
# that any number fit and only the nodes holding it qualify.
SERVE_SHARE: Final = 0.001
SAMPLE_TIMEOUT_S: Final = 2.0
REPLICA_PREFIX: Final = "zl"  # zl-0, zl-1, ...: as the replicas name themselves (--name)
SERVER_PREFIX: Final = "vllm-serve"


def agent_on(session: ClusterSession, node: ClusterNode, gpus: bool = False) -> Any:
    """The node agent of ``node``, made on first use (with ``gpus``, holding the node's GPUs:
    Ray accounts for what the engines it starts use, and they see them), recorded in the run's
    cluster record."""
    import ray

    name = f"{AGENT_PREFIX}{node.node_id[:16]}"
    known = {p.name for p in session.placed(AGENT_GROUP)}
    gpus_held = float(node.resources.get("GPU", 0.0)) if gpus else 0.0
    agent = session.actor_on(
        NodeAgent, name, node, num_cpus=0, num_gpus=gpus_held, max_concurrency=AGENT_THREADS
    )
    if name not in known:
        where = ray.get(agent.where.remote(), timeout=CALL_TIMEOUT_S + 90.0)
        resources = {"GPU": gpus_held} if gpus_held else {}
        session.add(
            PlacedProcess(
                AGENT_GROUP,
                AGENT_ROLE,
                name,
                node.node_id,
                node.label,
                where.ip,
                where.pid,
                resources=resources,
            )
        )
    return agent


def _get(ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    import ray

    return ray.get(ref, timeout=timeout_s)


class PlacedProcessHandle:
    """What a stack holds of a process an agent started on a node (see the module docstring)."""

    def __init__(self, agent: Any, name: str, node: ClusterNode, started: Started) -> None:
        self.agent = agent
        self.name = name
        self.node = node
        self.url = started.url
        self.port = started.port
        self.command = list(started.command)
        self.log_path = Path(started.log_path)
        self._pid = started.pid

    @property
    def pid(self) -> int:
        return self._pid

    def wait_ready(self) -> str:
        """Already ready: the agent waited before answering."""
        return self.url

    def alive(self) -> bool:
        """Running (or paused) on its node; False when it, or its node's agent, is gone."""
        try:
            return bool(_get(self.agent.alive.remote([self._pid])))
        except Exception:  # the agent is gone with its node: so is the process
            return False

    def children(self) -> list[int]:
        """The process's descendants on its node (vLLM's engine cores)."""
        try:
            return list(_get(self.agent.children.remote([self._pid])))
        except Exception:
            return []

    def adopt(self, pid: int) -> None:
        """Started again (``NodeAgent.restart``, same command, same port) as ``pid``."""
        self._pid = pid
        with contextlib.suppress(Exception):
            _get(self.agent.adopt.remote(self.name, pid))

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            _get(self.agent.kill_tree.remote(self._pid))

    def stop(self) -> None:
        type(self).stop_many([self])

    @staticmethod
    def stop_many(handles: Sequence[PlacedProcessHandle]) -> None:
        """Stop every handle, each node's at once by its agent, every node in parallel; an
        agent gone with its node has nothing left to stop."""
        by_agent: dict[Any, list[str]] = {}
        for handle in handles:
            by_agent.setdefault(handle.agent, []).append(handle.name)
        refs = [agent.stop.remote(names) for agent, names in by_agent.items()]
        for ref in refs:
            with contextlib.suppress(Exception):
                _get(ref, STOP_TIMEOUT_S)

    def record(self, group: str, role: str) -> PlacedProcess:
        """This process as the run's cluster record has it."""
        return PlacedProcess(
            group, role, self.name, self.node.node_id, self.node.label, self.node.ip,
            self._pid, address=self.url, log_path=str(self.log_path),
        )  # fmt: skip


def _start_all(
    session: ClusterSession, spec: StackSpec, prefix: str, start: Any
) -> list[PlacedProcessHandle]:
    """``start(agent, i, node)`` (a call's ref) for each replica ``prefix-i`` on its assigned
    node, all at once; each waited for; every one started stopped if any fails. The agents of
    an engine that runs a model hold their nodes' GPUs."""
    nodes = session.assign(spec.name, spec.replicas)
    gpus = engine_kind(spec.engine).runs_model
    calls = [(i, node, agent_on(session, node, gpus)) for i, node in enumerate(nodes)]
    refs = [(i, node, agent, start(agent, i, node)) for i, node, agent in calls]
    started: list[PlacedProcessHandle] = []
    errors: list[BaseException] = []
    for i, node, agent, ref in refs:
        try:
            started.append(PlacedProcessHandle(agent, f"{prefix}-{i}", node, _get(ref, 600.0)))
        except Exception as exc:
            errors.append(exc)
    if errors:
        PlacedProcessHandle.stop_many(started)
        raise RuntimeError(f"{spec.name} could not start on the cluster: {errors[0]}")
    for handle in started:
        session.add(handle.record(spec.name, "replica"))
    return started


def start_replicas(
    spec: StackSpec, workdir: Path, tls: tuple[Path, Path] | None, ready_timeout_s: float
) -> list[PlacedProcessHandle]:
    """The zero-layer stack's replicas on the cluster: ``zl-i`` on its assigned node,
    listening on that node's address, its log under ``workdir`` there; its certificate and
    the run's API keys (``--auth``) go with it (the driver's files are not on the node)."""
    session = session_for(str(spec.ray_address))
    tls_bytes = None if tls is None else (tls[0].read_bytes(), tls[1].read_bytes())
    creds = spec.credentials
    keys = None if creds is None else creds.key_file.read_bytes()

    def start(agent: Any, i: int, node: ClusterNode) -> Any:
        return agent.start_replica.remote(
            f"{REPLICA_PREFIX}-{i}", spec.engine, dict(spec.engine_options), host=node.ip,
            log_path=str(workdir / f"zl-replica-{i}.log"), tls=tls_bytes, key_file=keys,
            ready_timeout_s=ready_timeout_s,
        )  # fmt: skip

    return _start_all(session, spec, REPLICA_PREFIX, start)


def start_servers(spec: StackSpec, workdir: Path) -> list[PlacedProcessHandle]:
    """vllm-serve's servers on the cluster: each on its assigned node, on that node's
    address, its log under ``workdir`` there."""
    session = session_for(str(spec.ray_address))

    def start(agent: Any, i: int, node: ClusterNode) -> Any:
        return agent.start_server.remote(
            f"{SERVER_PREFIX}-{i}", dict(spec.engine_options), host=node.ip,
            log_path=str(workdir / f"vllm-serve-{i}.log"),
        )  # fmt: skip

    return _start_all(session, spec, SERVER_PREFIX, start)


def node_addresses(spec: StackSpec) -> list[str]:
    """The addresses of the alive nodes a stack may be placed on (none off a cluster): what
    its TLS certificate must name."""
    if not spec.ray_address:
        return []
    return sorted({n.ip for n in session_for(spec.ray_address).nodes() if n.alive})


def serve_resources(spec: StackSpec) -> dict[str, float]:
    """The Ray resources a Serve-placed stack's engine replicas ask for: a token of the one
    custom resource its placement names (none off a cluster, or where the file leaves the
    stack to Serve)."""
    if not spec.ray_address:
        return {}
    session = session_for(spec.ray_address)
    resource = pool_resource(session.placement, spec.name, session.nodes())
    return {} if resource is None else {resource: SERVE_SHARE}


def record_actors(
    spec: StackSpec, roles: dict[str, list[int]], engine_role: str, resources: dict[str, float]
) -> None:
    """A Serve-placed stack's actors (``roles``: pids by telemetry role) in the run's cluster
    record, each on the node the GCS says it runs on; the engine replicas with ``resources``."""
    if not spec.ray_address:
        return
    session = session_for(spec.ray_address)
    nodes = {n.node_id: n for n in session.nodes()}
    role_of = {pid: role for role, pids in roles.items() for pid in pids}
    for name, pid, node_id in actor_places():
        role, node = role_of.get(pid), nodes.get(node_id)
        if role is None or node is None:
            continue
        held = dict(resources) if role == engine_role else {}
        session.add(
            PlacedProcess(
                spec.name,
                role,
                name or f"{role}-{pid}",
                node_id,
                node.label,
                node.ip,
                pid,
                resources=held,
            )
        )


def watch_placed(session: ClusterSession, group: str, components: Sequence[Component]) -> bool:
    """The node agents sample ``group``'s processes where they run (each ``Component`` matched
    to its placed process by pid; the processes those started, such as vLLM's engine cores, by
    the same agent); False when the run placed none of the group's processes (sample them
    here)."""
    placed = {p.pid: p for p in session.placed(group) if p.pid is not None}
    if not placed:
        return False
    by_node: dict[str, list[Component]] = {}
    for component in components:
        where = placed.get(component.pid)
        if where is not None:
            by_node.setdefault(where.node_id, []).append(component)
    nodes = {n.node_id: n for n in session.nodes() if n.alive}
    for node_id, comps in by_node.items():
        if node_id in nodes:
            _get(agent_on(session, nodes[node_id]).watch.remote(comps))
    return True


class NodeTelemetry:
    """The telemetry of every node that hosts something of the run, sampled by each node's
    agent there (``NodeAgent.sample``: host CPU and memory, the processes it watches, NVML)
    and named by its node; unavailable off a cluster."""

    kind = "nodes"

    def open(self) -> Availability:
        if current() is None:
            return Availability(False, "the run is not placed on a Ray cluster")
        return Availability(True)

    def read(self) -> list[dict[str, Any]]:
        session = current()
        if session is None:
            return []
        agents = [(p, session.actor(p.name)) for p in session.placed(AGENT_GROUP)]
        refs = [(p, agent.sample.remote()) for p, agent in agents if agent is not None]
        rows: list[dict[str, Any]] = []
        for place, ref in refs:
            where = {"node": place.node, "node_id": place.node_id}
            try:
                rows += [{**row, **where} for row in _get(ref, SAMPLE_TIMEOUT_S)]
            except Exception as exc:  # a node gone? the run's next check waits for the GCS
                session.suspect(place.node_id, type(exc).__name__)
                rows.append({"error": f"{type(exc).__name__}: {exc}"[:300], **where})
        return rows

    def describe(self) -> dict[str, Any]:
        session = current()
        places = session.placed(AGENT_GROUP) if session is not None else []
        return {"nodes": [{"node": p.node, "node_id": p.node_id} for p in places]}

    def close(self) -> None:
        return None
