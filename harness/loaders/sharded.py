"""The native loader as N Ray actors (``--loader-workers N``): one seeded schedule, sharded.

Each request goes to shard ``xxh64(session) % N`` (a request with no session by its id), so a
session's turns stay in one worker, in order, and the SDK's ring routes them as one loader
would. Every worker is a ``LoaderWorker`` actor, placed where the placement file's ``[loaders]``
says (else spread over the nodes), named in the run's namespace and reused by every trial.

One start for all: the driver measures each worker's clock against its own (the best of a few
round trips: offset, and half the round trip as its uncertainty), picks a start time a moment
ahead on its own clock, and each worker starts its shard at that time on its clock. Each worker
runs the native loader (``run_schedule``: open loop, uvloop, the SDK's callback API) on its
node and streams its records back as it writes them (a Ray streaming generator over its
records file); the driver shifts each record onto its own clock, appends it to the one records
file as it arrives (an interrupted run keeps what arrived), and checks at the end that the
merged records hold every request id of the schedule exactly once. The result is valid only
if every worker kept to its schedule: each worker's own lag is judged by the run's lag rule,
beside the merged records'; a worker that died leaves its unreported requests as errors
(``loader_worker_lost``) and the cluster is checked for a lost node.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson
import uvloop
from xxhash import xxh64_intdigest

from harness.cluster.placement import LOADERS
from harness.errors import ClusterError
from harness.loaders.base import (
    DEFAULT_GRACE_S,
    LoadResult,
    make_result,
    new_record,
    replica_counts,
    wire_protocol,
)
from harness.loaders.native import run_schedule
from harness.loaders.senders import client_sender
from harness.metrics import LAG_FRACTION_OF_MEDIAN, lag_reason, summarize
from harness.progress import ProgressStyle, load_phase, report_phase
from harness.schema import JsonlWriter, PlacedProcess, RequestRecord, from_data

if TYPE_CHECKING:
    from harness.cluster.nodes import ClusterNode
    from harness.cluster.session import ClusterSession
    from harness.profile import Profile
    from harness.stacks import Credentials, Stack
    from harness.workload import PlannedRequest

WORKER_PREFIX: Final = "zl-loader-"
LOADER_GROUP: Final = "loader"
CLOCK_PROBES: Final = 7
START_LEAD_S: Final = 2.0
STREAM_EVERY_S: Final = 0.2
WORKER_LOST: Final = "loader_worker_lost"
NOT_REPORTED: Final = "not_reported"
_TIMES: Final = ("intended_start_ns", "dispatch_ns", "sent_ns", "first_token_ns", "end_ns")


def shard_of(request: PlannedRequest, workers: int) -> int:
    """The worker that sends ``request``: by its session (its id where it has none)."""
    return xxh64_intdigest((request.session or request.request_id).encode()) % workers


def shards(schedule: Sequence[PlannedRequest], workers: int) -> list[list[PlannedRequest]]:
    """The schedule split into ``workers`` shards, each in the schedule's order."""
    out: list[list[PlannedRequest]] = [[] for _ in range(workers)]
    for request in schedule:
        out[shard_of(request, workers)].append(request)
    return out


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """What a worker on another node needs to open the stack's client as ``Stack.open_client``
    does: its protocol, URLs, CA certificate (its bytes: the file is on the driver's host),
    model, body fields and credentials."""

    protocol: str
    urls: tuple[str, ...]
    tls_ca: bytes | None = None
    model: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    credentials: Credentials | None = None

    @classmethod
    def of(cls, stack: Stack) -> ClientSpec:
        ca = stack.tls_ca.read_bytes() if stack.tls_ca is not None else None
        return cls(stack.protocol, tuple(stack.urls), ca, stack.model, dict(stack.extra_body),
                   stack.credentials)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Clock:
    """A worker's clock against the driver's: ``offset_ns`` (worker minus driver, from the best
    round trip) and ``rtt_ns`` (that round trip; the offset is known to within half of it)."""

    offset_ns: int
    rtt_ns: int

    @property
    def applied_ns(self) -> int:
        """The offset the driver corrects for: the measured one where the clocks are
        measurably apart (beyond half the round trip), else none (one clock, as on one host)."""
        return self.offset_ns if abs(self.offset_ns) > self.rtt_ns // 2 else 0


@dataclass(frozen=True, slots=True)
class ShardRun:
    """One worker's part of a run, as the driver hands it over."""

    schedule: list[PlannedRequest]
    client: ClientSpec
    stack: str
    profile: str
    start_wall_ns: int
    grace_s: float
    lag_fraction: float
    client_options: Mapping[str, Any]
    nice: int | None


