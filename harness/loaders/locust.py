"""The locust loader: locust as a library, headless, in its own process.

Locust monkey-patches the standard library with gevent when imported, which would break the
asyncio code of the caller, so ``run_locust`` starts a child Python that patches first (before
anything imports ``ssl``) and then runs ``harness.loaders.locust_child``, the only module that
imports locust. There users send the schedule's requests over HTTP/1.1 keep-alive (``requests``,
streaming), each to the replica the plan names (the SDK's ring, ``base.replica_routes``), each at
its intended send time. Each request becomes one RequestRecord, written as it ends; locust's own
statistics are saved next to them and returned in ``extra['locust_stats']``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from harness.loaders.base import LoadResult, make_result, new_record, replica_counts, write_plan
from harness.loaders.child import ChildLoader, ChildRun
from harness.loaders.locust_workers import CHILD, MASTER, WORKER, LocustWorker, child_env
from harness.loaders.sharded import shards
from harness.schema import RequestRecord, read_requests
from harness.workload import PlannedRequest

if TYPE_CHECKING:
    from harness.profile import Profile
    from harness.stacks import Stack

SPAWN_RATE: Final = 100
NOT_SENT: Final = "not_sent"


def start_delay_s(users: int) -> float:
    """Time from the child's start to the first send: every user spawned, plus a margin."""
    return 0.5 + users / SPAWN_RATE


def run_locust(
    child: ChildRun,
    *,
    users: int = 32,
    ca_cert: str | Path | None = None,
    workers: int | None = None,
) -> LoadResult:
    """Run the schedule through locust, request ``i`` to ``child.routes[i]`` (HTTP/1.1), and
    summarise it; ``ca_cert`` is the certificate to trust for https URLs (the run's own).
    ``workers``: locust's own distributed mode on the run's Ray cluster
    (``harness.loaders.locust_workers``)."""
    schedule, workdir, records_path = child.schedule, child.workdir, child.records_path
    records_path.unlink(missing_ok=True)
    stats_path = workdir / "locust-stats.json"
    config: dict[str, object] = {
        **{
            k: str(v) for k, v in write_plan(schedule, child.routes, workdir, child.grace_s).items()
        },
        "host": child.routes[0] if child.routes else "http://127.0.0.1",
        "records": str(records_path),
        "stats": str(stats_path),
        "stack": child.stack,
        "profile": child.profile,
        "users": users,
        "verify": str(ca_cert) if ca_cert is not None else True,
        "extra_body": dict(child.extra_body),
        "auth_headers": dict(child.auth_headers or {}),
    }
    bound_s = _time_bound_s(schedule, users, child.grace_s)
    placed: list[dict[str, Any]] = []
    if workers:
        placed = _run_distributed(child, config, workers, bound_s)
    else:
        config_path = workdir / "locust-config.json"
        config_path.write_text(json.dumps(config))
        _run_child([sys.executable, "-c", CHILD, str(config_path)], workdir, bound_s)
    records = _every_scheduled(schedule, records_path, child.stack, child.profile)
    unsent = sum(1 for r in records if r.error_code == NOT_SENT)
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    return make_result(
        "locust",
        child.stack,
        child.profile,
        records_path,
        records,
        extra_reasons=[f"locust never sent {unsent} requests"] if unsent else [],
        extra={
            "locust_stats": stats,
            "users": users,
            "arrival": "schedule (each user sleeps until its request's intended time)",
            "per_replica": replica_counts(records),
            **({"workers": placed} if workers else {}),
        },
        protocol="http/1.1",
        lag_fraction=child.lag_fraction,
    )


def _time_bound_s(schedule: Sequence[PlannedRequest], users: int, grace_s: float) -> float:
    """The child's wall-clock bound: spawn, the schedule's span, its longest request, a margin."""
    span = schedule[len(schedule) - 1].offset_s if len(schedule) else 0.0
    longest = max((r.deadline_ms for r in schedule), default=0) / 1000.0 + grace_s
    return start_delay_s(users) + span + longest + 60.0


