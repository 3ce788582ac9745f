"""The whole host's CPU use over a phase, from the kernel's per-CPU counters (psutil).

On a machine the loader shares with the stacks, a phase in which every core was near full
measures the stacks' processes and the loader fighting for CPU, not the stacks' design; the
summary row records it so the report can say so beside the figure.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import psutil

SATURATED_PCT: Final = 90.0


@dataclass(frozen=True, slots=True)
class HostCpu:
    """Mean CPU use over all cores and of the busiest core, in percent, over one phase."""

    cpu_pct: float
    busiest_cpu_pct: float
    cpus: int

    @property
    def saturated(self) -> bool:
        """Every core near full: the mean over all of them at or above ``SATURATED_PCT``."""
        return self.cpu_pct >= SATURATED_PCT

    def row_fields(self) -> dict[str, Any]:
        """The summary row's host fields."""
        return {
            "host_cpu_pct": round(self.cpu_pct, 1),
            "host_busiest_cpu_pct": round(self.busiest_cpu_pct, 1),
            "host_saturated": self.saturated,
        }


def busy_pct(before: Any, after: Any) -> float:
    """One CPU's busy share between two ``psutil.cpu_times`` readings: all but idle and iowait
    (guest time is already counted in user on Linux, so the total leaves it out)."""
    fields = [f for f in before._fields if f not in ("guest", "guest_nice")]
    total = sum(getattr(after, f) - getattr(before, f) for f in fields)
    idle = sum(getattr(after, f) - getattr(before, f) for f in ("idle", "iowait") if f in fields)
    return 0.0 if total <= 0 else max(0.0, min(100.0, 100.0 * (total - idle) / total))


@contextmanager
def measure_host_cpu() -> Iterator[list[HostCpu]]:
    """``with measure_host_cpu() as got:`` ... afterwards ``got[0]`` is the phase's HostCpu."""
    out: list[HostCpu] = []
    before = psutil.cpu_times(percpu=True)
    try:
        yield out
    finally:
        after = psutil.cpu_times(percpu=True)
        per = [busy_pct(b, a) for b, a in zip(before, after, strict=True)]
        out.append(HostCpu(sum(per) / len(per), max(per), len(per)))