def _complete_lines(path: Path, position: int) -> tuple[bytes, int]:
    """The whole lines written to ``path`` after ``position``, and the new position."""
    if not path.exists():
        return b"", position
    with open(path, "rb") as fh:
        fh.seek(position)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    return data[:end], position + end


class LoaderWorker:
    """One shard's loader, as a Ray actor on its node (see the module docstring)."""

    def where(self) -> tuple[str, str, int]:
        """(node id, node address, pid)."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def now_ns(self) -> int:
        return time.time_ns()

    def drive(self, shard: ShardRun) -> Iterator[bytes | dict[str, Any]]:
        """Run the shard from its start time; yield its records file's new lines as they are
        written, then a dict with the run's extras (or its error)."""
        folder = Path(tempfile.mkdtemp(prefix="zl-loader-"))
        path = folder / "records.jsonl"
        outcome: dict[str, Any] = {}
        thread = threading.Thread(target=self._run, args=(shard, path, folder, outcome))
        thread.start()
        position = 0
        try:
            while thread.is_alive():
                thread.join(STREAM_EVERY_S)
                chunk, position = _complete_lines(path, position)
                if chunk:
                    yield chunk
            chunk, position = _complete_lines(path, position)
            if chunk:
                yield chunk
            yield outcome
        finally:
            thread.join()
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _run(shard: ShardRun, path: Path, folder: Path, outcome: dict[str, Any]) -> None:
        if shard.nice is not None:
            with contextlib.suppress(PermissionError):
                os.setpriority(os.PRIO_PROCESS, 0, shard.nice)
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                result = runner.run(_drive_shard(shard, path, folder))
            outcome["extra"] = result.extra
        except BaseException as exc:  # reported to the driver, which records it
            outcome["error"] = f"{type(exc).__name__}: {exc}"


async def _drive_shard(shard: ShardRun, path: Path, folder: Path) -> LoadResult:
    from harness.stacks.clients import open_client

    spec = shard.client
    ca = None
    if spec.tls_ca is not None:
        ca = folder / "ca.pem"
        ca.write_bytes(spec.tls_ca)
    key = None if spec.credentials is None else spec.credentials.default_key
    options = {"grace_ms": int(shard.grace_s * 1000), **shard.client_options}
    async with open_client(
        spec.protocol, spec.urls, ca, model=spec.model, extra_body=spec.extra_body, api_key=key,
        **options,
    ) as client:  # fmt: skip
        return await run_schedule(
            shard.schedule, client_sender(client, spec.credentials), stack=shard.stack,
            profile=shard.profile, records_path=path, grace_s=shard.grace_s,
            lag_fraction=shard.lag_fraction, start_wall_ns=shard.start_wall_ns,
        )  # fmt: skip


