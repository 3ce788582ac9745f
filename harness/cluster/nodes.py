"""The nodes of the Ray cluster a run is placed on, as Ray's GCS lists them (``ray.nodes()``:
the state API's ``list_nodes`` needs the dashboard, which a lean cluster leaves off), and how a
placement file's names find them.

A node is named by a custom resource it was started with (``ray start --resources='{"gpu-a":
1}'``): that is also how Serve places the baseline's replicas on it. Its node id (or a prefix of
six or more hex digits) and, where only one node has it, its IP address name it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

# Resources every node has, or Ray adds itself: never a node's name.
_RAY_RESOURCES: Final = frozenset({"CPU", "GPU", "TPU", "memory", "object_store_memory"})
_RAY_PREFIXES: Final = ("node:", "accelerator_type:", "TPU-")
MIN_ID_PREFIX: Final = 6


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One node: its id, address, the custom resources naming it, its resources, whether it
    is the head and alive."""

    node_id: str
    ip: str
    hostname: str = ""
    names: tuple[str, ...] = ()
    resources: Mapping[str, float] = field(default_factory=dict)
    is_head: bool = False
    alive: bool = True

    @property
    def label(self) -> str:
        """How the suite names the node in its output: its first custom resource, else the
        start of its id."""
        return self.names[0] if self.names else self.node_id[:12]

    def describe(self) -> dict[str, Any]:
        """run.json's entry for the node."""
        return {
            "node_id": self.node_id,
            "label": self.label,
            "ip": self.ip,
            "hostname": self.hostname,
            "names": list(self.names),
            "resources": dict(self.resources),
            "head": self.is_head,
        }


def node_names(resources: Mapping[str, float]) -> tuple[str, ...]:
    """The custom resources among a node's resources (those Ray sets itself left out)."""
    return tuple(
        sorted(
            name
            for name in resources
            if name not in _RAY_RESOURCES and not name.startswith(_RAY_PREFIXES)
        )
    )


def from_gcs(entry: Mapping[str, Any]) -> ClusterNode:
    """A node from one entry of ``ray.nodes()``."""
    resources = {str(k): float(v) for k, v in (entry.get("Resources") or {}).items()}
    return ClusterNode(
        node_id=str(entry["NodeID"]),
        ip=str(entry.get("NodeManagerAddress", "")),
        hostname=str(entry.get("NodeManagerHostname", "")),
        names=node_names(resources),
        resources=resources,
        is_head="node:__internal_head__" in resources,
        alive=bool(entry.get("Alive")),
    )


def cluster_nodes() -> list[ClusterNode]:
    """Every node the GCS knows, alive or not, head first then by id (a stable order: the
    default placement spreads over it)."""
    import ray

    nodes = [from_gcs(entry) for entry in ray.nodes()]
    return sorted(nodes, key=lambda n: (not n.is_head, n.node_id))


def alive(nodes: Sequence[ClusterNode]) -> list[ClusterNode]:
    return [n for n in nodes if n.alive]


def resolve(name: str, nodes: Sequence[ClusterNode]) -> ClusterNode:
    """The alive node ``name`` names (a custom resource, a node id or its prefix, a unique IP);
    ValueError listing the names the cluster has, for one that names no node or several."""
    live = alive(nodes)
    found = [n for n in live if name in n.names]
    if not found and len(name) >= MIN_ID_PREFIX:
        found = [n for n in live if n.node_id.startswith(name)]
    if not found:
        found = [n for n in live if n.ip == name]
    if len(found) == 1:
        return found[0]
    known = ", ".join(f"{n.label} ({n.ip}, {n.node_id[:12]})" for n in live) or "none alive"
    if found:
        raise ValueError(f"node {name!r} names {len(found)} nodes; name one: {known}")
    raise ValueError(f"no alive node of the cluster is named {name!r}; its nodes: {known}")


def holding(resource: str, nodes: Sequence[ClusterNode]) -> list[ClusterNode]:
    """The alive nodes started with the custom resource ``resource`` (a node's name, or a
    pool several nodes share: how Serve is told where it may place replicas)."""
    return [n for n in alive(nodes) if resource in n.names]


def actor_places() -> list[tuple[str, int, str]]:
    """(name, pid, node id) of every live actor, from the GCS's actor table."""
    from ray._private import state

    places = []
    for actor in state.actors().values():
        pid, node = actor.get("Pid"), (actor.get("Address") or {}).get("NodeID")
        if actor.get("State") == "ALIVE" and pid and node:
            places.append((str(actor.get("Name") or ""), int(pid), str(node)))
    return places
