"""A run placed on a Ray cluster (``--ray-address``): its options checked before anything
starts, the cluster session open for the run's length, recorded in run.json, and checked for
lost nodes between trials.

Without ``--ray-address`` nothing here does anything: the stacks and the loader run on this
host, as always.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

from harness.cluster import ClusterSession, Placement, current, open_session, read_placement
from harness.errors import UsageError
from harness.runner.results import RunDir
from harness.stacks import ALL_STACKS, STACK_KINDS

# The loaders that can run as workers on the cluster (--loader-workers).
DISTRIBUTED_LOADERS: Final = ("native", "k6", "locust")


def check_cluster_options(
    ray_address: str | None, placement: str | None, loader_workers: int | None, loader: str
) -> Placement | None:
    """The placement file read, and the cluster options checked against each other: a
    mistake is a UsageError naming it, before anything starts."""
    if placement and not ray_address:
        raise UsageError(
            "--placement says which nodes of a Ray cluster host what: it needs --ray-address"
        )
    if loader_workers and not ray_address:
        raise UsageError(
            "--loader-workers runs the loader as Ray actors: it needs --ray-address (a cluster "
            "started with ray start; docs/cluster.md)"
        )
    if loader_workers and loader not in DISTRIBUTED_LOADERS:
        raise UsageError(
            f"--loader-workers runs the {', '.join(DISTRIBUTED_LOADERS)} loaders on the "
            f"cluster, not {loader}"
        )
    if not placement:
        return None
    try:
        return read_placement(placement, ALL_STACKS)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def serve_placed() -> tuple[str, ...]:
    """The stacks Serve places (by one custom resource, not node by node)."""
    return tuple(name.value for name, kind in STACK_KINDS.items() if kind.app)


@contextlib.contextmanager
def on_cluster(
    ray_address: str | None, placement: Placement | None
) -> Iterator[ClusterSession | None]:
    """The cluster session for the block (None without ``--ray-address``); a cluster that
    cannot be reached, or a placement naming what it does not have, is a UsageError."""
    if not ray_address:
        yield None
        return
    with contextlib.ExitStack() as stack:
        try:
            opened = open_session(ray_address, placement, pools=serve_placed())
            session = stack.enter_context(opened)
        except (ConnectionError, ValueError, TimeoutError) as exc:
            raise UsageError(f"--ray-address {ray_address}: {exc}") from exc
        yield session


def record_cluster(session: ClusterSession | None, run: RunDir) -> None:
    """run.json's ``cluster`` is the session's record, saved whenever it changes."""
    if session is None:
        return
    run.meta.cluster = session.info
    session.on_change = run.save
    run.save()


def check_cluster() -> None:
    """Raise ClusterError if a node the run uses has left the cluster (between trials)."""
    session = current()
    if session is not None:
        session.check()
