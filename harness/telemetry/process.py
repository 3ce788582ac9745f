"""Per-process CPU and RSS for every named component, so the layer's own CPU share is visible.

CPU is the delta of the process's user+system time over the wall time between two samples (in
percent of one core), plus the cumulative CPU seconds, from which shares over any window follow.

This is the project's one per-process CPU reader: ``cpu_seconds`` for one process, ``read_cpu``
for process trees (a stack's processes and their descendants), ``cpu_spent`` for what each
process spent between two such readings.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from harness.telemetry.sampler import Availability

ROLES = ("loader", "replica", "proxy", "controller", "orchestrator", "ray", "engine", "other")
# The middle layer's processes: Serve's proxy and controller, the orchestrator's ingress (or
# Ray Serve LLM's), and Ray's own (GCS, raylet, agents, idle workers), which only the layer needs.
LAYER_ROLES = ("proxy", "controller", "orchestrator", "ray")


@dataclass(frozen=True, slots=True)
class Component:
    """A process to watch: its name, pid, role (one of ROLES) and stack ("" for the loader)."""

    name: str
    pid: int
    role: str
    stack: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


class ProcessSource:
    """psutil readings per component; a component that exits reports ``alive: 0`` from then on."""

    kind = "process"

    def __init__(self, components: list[Component] | None = None) -> None:
        self._lock = threading.Lock()
        self._procs: dict[str, tuple[Component, psutil.Process | None]] = {}
        self._last: dict[str, tuple[int, float]] = {}
        for component in components or []:
            self.add(component)

    def add(self, component: Component) -> None:
        """Watch a component from now on (replicas and Ray actors appear after the start)."""
        proc: psutil.Process | None
        try:
            proc = psutil.Process(component.pid)
            first = (time.monotonic_ns(), cpu_seconds(proc))
        except psutil.Error:
            proc = None
        with self._lock:
            self._procs[component.name] = (component, proc)
            if proc is not None:
                self._last[component.name] = first

    def remove(self, name: str) -> None:
        with self._lock:
            self._procs.pop(name, None)
            self._last.pop(name, None)

    def open(self) -> Availability:
        return Availability(True)

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._procs.values())
        rows = []
        for component, proc in items:
            base = {
                "name": component.name,
                "pid": component.pid,
                "role": component.role,
                "stack": component.stack,
            }
            try:
                if proc is None:
                    raise psutil.NoSuchProcess(component.pid)
                with proc.oneshot():
                    cpu_s = cpu_seconds(proc)
                    rss = proc.memory_info().rss
            except psutil.Error:
                rows.append({**base, "alive": 0})
                continue
            now = time.monotonic_ns()
            row: dict[str, Any] = {**base, "alive": 1, "cpu_s": cpu_s, "rss_bytes": rss}
            last = self._last.get(component.name)
            if last is not None and now > last[0]:
                row["cpu_pct"] = 100.0 * (cpu_s - last[1]) / ((now - last[0]) / 1e9)
            self._last[component.name] = (now, cpu_s)
            rows.append(row)
        return rows

    def describe(self) -> dict[str, Any]:
        with self._lock:
            comps = [c for c, _ in self._procs.values()]
        return {"components": [{"name": c.name, "role": c.role, "stack": c.stack} for c in comps]}

    def close(self) -> None:
        self._last.clear()


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds ``proc`` has spent so far (its children's not included)."""
    times = proc.cpu_times()
    return float(times.user + times.system)


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    """One process's name and the user + system CPU seconds it has spent (so far, or between
    two readings)."""

    name: str
    seconds: float


def process_tree(pids: Sequence[int]) -> dict[int, psutil.Process]:
    """The processes and all their descendants, by pid (gone ones left out)."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                found[p.pid] = p
    return found


def read_cpu(pids: Sequence[int]) -> dict[int, ProcessCpu]:
    """Name and CPU seconds so far of each process in the trees under ``pids``."""
    out: dict[int, ProcessCpu] = {}
    for pid, proc in process_tree(pids).items():
        with contextlib.suppress(psutil.Error):
            out[pid] = ProcessCpu(proc.name(), cpu_seconds(proc))
    return out


def cpu_spent(
    before: Mapping[int, ProcessCpu], after: Mapping[int, ProcessCpu]
) -> dict[int, ProcessCpu]:
    """What each process in ``after`` spent since ``before``: one new in ``after`` counts whole
    (it started in between); one gone from ``after`` is left out (its last interval is unknown);
    never negative (a pid reused in between)."""
    spent = {}
    for pid, now in after.items():
        then = before.get(pid)
        seconds = now.seconds - then.seconds if then is not None else now.seconds
        spent[pid] = ProcessCpu(now.name, max(0.0, seconds))
    return spent
