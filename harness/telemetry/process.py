"""Per-process CPU and RSS for every named component, so the layer's own CPU share is visible.

CPU is the delta of the process's user+system time over the wall time between two samples (in
percent of one core), plus the cumulative CPU seconds, from which shares over any window follow.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from harness.telemetry.sampler import Availability

ROLES = ("loader", "replica", "proxy", "controller", "orchestrator", "engine", "other")
LAYER_ROLES = ("proxy", "controller", "orchestrator")


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
            first = (time.monotonic_ns(), _cpu_seconds(proc))
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
                    cpu_s = _cpu_seconds(proc)
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


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)
