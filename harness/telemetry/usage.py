"""What a stack's processes used over a window of the run: CPU seconds and memory, the whole
stack's and its middle layer's, from the process telemetry (``ProcessSource`` rows).

CPU is the difference of each process's cumulative CPU seconds between its first and last
sample in the window; memory is each process's mean RSS over its samples in the window, summed
over processes. The loader is never part of a stack. ``phase_windows`` turns the phase log into
the windows of the trials it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from harness.telemetry.process import LAYER_ROLES

Window = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Usage:
    """One stack over one window: CPU seconds and mean resident memory (bytes), all of its
    processes and those of its middle layer (``LAYER_ROLES``); ``cores`` is the host's."""

    window_s: float
    cores: int
    cpu_s: float
    layer_cpu_s: float
    rss_bytes: float
    layer_rss_bytes: float
    processes: int
    layer_processes: int

    @property
    def cpu_pct(self) -> float:
        """The stack's CPU as a share of the host's (every core), in percent."""
        return 100.0 * self.cpu_s / (self.window_s * max(1, self.cores))

    @property
    def layer_cpu_share(self) -> float | None:
        """The layer's share of the stack's CPU (None without layer processes or CPU)."""
        if self.cpu_s <= 0 or not self.layer_processes:
            return None
        return self.layer_cpu_s / self.cpu_s

    @property
    def layer_rss_share(self) -> float | None:
        if self.rss_bytes <= 0 or not self.layer_processes:
            return None
        return self.layer_rss_bytes / self.rss_bytes


def phase_windows(phases: Iterable[Mapping[str, Any]]) -> dict[str, Window]:
    """Each phase's (start, end) in wall-clock ns, by name, from the phase log's entries."""
    starts: dict[str, int] = {}
    out: dict[str, Window] = {}
    for entry in phases:
        if entry.get("kind") != "phase":
            continue
        name = str(entry.get("name", ""))
        if entry.get("event") == "start":
            starts[name] = int(entry["t_ns"])
        elif entry.get("event") == "end" and name in starts:
            out[name] = (starts[name], int(entry["t_ns"]))
    return out


@dataclass(slots=True)
class _Process:
    role: str
    first_cpu: float
    last_cpu: float
    rss: list[float]


def stack_usage(
    telemetry: Iterable[Mapping[str, Any]], stack: str, window: Window, cores: int
) -> Usage | None:
    """``stack``'s processes over ``window``; None when no process of it was sampled there."""
    seen: dict[str, _Process] = {}
    for row in telemetry:
        if row.get("source") != "process" or row.get("stack") != stack or "cpu_s" not in row:
            continue
        if row.get("role") == "loader" or not window[0] <= row.get("t_ns", 0) <= window[1]:
            continue
        spent = float(row["cpu_s"])
        proc = seen.setdefault(row["name"], _Process(str(row["role"]), spent, spent, []))
        proc.last_cpu = spent
        proc.rss.append(float(row.get("rss_bytes", 0)))
    if not seen:
        return None
    layer = [p for p in seen.values() if p.role in LAYER_ROLES]

    def cpu(procs: Iterable[_Process]) -> float:
        return sum(max(0.0, p.last_cpu - p.first_cpu) for p in procs)

    def rss(procs: Iterable[_Process]) -> float:
        return sum(sum(p.rss) / len(p.rss) for p in procs if p.rss)

    return Usage(
        window_s=(window[1] - window[0]) / 1e9,
        cores=cores,
        cpu_s=cpu(seen.values()),
        layer_cpu_s=cpu(layer),
        rss_bytes=rss(seen.values()),
        layer_rss_bytes=rss(layer),
        processes=len(seen),
        layer_processes=len(layer),
    )