def _run_child(command: Sequence[str], workdir: Path, timeout_s: float) -> None:
    """The gevent-patched child that runs locust (alone, or a distributed run's master); its
    stderr is kept as ``locust.log``."""
    proc = subprocess.run(
        list(command), env=child_env(), capture_output=True, text=True, timeout=timeout_s,
        check=False,
    )  # fmt: skip
    (workdir / "locust.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"locust run failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _run_distributed(
    child: ChildRun, config: dict[str, Any], workers: int, bound_s: float
) -> list[dict[str, Any]]:
    """A master here and ``workers`` workers on the cluster's loader nodes, each with its
    shard; their records written to the run's records file. Each worker's record (node,
    records, exit status) for the result."""
    import ray

    from harness.cluster.placement import LOADERS
    from harness.cluster.session import current
    from serving.ports import free_port

    session = current()
    if session is None:
        raise RuntimeError("locust workers run on a Ray cluster: open a cluster session first")
    host = ray.util.get_node_ip_address()
    shared = {**config, "master_host": host, "master_port": free_port(host), "bound_s": bound_s}
    nodes = session.assign(LOADERS, workers)
    actors = [session.actor_on(LocustWorker, f"zl-locust-{i}", node, num_cpus=0)
              for i, node in enumerate(nodes)]  # fmt: skip
    route = dict(zip((r.request_id for r in child.schedule), child.routes, strict=True))
    starts = []
    for i, (actor, part) in enumerate(zip(actors, shards(child.schedule, workers), strict=True)):
        folder = child.workdir / f"worker-{i}"
        paths = write_plan(part, [route[r.request_id] for r in part], folder, child.grace_s)
        files = {path.name: path.read_bytes() for path in paths.values()}
        starts.append(actor.start.remote(files, {**shared, "mode": WORKER}))
    master = {**shared, "mode": MASTER, "bind_host": host, "workers": workers}
    (child.workdir / "locust-master.json").write_text(json.dumps(master))
    ray.get(starts)
    _run_child([sys.executable, "-c", CHILD, str(child.workdir / "locust-master.json")],
               child.workdir, bound_s)  # fmt: skip
    ends = ray.get([a.finish.remote(60.0) for a in actors], timeout=bound_s)
    with open(child.records_path, "ab") as out:
        for data, _, _ in ends:
            out.write(data)
    return [
        {
            "node": node.label,
            "node_id": node.node_id,
            "records": data.count(b"\n"),
            "exit": code,
            "log_tail": "" if code == 0 else tail,
        }
        for node, (data, code, tail) in zip(nodes, ends, strict=True)
    ]


def _every_scheduled(
    schedule: Sequence[PlannedRequest], records_path: Path, stack: str, profile: str
) -> list[RequestRecord]:
    """One record per scheduled request: the child's, or ``not_sent`` where it wrote none."""
    by_id = {r.request_id: r for r in read_requests(records_path)} if records_path.exists() else {}
    records = []
    for req in schedule:
        rec = by_id.get(req.request_id)
        if rec is None:  # never started before the run's bound: the loader could not keep up
            rec = new_record(req, stack, profile, "locust", 0)
            rec.outcome, rec.error_code = "error", NOT_SENT
        records.append(rec)
    return records


@dataclass(frozen=True)
class LocustLoader(ChildLoader):
    """Locust over a whole stack: HTTP/1.1, every replica by the SDK's ring.

    ``users`` defaults to the profile's connections; its progress shows once, at the end.
    """

    name: str = field(default="locust", init=False)
    users: int | None = None
    workers: int | None = None  # locust's own distributed mode: a master and N workers

    def run_child(self, child: ChildRun, stack: Stack, profile: Profile) -> LoadResult:
        """Locust with the profile's connections as users, trusting the stack's certificate."""
        users = self.users or profile.connections
        result = run_locust(child, users=users, ca_cert=stack.tls_ca, workers=self.workers)
        result.extra["arrival_requested"] = profile.process
        return result
