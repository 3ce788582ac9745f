"""A run's use of a Ray cluster: the connection, the placement, the actors it placed on the
nodes, every process it placed (for run.json) and the nodes it lost.

Ray places and supervises; this module adds nothing of its own to the cluster. Actors are
named (``get_if_exists``: the node agent of a node, a loader worker) in the run's own
namespace and pinned to their node with Ray's ``NodeAffinitySchedulingStrategy``; they are
owned by this driver, so Ray ends them if the driver dies, and :meth:`ClusterSession.close`
kills them (and disconnects, when it connected) however the run ends. A node the run used that
leaves the cluster is found by :meth:`ClusterSession.check` (asked of the GCS after each trial
and whenever an actor dies): a :class:`harness.errors.ClusterError` naming the node and what it
hosted, unless a chaos experiment said it would take that node.

Ray's connection is one per process, so the session open in this process is one too
(:func:`current`); stacks, loaders, telemetry and chaos find it there.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from harness.cluster.nodes import ClusterNode, cluster_nodes
from harness.cluster.placement import Placement, assign, check_names
from harness.errors import ClusterError
from harness.schema import ClusterInfo, NodeLoss, PlacedProcess

# How long the GCS may take to declare a node dead (its health checks: about 15 s here).
NODE_DEATH_WAIT_S: Final = 60.0
ANSWER_WAIT_S: Final = 5.0
REACH_TIMEOUT_S: Final = 5.0
KILL_WAIT_S: Final = 10.0

_CURRENT: list[ClusterSession] = []


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A TCP connect to a ``host:port`` address (Ray's own client retries an address that does
    not answer for minutes); ConnectionError naming it. Other forms (``auto``) are Ray's."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster answers at {address}: {exc}") from exc


def connect(address: str, namespace: str) -> bool:
    """Attach this process to the cluster at ``address`` in ``namespace``; True when it
    connected here (and so disconnects at the end), False when Ray was already attached."""
    import ray

    if ray.is_initialized():
        attached = ray.get_runtime_context().gcs_address
        if ":" in address and "://" not in address and attached != address:
            raise ConnectionError(
                f"this process is attached to the Ray at {attached}, not {address}"
            )
        return False
    check_reachable(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    return True


class ClusterSession:
    """The cluster as one run uses it (see the module docstring). ``on_change`` is called after
    every change to :attr:`info` (the run saves run.json)."""

    def __init__(
        self,
        address: str,
        placement: Placement | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        import ray

        self.address = address
        self.placement = placement or Placement()
        self.owns_connection = connect(address, f"zl-bench-{os.getpid()}-{time.time_ns()}")
        self.namespace = ray.get_runtime_context().namespace
        self.driver_node = ray.get_runtime_context().get_node_id()
        self.info = ClusterInfo(address=address, namespace=self.namespace)
        self.info.placement = self.placement.describe()
        self.info.nodes = [n.describe() for n in cluster_nodes()]
        self.on_change = on_change
        self._actors: dict[str, tuple[Any, str]] = {}  # name -> (handle, node id)
        self._expected: dict[str, str] = {}
        self._suspects: dict[str, str] = {}

    # -- nodes and placement -------------------------------------------------------------

    def nodes(self) -> list[ClusterNode]:
        """Every node the GCS knows now (alive or not)."""
        return cluster_nodes()

    def node(self, node_id: str) -> ClusterNode | None:
        return next((n for n in self.nodes() if n.node_id == node_id), None)

    def assign(self, group: str, count: int) -> list[ClusterNode]:
        """The node of each of ``count`` processes of ``group`` (a stack's name, ``loaders``):
        the placement file's nodes for it in turn, else every alive node in turn."""
        return assign(self.placement.nodes_for(group), count, self.nodes())

    def check_placement(self, pools: Sequence[str] = ()) -> None:
        """Every node the placement file names is an alive node, every pool a custom resource
        alive nodes hold (``check_names``; ValueError otherwise)."""
        check_names(self.placement, self.nodes(), pools)

    # -- actors ---------------------------------------------------------------------------

    def actor_on(self, cls: type, name: str, node: ClusterNode, *args: Any, **options: Any) -> Any:
        """The named actor ``name`` of class ``cls`` on ``node`` in the run's namespace, made
        (with ``args`` and Ray's actor ``options``) if it does not exist yet."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if name in self._actors:
            return self._actors[name][0]
        handle: Any = (
            ray.remote(cls)
            .options(
                name=name,
                namespace=self.namespace,
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                **options,
            )
            .remote(*args)
        )
        self._actors[name] = (handle, node.node_id)
        return handle

    def actor(self, name: str) -> Any | None:
        """The actor this session made under ``name`` (None: none, or forgotten)."""
        made = self._actors.get(name)
        return None if made is None else made[0]

    def forget_node(self, node_id: str) -> None:
        """The actors on a node that is gone: never asked again (the next ``actor_on`` for a
        name makes a new one where it is told)."""
        for name, (_, node) in list(self._actors.items()):
            if node == node_id:
                self._actors.pop(name)

    # -- what is placed where -------------------------------------------------------------

    def add(self, process: PlacedProcess) -> None:
        """Record a placed process (replacing one of the same group and name)."""
        self.info.processes = [
            p for p in self.info.processes if (p.group, p.name) != (process.group, process.name)
        ]
        self.info.processes.append(process)
        self._changed()

    def placed(self, group: str | None = None) -> list[PlacedProcess]:
        return [p for p in self.info.processes if group is None or p.group == group]

    def expect_loss(self, node_id: str, cause: str) -> None:
        """A chaos experiment is about to take ``node_id``: its loss stops nothing."""
        self._expected[node_id] = cause

    def taken(self, node_id: str) -> bool:
        """Whether a chaos experiment took ``node_id`` (the GCS may list it alive a while)."""
        return node_id in self._expected

    def suspect(self, node_id: str, why: str) -> None:
        """An actor on ``node_id`` failed (``why``): the next :meth:`check` waits for the GCS's
        word on that node (it takes some seconds to declare a node dead)."""
        self._suspects.setdefault(node_id, why)

    def _settle_suspects(self) -> None:
        """Each suspect node: one whose actors still answer is fine; for the others, wait
        (bounded) until the GCS declares them dead, and make their actors again when next
        asked for."""
        suspects = [n for n in list(self._suspects) if not self._answers(n)]
        self._suspects.clear()
        deadline = time.monotonic() + NODE_DEATH_WAIT_S
        while suspects and time.monotonic() < deadline:
            alive = {n.node_id for n in self.nodes() if n.alive}
            if not set(suspects) & alive:
                break
            time.sleep(0.5)
        for node_id in suspects:
            self.forget_node(node_id)

    def _answers(self, node_id: str) -> bool:
        """Whether every actor the session has on ``node_id`` answers (briefly)."""
        import ray

        handles = [h for h, node in self._actors.values() if node == node_id]
        try:
            ray.get([h.__ray_ready__.remote() for h in handles], timeout=ANSWER_WAIT_S)
        except Exception:
            return False
        return bool(handles)

    def check(self) -> None:
        """Raise ClusterError for a node that hosts something of the run and has left the
        cluster (unless a chaos experiment took it); each loss is recorded once. A node an
        actor failed on is waited for first (:meth:`suspect`)."""
        self._settle_suspects()
        by_id = {n.node_id: n for n in self.nodes()}
        recorded = {loss.node_id for loss in self.info.lost}
        for node_id, hosted in self._hosting().items():
            node = by_id.get(node_id)
            if (node is not None and node.alive) or node_id in recorded:
                continue
            label = next(p.node for p in self.info.processes if p.node_id == node_id)
            expected = node_id in self._expected
            cause = self._expected.get(node_id, "")
            loss = NodeLoss(node_id, label, time.time_ns(), hosted, expected, cause)
            self.info.lost.append(loss)
            self._changed()
            if not loss.expected:
                ip = f"{node.ip}, " if node is not None else ""
                raise ClusterError(
                    f"node {label} ({ip}{node_id[:12]}) left the Ray cluster; it hosted "
                    f"{', '.join(hosted)}: the run stops here, with what it measured saved"
                )

    def _hosting(self) -> dict[str, list[str]]:
        hosting: dict[str, list[str]] = {}
        for p in self.info.processes:
            hosting.setdefault(p.node_id, []).append(f"{p.group} {p.role} {p.name}")
        return hosting

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def close(self) -> None:
        """Kill every actor the run made (their processes end with them), then disconnect if
        this session connected."""
        import ray

        handles = [handle for handle, _ in self._actors.values()]
        self._actors.clear()
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        _wait_dead(handles)
        if self.owns_connection:
            ray.shutdown()


def _wait_dead(handles: Sequence[Any]) -> None:
    """Wait (bounded) until the GCS lists each killed actor dead (its worker has exited, and
    with it, by fate-sharing, what it started)."""
    from ray._private import state

    deadline = time.monotonic() + KILL_WAIT_S
    pending = [h._actor_id.hex() for h in handles]
    while pending and time.monotonic() < deadline:
        pending = [a for a in pending if state.actors(actor_id=a).get("State") != "DEAD"]
        if pending:
            time.sleep(0.1)


def current() -> ClusterSession | None:
    """The session open in this process, if any."""
    return _CURRENT[-1] if _CURRENT else None


def session_for(address: str) -> ClusterSession:
    """The open session on ``address``; RuntimeError when none is open (whoever places a stack
    on a cluster opens one first: the run, a sweep, ``zl-bench chaos``, a test)."""
    session = current()
    if session is None or session.address != address:
        raise RuntimeError(f"no cluster session open on {address}: open_session first")
    return session


@contextlib.contextmanager
def open_session(
    address: str,
    placement: Placement | None = None,
    on_change: Callable[[], None] | None = None,
    pools: Sequence[str] = (),
) -> Iterator[ClusterSession]:
    """The cluster at ``address`` for the block: connected, the placement's names checked
    (ValueError for one no alive node has; ``pools``: the groups Serve places, by one custom
    resource), everything the run placed ended afterwards."""
    session = ClusterSession(address, placement, on_change)
    _CURRENT.append(session)
    try:
        session.check_placement(pools)
        yield session
    finally:
        _CURRENT.remove(session)
        session.close()
