"""The whole host's CPU use over a phase (the kernel's per-CPU counters, via psutil), and the
speed of one of its cores.

On a machine the loader shares with the stacks, a phase in which every core was near full
measures the stacks' processes and the loader fighting for CPU, not the stacks' design; the
summary row records it so the report can say so beside the figure. On a shared virtual machine
the same work can also take a third longer from one hour to the next without any sign in the
guest's counters (measured here: every process of the baseline, and the loader, spent about 1.4x
the CPU per request in one sweep as in another an hour later); ``cpu_speed`` is a fixed
yardstick, run at the start and end of every run, so two runs on differently fast hosts say so.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import psutil

from harness.schema import Machine

SATURATED_PCT: Final = 90.0
SPEED_PROBE_S: Final = 0.1
SPEED_PROBES: Final = 5
SPEED_PAYLOAD: Final = b"zerolayer-bench host speed probe " * 32
SPEED_BATCH: Final = 256
SPEED_DIFFERS: Final = 0.25


@dataclass(frozen=True, slots=True)
class HostCpu:
    """Mean CPU use over all cores and of the busiest core, in percent, over one phase."""

    cpu_pct: float
    busiest_cpu_pct: float
    cpus: int

    @property
    def saturated(self) -> bool:
        """The cores near full: their mean, or any single one, at or above ``SATURATED_PCT`` (one
        pegged core of two is a process that could not get more CPU)."""
        return max(self.cpu_pct, self.busiest_cpu_pct) >= SATURATED_PCT

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


def host_cpu_between(before: list[Any], after: list[Any]) -> HostCpu:
    """The host's CPU between two ``psutil.cpu_times(percpu=True)`` readings."""
    per = [busy_pct(b, a) for b, a in zip(before, after, strict=True)]
    return HostCpu(sum(per) / len(per), max(per), len(per))


@contextmanager
def measure_host_cpu() -> Iterator[list[HostCpu]]:
    """``with measure_host_cpu() as got:`` ... afterwards ``got[0]`` is the phase's HostCpu."""
    out: list[HostCpu] = []
    before = psutil.cpu_times(percpu=True)
    try:
        yield out
    finally:
        out.append(host_cpu_between(before, psutil.cpu_times(percpu=True)))


def cpu_speed(duration_s: float = SPEED_PROBE_S, probes: int = SPEED_PROBES) -> float:
    """One core's work rate: SHA-256 digests of a fixed 1 KiB payload per second, the best of
    ``probes`` spans of ``duration_s`` (the best, so that a moment's interruption does not count).
    A yardstick for comparing runs, not a benchmark of anything."""
    return max(_digests_per_s(duration_s) for _ in range(probes))


def _digests_per_s(duration_s: float) -> float:
    done = 0
    start = time.perf_counter()
    deadline = start + duration_s
    while True:
        for _ in range(SPEED_BATCH):
            hashlib.sha256(SPEED_PAYLOAD).digest()
        done += SPEED_BATCH
        now = time.perf_counter()
        if now >= deadline:
            return done / (now - start)


def speed_note(a: Machine, b: Machine) -> str:
    """A line when two runs' hosts ran at speeds more than 25 % apart ('' otherwise), from
    each run's ``machine`` record (the slower of its start and end probes)."""
    speeds = [_slowest(m) for m in (a, b)]
    if None in speeds:
        return ""
    sa, sb = speeds
    assert sa is not None and sb is not None
    change = sb / sa - 1.0
    if abs(change) <= SPEED_DIFFERS:
        return ""
    return (
        f"the hosts ran at different speeds: A {sa:,.0f}, B {sb:,.0f} digests/s per core "
        f"({change:+.0%}): latency and capacity differences may be the machine's"
    )


def _slowest(machine: Machine) -> float | None:
    got = [machine.cpu_speed_start, machine.cpu_speed_end]
    values = [float(v) for v in got if v is not None]
    return min(values) if values else None
