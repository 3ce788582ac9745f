"""The placement file (``--placement FILE``): which nodes host which stack's replicas and the
loader's workers. TOML, one table per stack, one for the loaders::

    [stacks.zerolayer]
    nodes = ["gpu-a", "gpu-b"]      # replica i on nodes[i % 2]

    [stacks.baseline]
    nodes = ["gpu-b"]               # Serve places its engine replicas on these nodes

    [loaders]
    nodes = ["client-a", "client-b"] # loader worker i on nodes[i % 2]

A node is named as ``harness.cluster.nodes.resolve`` reads it (a custom resource it was started
with, best). What the file leaves out is spread over every alive node (``assign``), in the
cluster's order. A mistake in the file is a ValueError naming it, read before anything starts.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from harness.cluster.nodes import ClusterNode, alive, holding, resolve

LOADERS: Final = "loaders"
_TOP: Final = frozenset({"stacks", LOADERS})


@dataclass(frozen=True, slots=True)
class Placement:
    """What the file asks for: node names per stack (by the stack's name) and for the loader
    workers; an empty tuple leaves that group to the default spread."""

    stacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    loaders: tuple[str, ...] = ()
    path: str = ""

    def nodes_for(self, group: str) -> tuple[str, ...]:
        """The names asked for ``group`` (a stack's name, or ``loaders``)."""
        return self.loaders if group == LOADERS else self.stacks.get(group, ())

    def describe(self) -> dict[str, Any]:
        """run.json's record of the file: its path and what it asked."""
        return {
            "file": self.path,
            "stacks": {k: list(v) for k, v in self.stacks.items()},
            "loaders": list(self.loaders),
        }


def _names(where: str, table: Any) -> tuple[str, ...]:
    """A table's ``nodes``: a non-empty list of non-empty strings, nothing else in the table."""
    if not isinstance(table, dict):
        raise ValueError(f"[{where}] must be a table with a nodes list")
    extra = sorted(set(table) - {"nodes"})
    if extra:
        raise ValueError(f"[{where}]: unknown key(s) {', '.join(extra)}; only nodes is read")
    nodes = table.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValueError(f"[{where}] nodes must be a non-empty list of node names")
    if not all(isinstance(n, str) and n.strip() for n in nodes):
        raise ValueError(f"[{where}] nodes must be node names (strings), got {nodes!r}")
    return tuple(n.strip() for n in nodes)


def parse_placement(data: Mapping[str, Any], stacks: Sequence[str], path: str = "") -> Placement:
    """A placement from the file's tables; ``stacks`` are the stack names it may name."""
    extra = sorted(set(data) - _TOP)
    if extra:
        raise ValueError(f"unknown table(s) {', '.join(extra)}; a placement has stacks, loaders")
    tables = data.get("stacks", {})
    if not isinstance(tables, dict):
        raise ValueError("[stacks] must hold one table per stack: [stacks.zerolayer] ...")
    unknown = sorted(set(tables) - set(stacks))
    if unknown:
        raise ValueError(f"unknown stack(s) {', '.join(unknown)}; choose from {', '.join(stacks)}")
    placed = {name: _names(f"stacks.{name}", table) for name, table in tables.items()}
    loaders = _names(LOADERS, data[LOADERS]) if LOADERS in data else ()
    return Placement(placed, loaders, path)


def read_placement(path: str | Path, stacks: Sequence[str]) -> Placement:
    """The placement file at ``path``; ValueError (one line, naming the file) for a file that
    does not exist, is not TOML, or asks for what no placement can say."""
    file = Path(path).expanduser()
    try:
        data = tomllib.loads(file.read_text())
        return parse_placement(data, stacks, str(file))
    except FileNotFoundError:
        raise ValueError(f"placement file {file} does not exist") from None
    except (tomllib.TOMLDecodeError, ValueError, OSError) as exc:
        raise ValueError(f"placement file {file}: {exc}") from None


def assign(names: Sequence[str], count: int, nodes: Sequence[ClusterNode]) -> list[ClusterNode]:
    """The node of each of ``count`` processes: ``names`` resolved, in turn (process i on
    ``names[i % len]``); with no names, every alive node in the cluster's order, in turn.
    ValueError for a name no alive node has (``resolve``) or a cluster with no alive node."""
    pool = [resolve(name, nodes) for name in names] if names else alive(nodes)
    if not pool:
        raise ValueError("the cluster has no alive node to place anything on")
    return [pool[i % len(pool)] for i in range(count)]


def pool_resource(placement: Placement, group: str, nodes: Sequence[ClusterNode]) -> str | None:
    """The one custom resource ``group``'s replicas are placed by (Serve places a deployment's
    replicas by resources, not by node): the file's one name for it, which alive nodes must
    hold; None when the file leaves the group to Serve. ValueError otherwise."""
    names = placement.nodes_for(group)
    if not names:
        return None
    if len(names) != 1:
        raise ValueError(
            f"[stacks.{group}]: Serve places the replicas by a resource: name one custom "
            f"resource (one node's, or one several nodes were started with), not {list(names)}"
        )
    if not holding(names[0], nodes):
        known = sorted({name for n in alive(nodes) for name in n.names})
        raise ValueError(
            f"[stacks.{group}]: no alive node holds the custom resource {names[0]!r}; "
            f"the cluster's: {', '.join(known) or 'none'}"
        )
    return names[0]


def check_names(
    placement: Placement, nodes: Sequence[ClusterNode], pools: Sequence[str] = ()
) -> None:
    """Every name the file uses names one alive node, or for a group in ``pools`` (placed by
    Serve) one custom resource alive nodes hold (ValueError naming the first that does not):
    checked once the cluster is reached, before any stack starts."""
    for group in [*placement.stacks, LOADERS]:
        if group in pools:
            pool_resource(placement, group, nodes)
            continue
        for name in placement.nodes_for(group):
            resolve(name, nodes)
