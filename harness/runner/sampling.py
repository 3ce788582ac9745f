"""The telemetry a run samples while its stacks are up: host, GPU, processes and engines, each
row stamped with the phase (a profile on a stack, a sweep point, a chaos experiment) it fell in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from harness import schema
from harness.cluster import current
from harness.metrics import prefix_cache_stats
from harness.runner.results import RunDir
from harness.schema import PrefixCacheStats, TelemetryInfo
from harness.stacks import Stack
from harness.stacks.placed import NodeTelemetry, watch_placed
from harness.telemetry import (
    Component,
    EngineSource,
    EngineTarget,
    NvmlSource,
    PhaseLog,
    ProcessSource,
    Sampler,
)
from harness.telemetry.engine import named_reads, phase_rows


@contextlib.contextmanager
def phase(log: PhaseLog | None, name: str, **fields: Any) -> Iterator[None]:
    """``name`` is the phase in ``log`` (where there is one) while the block runs, and ends
    however the block does, so no sample after it is stamped with it."""
    if log is None:
        yield
        return
    log.begin(name, **fields)
    try:
        yield
    finally:
        log.end()


class Telemetry:
    """The sampler and its engine and process sources, fed each stack while it is up."""

    def __init__(self, run: RunDir, interval_s: float) -> None:
        self.phases = PhaseLog(run.path / schema.PHASES)
        self.path = run.path / schema.TELEMETRY
        self.engines, self.procs = EngineSource(), ProcessSource()
        self.procs.add(Component("loader", os.getpid(), "loader"))
        self.watched: dict[str, list[EngineTarget]] = {}
        self.sampler = Sampler(
            [NvmlSource(), self.engines, self.procs, NodeTelemetry()],
            run.path / schema.TELEMETRY,
            interval_s,
            self.phases,
        )

    def start(self) -> TelemetryInfo:
        self.sampler.open()
        self.sampler.start()
        return self.sampler.describe()

    def watch(self, stack: Stack) -> None:
        """The stack's engines, and its processes: by the agent of the node each runs on when
        the run placed them on a cluster, else here."""
        self.watched[stack.name] = stack.engine_targets()
        for target in self.watched[stack.name]:
            self.engines.add(target)
        session = current()
        components = stack.components()
        if session is None or not watch_placed(session, stack.name, components):
            for component in components:
                self.procs.add(component)

    def last_reads(self, stack: Stack) -> dict[str, dict[str, Any]]:
        """Each engine's counters read once more after the last request (the sampler's last
        tick may predate it), so per-replica totals such as ``requests_total`` are final."""
        reads: dict[str, dict[str, Any]] = {}
        for target in self.watched.get(stack.name, []):
            try:
                reads[target.name] = target.read()
            except Exception as exc:  # a replica that is gone is recorded, not fatal
                reads[target.name] = {"error": f"{type(exc).__name__}: {exc}"}
        return reads

    def prefix_cache(
        self, stack: Stack, phase: str, before: dict[str, dict[str, Any]], completed: int
    ) -> PrefixCacheStats:
        """The stack's prefix-cache counters over one phase: each replica read just before it
        (``before``), sampled during it, and read once more now, summed over replicas."""
        samples = [
            *named_reads(before),
            *phase_rows(self.path, stack.name, phase),
            *named_reads(self.last_reads(stack)),
        ]
        return prefix_cache_stats(samples, completed)

    def unwatch(self, stack: Stack) -> None:
        self.watched.pop(stack.name, None)
        self.engines.drop_stack(stack.name)

    def stop(self) -> None:
        self.sampler.stop()
        self.phases.close()


@contextlib.contextmanager
def sampling(run: RunDir, interval_s: float) -> Iterator[Telemetry]:
    """The run's telemetry, sampled for as long as the block runs; run.json says what it
    samples."""
    tele = Telemetry(run, interval_s)
    try:
        run.meta.telemetry = tele.start()
        run.save()
        yield tele
    finally:
        tele.stop()
