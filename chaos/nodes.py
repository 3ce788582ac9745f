"""Faults where the process runs, for a stack placed on a Ray cluster, and the node-loss fault.

A target placed on a cluster (``Target.ray_address``) names each zero-layer replica's node
(``ReplicaSpec.node_id``); a baseline's actors are found on their nodes by the GCS. A kill, a
pause, a resume, a liveness check or a restart of such a process is done by the node agent of
its node (``harness.stacks.nodeagent``), through the run's cluster session; a target on this
host is acted on here, as before. ``lose_node`` is the node-loss experiment's action: one
worker node hosting an engine replica of the stack is taken out of the cluster as a lost
machine goes (its raylet and every process under it SIGKILLed by its own agent), never the
head's or the driver's node; the run's session is told first, so the loss stops nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any, Final

import psutil

from harness.cluster import current
from harness.cluster.nodes import ClusterNode, actor_places
from harness.stacks import ALL_STACKS
from harness.stacks.placed import agent_on
from harness.stacks.processes import kill_tree
from harness.stacks.stack import Fault

if TYPE_CHECKING:
    from chaos.targets import ReplicaSpec, Target

CALL_TIMEOUT_S: Final = 30.0
NODE_LOSS_CAUSE: Final = "chaos experiment node-loss"
STACK_GROUPS: Final = frozenset(ALL_STACKS)


def _agent(node_id: str) -> Any:
    """The agent of ``node_id`` in this process's cluster session."""
    session = current()
    if session is None:
        raise RuntimeError("the target is placed on a Ray cluster: open a cluster session")
    node = session.node(node_id)
    if node is None or not node.alive or session.taken(node_id):
        raise RuntimeError(f"node {node_id[:12]} is not an alive node of the cluster")
    return agent_on(session, node)


def _call(ref: Any) -> Any:
    import ray

    return ray.get(ref, timeout=CALL_TIMEOUT_S)


def node_of(target: Target, pid: int) -> str | None:
    """The node ``pid`` runs on (None: on this host, the target is not on a cluster)."""
    if not target.ray_address:
        return None
    for spec in target.replicas:
        if spec.pid == pid and spec.node_id:
            return spec.node_id
    return next((node for _, apid, node in actor_places() if apid == pid), None)


def node_label(node_id: str | None) -> str:
    """How the journal names a node: its name in the run's cluster record ('' off a cluster)."""
    session = current()
    if not node_id or session is None:
        return node_id or ""
    return next((p.node for p in session.placed() if p.node_id == node_id), node_id[:12])


def kill_where(target: Target, pid: int) -> list[int]:
    """SIGKILL ``pid`` and what it started, where it runs; the pids killed."""
    node = node_of(target, pid)
    if node is None:
        return kill_tree(pid)
    return list(_call(_agent(node).kill_tree.remote(pid)))


def signal_where(target: Target, pid: int, signum: signal.Signals) -> bool:
    """``signum`` to ``pid`` where it runs; False when it is gone."""
    node = node_of(target, pid)
    if node is None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True
    return bool(_call(_agent(node).send_signal.remote(pid, int(signum))))


def alive(pid: int) -> bool:
    """Running or stopped, not gone and not a zombie waiting to be reaped (on this host)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive_where(target: Target, pid: int) -> bool:
    """``pid`` runs (or is stopped) where it runs; not a zombie, not gone, its node alive."""
    node = node_of(target, pid)
    if node is None:
        return alive(pid)
    with contextlib.suppress(Exception):
        return bool(_call(_agent(node).alive.remote([pid])))
    return False


def restart_where(target: Target, spec: ReplicaSpec, log_path: str) -> int:
    """Start a killed replica again with its own command, on its node; its new pid. A replica
    whose node is gone is started on another of the stack's nodes, on the same port and that
    node's address (``spec`` then names the node, command and URL it has)."""
    if not target.ray_address or not spec.node_id:
        return target.kind.restart(spec.command, log_path)
    session = current()
    if session is None:
        raise RuntimeError("the target is placed on a Ray cluster: open a cluster session")
    node = session.node(spec.node_id)
    if node is None or not node.alive or session.taken(spec.node_id):
        _move(spec, _surviving_node(target))
    return int(_call(_agent(spec.node_id).restart.remote(spec.command, log_path)))


