"""Placing a run on a Ray cluster: its nodes as the GCS lists them (``nodes``), the placement
file saying which nodes host which stack's replicas and the loader's workers (``placement``),
and the run's session on the cluster (``session``): the connection, the actors it placed, the
record of every process it placed and the nodes it lost.

Ray places and supervises everything the suite puts on a cluster; nothing here is cluster
machinery of its own. What is started where: ``harness.stacks.placed`` (the stacks, through
each node's agent, ``harness.stacks.nodeagent``), ``harness.loaders.sharded`` (the native
loader's workers), ``chaos.nodes`` (faults where the process runs, the node-loss experiment).
"""

from harness.cluster.nodes import ClusterNode, cluster_nodes, resolve
from harness.cluster.placement import LOADERS, Placement, assign, read_placement
from harness.cluster.session import ClusterSession, current, open_session, session_for

__all__ = [
    "LOADERS",
    "ClusterNode",
    "ClusterSession",
    "Placement",
    "assign",
    "cluster_nodes",
    "current",
    "open_session",
    "read_placement",
    "resolve",
    "session_for",
]
