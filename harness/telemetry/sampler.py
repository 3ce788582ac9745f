"""The one sampler interface and its absolute-schedule loop.

Ticks are laid on ``t0 + k * interval`` rather than "sleep interval after the last sample", so a
slow source never stretches the series; ticks that could not be taken in time are counted as
missed, never silently shifted. Each row carries its scheduled and actual time and the phase label
current at the tick, which is how samples are aligned with the run's phases.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from harness.schema import JsonlWriter, TelemetryInfo

IDLE_PHASE = "idle"


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether a source can sample here, and why not when it cannot (recorded in run.json)."""

    available: bool
    reason: str = ""


@runtime_checkable
class Source(Protocol):
    """A telemetry source: opened once, read once per tick, closed at the end."""

    kind: str

    def open(self) -> Availability:
        """Acquire what reading needs; an unavailable source is skipped, with its reason kept."""
        ...

    def read(self) -> list[dict[str, Any]]:
        """One row per entity (GPU, replica, process); the sampler adds time and phase."""
        ...

    def describe(self) -> dict[str, Any]:
        """What this source samples, for the run metadata."""
        ...

    def close(self) -> None: ...


class PhaseLog:
    """Writes ``phases.jsonl`` and holds the current phase label the sampler stamps on rows.

    Entries: ``{"t_ns", "kind": "phase"|"fault", "event": "start"|"end", "name", ...}``.
    """

    def __init__(self, path: str | Path) -> None:
        self._writer = JsonlWriter(path)
        self._lock = threading.Lock()
        self.current = IDLE_PHASE

    def _write(self, kind: str, event: str, name: str, fields: dict[str, Any]) -> None:
        with self._lock:
            self._writer.write(
                {"t_ns": time.time_ns(), "kind": kind, "event": event, "name": name, **fields}
            )

    def begin(self, name: str, **fields: Any) -> None:
        self.current = name
        self._write("phase", "start", name, fields)

    def end(self, **fields: Any) -> None:
        name, self.current = self.current, IDLE_PHASE
        self._write("phase", "end", name, fields)

    def fault(self, name: str, event: str = "start", **fields: Any) -> None:
        """A fault marker (until the chaos journal exists, the report reads faults from here)."""
        self._write("fault", event, name, fields)

    def close(self) -> None:
        with self._lock:
            self._writer.close()


class Sampler:
    """Samples every available source on an absolute schedule in a background thread."""

    def __init__(
        self,
        sources: list[Source],
        path: str | Path,
        interval_s: float = 0.25,
        phases: PhaseLog | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.sources = sources
        self.interval_ns = int(interval_s * 1e9)
        self.phases = phases
        self.missed = 0
        self.ticks = 0
        self.errors = 0
        self.availability: dict[str, Availability] = {}
        self._writer = JsonlWriter(path)
        self._active: list[Source] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0_ns = 0
        self._t0_mono_ns = 0

    def open(self) -> None:
        """Open every source, keeping the ones available here."""
        for source in self.sources:
            try:
                avail = source.open()
            except Exception as exc:  # a source failing to open must not stop the run
                avail = Availability(False, f"{type(exc).__name__}: {exc}")
            self.availability[source.kind] = avail
            if avail.available:
                self._active.append(source)
        self._t0_ns = time.time_ns()
        self._t0_mono_ns = time.monotonic_ns()

    def describe(self) -> TelemetryInfo:
        """The sources chosen at run time, for ``run.json``."""
        return TelemetryInfo(
            interval_s=self.interval_ns / 1e9,
            sources=[
                {
                    **source.describe(),
                    "kind": source.kind,
                    "available": self.availability.get(source.kind, Availability(False)).available,
                    "reason": self.availability.get(source.kind, Availability(False)).reason,
                }
                for source in self.sources
            ],
            ticks=self.ticks,
            missed_ticks=self.missed,
            read_errors=self.errors,
        )

    def tick(self, seq: int | None = None) -> int:
        """Read every active source once and write its rows; returns the rows written."""
        seq = self.ticks if seq is None else seq
        sched_ns = self._t0_ns + seq * self.interval_ns
        phase = self.phases.current if self.phases is not None else IDLE_PHASE
        written = 0
        for source in self._active:
            t_ns = time.time_ns()
            try:
                rows = source.read()
            except Exception as exc:  # one bad read is data, not a crash
                self.errors += 1
                rows = [{"error": f"{type(exc).__name__}: {exc}"}]
            for row in rows:
                self._writer.write(
                    {
                        "t_ns": t_ns,
                        "sched_ns": sched_ns,
                        "seq": seq,
                        "phase": phase,
                        "source": source.kind,
                        **row,
                    }
                )
                written += 1
        self.ticks += 1
        return written

    def _loop(self) -> None:
        k = 0
        while not self._stop.is_set():
            delay_ns = self._t0_mono_ns + k * self.interval_ns - time.monotonic_ns()
            if delay_ns > 0:
                if self._stop.wait(delay_ns / 1e9):
                    return
            elif -delay_ns >= self.interval_ns:
                late = (time.monotonic_ns() - self._t0_mono_ns) // self.interval_ns
                self.missed += late - k
                k = late
            self.tick(k)
            k += 1

    def start(self) -> None:
        if not self._t0_ns:
            self.open()
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop, close sources and flush; safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        for source in self._active:
            source.close()
        self._active = []
        self._writer.close()

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