def _surviving_node(target: Target) -> ClusterNode:
    """An alive node among those the stack's replicas were placed on (else any alive node)."""
    session = current()
    assert session is not None
    alive = {n.node_id: n for n in session.nodes() if n.alive and not session.taken(n.node_id)}
    mine = [s.node_id for s in target.replicas if s.node_id in alive]
    if mine:
        return alive[mine[0]]
    if not alive:
        raise RuntimeError("no alive node left to start the replica on")
    return alive[sorted(alive)[0]]


def _move(spec: ReplicaSpec, node: ClusterNode) -> None:
    """``spec`` started on ``node`` from now on: its ``--host`` and URL that node's address."""
    command = list(spec.command)
    if "--host" in command:
        old = command[command.index("--host") + 1]
        command[command.index("--host") + 1] = node.ip
        spec.url = spec.url.replace(f"//{old}:", f"//{node.ip}:", 1)
    spec.command, spec.node_id = command, node.node_id


def _engine_nodes(target: Target) -> dict[str, list[int]]:
    """The stack's engine replicas by node id: the zero-layer's from the target, a baseline's
    engine actors from the GCS."""
    found: dict[str, list[int]] = {}
    for spec in target.replicas:
        if spec.node_id:
            found.setdefault(spec.node_id, []).append(spec.pid)
    if not target.replicas:
        pids = set((target.kind.cluster_pids() or {}).get(target.engine_role, []))
        for _, pid, node in actor_places():
            if pid in pids:
                found.setdefault(node, []).append(pid)
    return found


def victim(target: Target) -> ClusterNode | None:
    """The worker node to lose: hosting the most of the stack's engine replicas and nothing of
    another stack's (losing it must not break the stacks still to be measured), never the
    head's nor the driver's node (None: no such node)."""
    session = current()
    if session is None or not target.ray_address:
        return None
    by_id = {n.node_id: n for n in session.nodes() if n.alive}
    others = {p.node_id for p in session.placed() if p.group in STACK_GROUPS - {target.stack}}
    candidates = [
        (len(pids), node_id)
        for node_id, pids in _engine_nodes(target).items()
        if node_id in by_id and node_id not in others
        and not by_id[node_id].is_head and node_id != session.driver_node
    ]  # fmt: skip
    return by_id[max(candidates)[1]] if candidates else None


def lose_node(target: Target) -> dict[str, Any]:
    """The node-loss fault: the victim's agent takes its node out of the cluster; what it
    hosted of the stack (engine pids, replica URLs) is the fault's reach."""
    node = victim(target)
    session = current()
    if node is None or session is None:
        return {
            "fault": "absent",
            "role": target.engine_role,
            "stack": target.stack,
            "pids": [],
            "note": "no worker node (neither the head's nor the driver's) hosts an engine "
            f"replica of the {target.stack} stack and nothing of another stack's: no node to lose",
            "t_ns": time.time_ns(),
        }
    pids = _engine_nodes(target).get(node.node_id, [])
    urls = [s.url for s in target.replicas if s.node_id == node.node_id]
    agent = _agent(node.node_id)
    session.expect_loss(node.node_id, NODE_LOSS_CAUSE)
    t_ns = time.time_ns()
    taken = _call(agent.lose_node.remote())
    session.forget_node(node.node_id)
    return {
        "fault": Fault.NODE_LOSS,
        "role": target.engine_role,
        "node": node.label,
        "node_id": node.node_id,
        "pids": pids,
        "urls": urls,
        "raylet": taken.get("raylet"),
        "t_ns": t_ns,
    }