def measure_clock(worker: Any, probes: int = CLOCK_PROBES) -> Clock:
    """The worker's clock offset from the driver's, by the best of ``probes`` round trips."""
    import ray

    best: Clock | None = None
    for _ in range(probes):
        sent = time.time_ns()
        theirs = ray.get(worker.now_ns.remote(), timeout=60)
        back = time.time_ns()
        clock = Clock(theirs - (sent + back) // 2, back - sent)
        if best is None or clock.rtt_ns < best.rtt_ns:
            best = clock
    assert best is not None
    return best


def shifted(line: bytes, offset_ns: int) -> RequestRecord:
    """A worker's record line on the driver's clock (every time less the worker's offset)."""
    rec = from_data(RequestRecord, orjson.loads(line))
    for name in _TIMES:
        value = getattr(rec, name)
        if value:
            setattr(rec, name, value - offset_ns)
    rec.chunk_ns = [t - offset_ns for t in rec.chunk_ns]
    return rec


@dataclass
class WorkerReport:
    """What one worker sent back: its place and clock, how many requests its shard held, the
    records it streamed (on the driver's clock), its extras and any error."""

    index: int
    place: PlacedProcess
    clock: Clock
    scheduled: int
    records: list[RequestRecord] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    def reasons(self, lag_fraction: float) -> list[str]:
        """Why this worker did not keep to its schedule (empty when it did)."""
        who = f"loader worker {self.index} on {self.place.node}"
        if self.error:
            return [f"{who} failed: {self.error}"]
        stats = summarize(self.records, lag_fraction=lag_fraction)
        lagged = lag_reason(stats, lag_fraction=lag_fraction)
        return [f"{who}: {lagged}"] if lagged else []

    def describe(self, lag_fraction: float) -> dict[str, Any]:
        stats = summarize(self.records, lag_fraction=lag_fraction)
        return {
            "index": self.index,
            "node": self.place.node,
            "node_id": self.place.node_id,
            "pid": self.place.pid,
            "scheduled": self.scheduled,
            "records": len(self.records),
            "clock_offset_us": self.clock.offset_ns / 1e3,
            "clock_uncertainty_us": self.clock.rtt_ns / 2e3,
            "clock_applied_us": self.clock.applied_ns / 1e3,
            "p99_lag_ms": stats["p99_lag_ms"],
            "loader_cpu_us_per_request": self.extra.get("loader_cpu_us_per_request"),
            "kept_schedule": not self.reasons(lag_fraction),
            "error": self.error,
        }


def merge_check(
    schedule: Sequence[PlannedRequest],
    reports: Sequence[WorkerReport],
    labels: tuple[str, str],
    start_ns: int,
) -> tuple[list[RequestRecord], list[str]]:
    """The records no worker reported, as errors (``loader_worker_lost`` where the worker
    failed, else ``not_reported``; intended at ``start_ns`` plus their offset), and why the
    merge is not the schedule exactly (a request id missing, twice, or not scheduled)."""
    counts: dict[str, int] = {}
    for report in reports:
        for rec in report.records:
            counts[rec.request_id] = counts.get(rec.request_id, 0) + 1
    failed = {i for i, r in enumerate(reports) if r.error}
    workers = len(reports)
    fills = []
    for req in schedule:
        if req.request_id in counts:
            continue
        rec = new_record(req, *labels, "native", start_ns + int(req.offset_s * 1e9))
        rec.end_ns = rec.intended_start_ns
        rec.outcome = "error"
        rec.error_code = WORKER_LOST if shard_of(req, workers) in failed else NOT_REPORTED
        fills.append(rec)
    scheduled = {req.request_id for req in schedule}
    twice = sorted(i for i, n in counts.items() if n > 1)
    stray = sorted(set(counts) - scheduled)
    reasons = []
    if fills:
        reasons.append(f"{len(fills)} scheduled requests have no record from their worker")
    if twice or stray:
        reasons.append(
            f"the merged records are not the schedule: {len(twice)} ids twice, {len(stray)} "
            "ids not scheduled"
        )
    return fills, reasons


def _session() -> ClusterSession:
    from harness.cluster.session import current

    session = current()
    if session is None:
        raise RuntimeError("loader workers run on a Ray cluster: open a cluster session first")
    return session


@dataclass(frozen=True)
class ShardedLoader:
    """The native loader as ``workers`` Ray actors over a whole stack (the module docstring).
    ``nice``: the niceness each worker's loader thread asks for (the run's loader priority)."""

    workers: int
    name: str = field(default="native", init=False)
    grace_s: float = DEFAULT_GRACE_S
    progress: ProgressStyle | None = ProgressStyle.AUTO
    lag_fraction: float | None = None
    client_options: Mapping[str, Any] = field(default_factory=dict)
    nice: int | None = None

    def run(
        self,
        schedule: Sequence[PlannedRequest],
        stack: Stack,
        profile: Profile,
        records_path: Path,
        workdir: Path,
    ) -> LoadResult:
        """Drive ``stack`` with ``schedule`` from every worker at once; merged, checked."""
        del workdir  # each worker keeps its own files on its node
        session = _session()
        placed, clocks = self._ready_workers(session)
        reports = [WorkerReport(i, place, clocks[i], 0) for i, (_, place) in enumerate(placed)]
        start_ns = time.time_ns() + int(START_LEAD_S * 1e9)
        labels = (str(stack.name), profile.name)
        runs = self._shard_runs(schedule, stack, labels, reports, start_ns)
        _collect([actor for actor, _ in placed], runs, reports, records_path)
        for report in reports:  # a worker that died: the next check waits for its node's fate
            if report.error and not report.extra:
                session.suspect(report.place.node_id, report.error)
        fills, reasons = merge_check(schedule, reports, labels, start_ns)
        if fills:
            with JsonlWriter(records_path) as writer:
                writer.write_many(fills)
        return self._result(schedule, stack, profile, records_path, reports, fills, reasons)

    def _ready_workers(
        self, session: ClusterSession
    ) -> tuple[list[tuple[Any, PlacedProcess]], list[Clock]]:
        """Every worker placed and its clock measured; a worker that cannot be reached (its
        node lost) stops the run with the cluster's verdict on its node."""
        nodes = session.assign(LOADERS, self.workers)
        try:
            placed = [self._worker(session, i, node) for i, node in enumerate(nodes)]
            return placed, [measure_clock(actor) for actor, _ in placed]
        except Exception as exc:
            for node in nodes:
                session.suspect(node.node_id, type(exc).__name__)
            session.check()  # a lost node: ClusterError naming it
            raise ClusterError(f"the loader workers cannot be reached: {exc}") from exc

    def _worker(
        self, session: ClusterSession, index: int, node: ClusterNode
    ) -> tuple[Any, PlacedProcess]:
        """Worker ``index``'s actor on ``node`` (made once a run, then reused), recorded with
        its node's agent watching its CPU."""
        import ray

        from harness.stacks.placed import agent_on
        from harness.telemetry import Component

        name = f"{WORKER_PREFIX}{index}"
        actor = session.actor_on(LoaderWorker, name, node, num_cpus=0, max_concurrency=2)
        known = {p.name: p for p in session.placed(LOADER_GROUP)}
        if name in known and known[name].node_id == node.node_id:
            return actor, known[name]
        _, ip, pid = ray.get(actor.where.remote(), timeout=120)
        place = PlacedProcess(
            LOADER_GROUP, "loader-worker", name, node.node_id, node.label, ip, pid
        )
        session.add(place)
        watcher = agent_on(session, node).watch.remote([Component(name, pid, "loader")])
        ray.get(watcher, timeout=60)
        return actor, place

    def _shard_runs(
        self,
        schedule: Sequence[PlannedRequest],
        stack: Stack,
        labels: tuple[str, str],
        reports: list[WorkerReport],
        start_ns: int,
    ) -> list[ShardRun]:
        lag = LAG_FRACTION_OF_MEDIAN if self.lag_fraction is None else self.lag_fraction
        client = ClientSpec.of(stack)
        runs = []
        for report, shard in zip(reports, shards(schedule, self.workers), strict=True):
            report.scheduled = len(shard)
            start = start_ns + report.clock.applied_ns
            options = dict(self.client_options)
            runs.append(
                ShardRun(shard, client, *labels, start, self.grace_s, lag, options, self.nice)
            )
        return runs

    def _result(
        self,
        schedule: Sequence[PlannedRequest],
        stack: Stack,
        profile: Profile,
        records_path: Path,
        reports: Sequence[WorkerReport],
        fills: Sequence[RequestRecord],
        reasons: Sequence[str],
    ) -> LoadResult:
        lag = LAG_FRACTION_OF_MEDIAN if self.lag_fraction is None else self.lag_fraction
        records = [rec for report in reports for rec in report.records] + list(fills)
        kept = [reason for report in reports for reason in report.reasons(lag)]
        cpu = [r.extra.get("loader_cpu_us_per_request") for r in reports]
        weights = [r.scheduled for r in reports]
        result = make_result(
            "native", str(stack.name), profile.name, records_path, records,
            lag_fraction=lag, extra_reasons=[*reasons, *kept],
            protocol=wire_protocol(stack.protocol),
            extra={
                "scheduled": len(schedule),
                "loader_workers": self.workers,
                "sharding": "xxh64(session) % workers",
                "start_lead_s": START_LEAD_S,
                "workers": [r.describe(lag) for r in reports],
                "loader_cpu_us_per_request": _weighted(cpu, weights),
                "arrival": profile.process,
                "per_replica": replica_counts(records),
            },
        )  # fmt: skip
        report_phase(self.progress, load_phase(stack.name, profile, len(schedule)), records)
        return result


def _weighted(values: Sequence[float | None], weights: Sequence[int]) -> float | None:
    pairs = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None and w]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def _collect(
    actors: Sequence[Any], runs: Sequence[ShardRun], reports: Sequence[WorkerReport], path: Path
) -> None:
    """Every worker's stream, each read by a thread of its own, its records appended to
    ``path`` as they arrive; returns once every stream has ended."""
    lock = threading.Lock()
    with JsonlWriter(path) as writer:
        threads = [
            threading.Thread(target=_consume, args=(actor, run, report, writer, lock), daemon=True)
            for actor, run, report in zip(actors, runs, reports, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _consume(
    actor: Any, run: ShardRun, report: WorkerReport, writer: JsonlWriter, lock: threading.Lock
) -> None:
    """One worker's stream: record lines (shifted onto the driver's clock, written), then its
    extras; an actor that dies (its node lost) leaves its error."""
    import ray

    try:
        for ref in actor.drive.remote(run):
            item = ray.get(ref)
            if isinstance(item, dict):
                report.extra = dict(item.get("extra") or {})
                report.error = str(item.get("error") or "")
                continue
            recs = [shifted(line, report.clock.applied_ns) for line in item.splitlines() if line]
            with lock:
                writer.write_many(recs)
                report.records.extend(recs)
    except Exception as exc:  # its first sentence: Ray's messages run on for lines
        report.error = f"{type(exc).__name__}: {str(exc).split('. ')[0].splitlines()[0]}"
