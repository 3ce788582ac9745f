"""Steady-state probes: an SLI over a sliding window, and whether the stack is whole.

The SLI is the share of good requests: completed, with TTFT measured from the request's
*intended* send time (coordinated-omission free) within the SLO. It is computed from the
per-request JSONL the background load writes as each request ends, so a probe sees what a
monitor fed by client logs would see. A request counts in the window at the moment it is *known*:
a good one when it ends, a bad one when it ends or, if it had no first token by then, at its
intended start plus the TTFT SLO (from then on it is known to be late). ``chaos.recovery``
evaluates the same function after the run, over the whole log, on a fine time grid.
"""

from __future__ import annotations

import dataclasses
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from chaos.actions import live_pids
from chaos.targets import load_target
from harness.schema import RequestRecord, read_requests

NS: Final = 1_000_000_000
DEFAULT_WINDOW_S: Final = 2.0
DEFAULT_SLO_TTFT_MS: Final = 1000.0
DEFAULT_TARGET: Final = 0.95
POLL_S: Final = 0.2


@dataclass(frozen=True, slots=True)
class Verdict:
    """One request judged against the SLO: good or bad, and when that became known."""

    good: bool
    known_ns: int
    intended_ns: int
    end_ns: int
    outcome: str
    replica: str


def judge(rec: RequestRecord, slo_ttft_ms: float) -> Verdict:
    """Good when completed with TTFT (from the intended start) within ``slo_ttft_ms``."""
    slo_ns = int(slo_ttft_ms * 1e6)
    late_at = rec.intended_start_ns + slo_ns
    first = rec.first_token_ns
    on_time = bool(first) and first <= late_at
    good = rec.outcome == "completed" and on_time
    end = rec.end_ns or late_at
    known = end if good or on_time else min(end, late_at)
    return Verdict(good, known, rec.intended_start_ns, rec.end_ns, rec.outcome, rec.replica)


def visible(verdict: Verdict) -> Verdict:
    """``verdict`` as a live reader of the request log can know it: no earlier than the request
    ended, when the loader writes its record. A request late past its SLO is known bad at its
    deadline afterwards (the recovery figures), but live it shows only once it ends: dated at
    its deadline, a stack slower than the SLO plus the window would read an empty window (no
    SLI) instead of a bad one."""
    return dataclasses.replace(verdict, known_ns=max(verdict.known_ns, verdict.end_ns))


class SliSeries:
    """Verdicts sorted by the time they became known, for windowed SLI queries."""

    def __init__(self, verdicts: Iterable[Verdict]) -> None:
        self.verdicts = sorted(verdicts, key=lambda v: v.known_ns)
        self.known = [v.known_ns for v in self.verdicts]
        self._good = [0]
        for v in self.verdicts:
            self._good.append(self._good[-1] + int(v.good))

    @classmethod
    def from_records(cls, records: Iterable[RequestRecord], slo_ttft_ms: float) -> SliSeries:
        return cls(judge(r, slo_ttft_ms) for r in records)

    def window(self, t_ns: int, window_s: float) -> tuple[int, int]:
        """(good, total) of the verdicts known in ``(t - window, t]``."""
        lo = bisect_right(self.known, t_ns - int(window_s * NS))
        hi = bisect_right(self.known, t_ns)
        return self._good[hi] - self._good[lo], hi - lo

    def sli(self, t_ns: int, window_s: float) -> float | None:
        """The SLI at ``t_ns`` over the window; None when no request is known in it."""
        good, total = self.window(t_ns, window_s)
        return good / total if total else None

    def grid(self, start_ns: int, end_ns: int, step_s: float, window_s: float) -> list[tuple]:
        """``(t_ns, sli)`` every ``step_s`` from ``start_ns`` to ``end_ns`` (sli may be None)."""
        step = int(step_s * NS)
        return [(t, self.sli(t, window_s)) for t in range(start_ns, end_ns + 1, step)]


def _settings(configuration: dict[str, Any] | None) -> tuple[Path, float, float, float]:
    conf = configuration or {}
    return (
        Path(conf["requests_path"]),
        float(conf.get("sli_window_s", DEFAULT_WINDOW_S)),
        float(conf.get("slo_ttft_ms", DEFAULT_SLO_TTFT_MS)),
        float(conf.get("sli_target", DEFAULT_TARGET)),
    )


def _read(path: Path) -> Sequence[RequestRecord]:
    return read_requests(path) if path.exists() else []


def sli(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rolling SLI now, from the live request log (``configuration["requests_path"]``)."""
    path, window_s, slo_ms, target = _settings(configuration)
    series = SliSeries(visible(judge(r, slo_ms)) for r in _read(path))
    now = time.time_ns()
    good, total = series.window(now, window_s)
    value = good / total if total else None
    return {
        "sli": value,
        "good": good,
        "requests": total,
        "window_s": window_s,
        "slo_ttft_ms": slo_ms,
        "target": target,
        "t_ns": now,
    }


def within_target(
    value: dict[str, Any] | None = None, configuration: dict[str, Any] | None = None
) -> bool:
    """Tolerance for :func:`sli`: at or above ``configuration["sli_target"]`` (an empty window
    while load runs means nothing came back, which is not within target)."""
    target = float((configuration or {}).get("sli_target", DEFAULT_TARGET))
    return value is not None and value.get("sli") is not None and value["sli"] >= target


_load_running: Callable[[], bool] | None = None


def follow_load(running: Callable[[], bool] | None) -> None:
    """Say whether the experiment's background load still runs (``chaos.controls`` owns it, and
    sets this while one runs; ``None`` when none does)."""
    global _load_running
    _load_running = running


def load_running() -> bool:
    """Whether a request may still be sent or answered, so that the SLI may yet change."""
    return _load_running is not None and _load_running()


def sli_recovers(
    timeout_s: float = 20.0, configuration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Poll :func:`sli` until it is within target, ``timeout_s`` passes, or the experiment's
    load has ended (nothing can come back after it, so the window can only empty: CI's loaded
    host spent the rest of a timeout grown with its stand-up waiting for that); the last
    reading, with how long it took (the after-fault hypothesis: did the stack get back by
    itself?)."""
    start = time.monotonic()
    deadline = start + timeout_s
    while True:
        ended = not load_running()  # before the reading, so that the reading sees its last answers
        reading = sli(configuration)
        if within_target(reading, configuration) or time.monotonic() >= deadline or ended:
            reading["waited_s"] = round(time.monotonic() - start, 3)
            return reading
        time.sleep(POLL_S)


def replicas(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Live engine replica processes (zero-layer replicas or baseline engines) against how
    many the stack was stood up with, and the live pids of every role."""
    target = load_target(configuration)
    pids = live_pids(target)
    return {
        "alive": len(pids.get(target.engine_role, [])),
        "expected": target.engine_replicas,
        "pids": pids,
    }


def all_alive(value: dict[str, Any] | None = None) -> bool:
    """Tolerance for :func:`replicas`: every engine replica the stack was stood up with runs."""
    return value is not None and int(value["alive"]) >= int(value["expected"])
