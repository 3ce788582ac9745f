"""Live progress of a load phase: a rich bar on a terminal, a plain line now and then in CI logs.

A loader hands each ended request to ``PhaseProgress.ended``, which only counts it and puts its
E2EL (vLLM's: end - sent) into a ``LogHistogram``: a few hundred nanoseconds on the loader's hot
path. Everything that costs more (the running p99, formatting, drawing) happens in ``refresh``,
which the loader calls at most every ``every_s`` (a quarter second for the bar, ``LINES_EVERY_S``
for lines) and where it has room before its next send, so a redraw does not show up as lag.
"""

from __future__ import annotations

import bisect
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Final, Protocol, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.metrics import run_duration_s
from harness.schema import RequestRecord

if TYPE_CHECKING:
    from harness.profile import Profile

LINES_EVERY_S: Final = 10.0
BAR_EVERY_S: Final = 0.25
HIST_PRECISION: Final = 0.01
HIST_HIGHEST_US: Final = 3_600_000_000.0
RUNNING_PERCENTILE: Final = 99.0
NS_PER_US: Final = 1000.0
US_PER_MS: Final = 1000.0


class ProgressStyle(StrEnum):
    """How a phase shows its progress: ``auto`` is ``bar`` on a terminal, ``lines`` elsewhere."""

    AUTO = "auto"
    BAR = "bar"
    LINES = "lines"
    QUIET = "quiet"


def resolve_style(style: ProgressStyle | None, stream: TextIO | None = None) -> ProgressStyle:
    """``auto`` made concrete for ``stream`` (stdout by default); None means quiet."""
    if style is None:
        return ProgressStyle.QUIET
    if ProgressStyle(style) is ProgressStyle.AUTO:
        is_tty = Console(file=stream or sys.stdout).is_terminal
        return ProgressStyle.BAR if is_tty else ProgressStyle.LINES
    return ProgressStyle(style)


class LogHistogram:
    """Counts in buckets of constant relative width (``precision``): O(1) to record, and any
    percentile within about ``precision / 2`` of the nearest-rank value. Values below 1 read as 1.
    """

    __slots__ = ("_counts", "_last", "_scale", "count")

    def __init__(self, precision: float = HIST_PRECISION, highest: float = HIST_HIGHEST_US) -> None:
        self._scale = 1.0 / math.log1p(precision)
        self._last = int(math.log(highest) * self._scale) + 1
        self._counts = [0] * (self._last + 1)
        self.count = 0

    def record(self, value: float) -> None:
        i = int(math.log(value) * self._scale) if value > 1.0 else 0
        self._counts[i if i < self._last else self._last] += 1
        self.count += 1

    def percentile(self, q: float) -> float | None:
        """The nearest-rank ``q``-th percentile (numpy's ``inverted_cdf``), or None if empty."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count / 100.0))
        i = bisect.bisect_left(list(itertools.accumulate(self._counts)), rank)
        return math.exp((i + 0.5) / self._scale)


@dataclass(frozen=True, slots=True)
class Phase:
    """What a phase is: its label (``zerolayer / a_latency @ 8 req/s``), rate and size."""

    label: str
    rate: float
    total: int


@dataclass(frozen=True, slots=True)
class PhaseCounts:
    """A phase's progress at one refresh."""

    phase: Phase
    completed: int
    errors: int
    lost: int
    in_flight: int
    elapsed_s: float
    p99_e2el_ms: float | None

    @property
    def ended(self) -> int:
        return self.completed + self.errors + self.lost


class ProgressView(Protocol):
    """Where a phase's progress is shown."""

    @property
    def every_s(self) -> float: ...

    def start(self, phase: Phase) -> None: ...

    def show(self, counts: PhaseCounts) -> None: ...

    def finish(self, counts: PhaseCounts) -> None: ...


def _p99_text(counts: PhaseCounts) -> str:
    p99 = counts.p99_e2el_ms
    return "-" if p99 is None else f"{p99:.1f} ms"


def describe(counts: PhaseCounts) -> str:
    """One plain line: the figures the bar shows."""
    return (
        f"{counts.phase.label}: t={counts.elapsed_s:.0f}s ended {counts.ended}/{counts.phase.total}"
        f" completed {counts.completed} errors {counts.errors} lost {counts.lost}"
        f" in flight {counts.in_flight} p99 e2el {_p99_text(counts)}"
    )


class LinesView:
    """A line every ``every_s`` and one when the phase ends: for CI logs and pipes."""

    def __init__(self, stream: TextIO, every_s: float = LINES_EVERY_S) -> None:
        self.stream = stream
        self.every_s = every_s

    def start(self, phase: Phase) -> None:
        """Nothing until the first refresh."""

    def show(self, counts: PhaseCounts) -> None:
        print(describe(counts), file=self.stream, flush=True)

    def finish(self, counts: PhaseCounts) -> None:
        self.show(counts)


class BarView:
    """A rich progress bar, redrawn only when asked (no refresh thread to contend for the GIL)."""

    every_s = BAR_EVERY_S

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            console=console,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._progress.add_task("", start=False, stats="")

    def start(self, phase: Phase) -> None:
        self._progress.update(self._task, description=phase.label, total=phase.total)
        self._progress.start_task(self._task)
        self._progress.start()

    def show(self, counts: PhaseCounts) -> None:
        stats = (
            f"{counts.phase.rate:g} req/s  ok {counts.completed}  err {counts.errors}  "
            f"lost {counts.lost}  open {counts.in_flight}  p99 {_p99_text(counts)}"
        )
        self._progress.update(self._task, completed=counts.ended, stats=stats)
        self._progress.refresh()

    def finish(self, counts: PhaseCounts) -> None:
        self.show(counts)
        self._progress.stop()


def _nothing_open() -> int:
    return 0


class PhaseProgress:
    """One phase's counts and running E2EL p99, shown through a view.

    ``ended`` is the hot path (one call per request); ``refresh`` reads the counts, computes the
    percentile and draws, and remembers how long that took (``room_ns``: how much time before a
    send the loader should leave it).
    """

    __slots__ = ("_in_flight", "_start_ns", "completed", "e2el_us", "errors", "lost", "phase",
                 "render_ns", "view")  # fmt: skip

    def __init__(self, phase: Phase, view: ProgressView) -> None:
        self.phase = phase
        self.view = view
        self.completed = self.errors = self.lost = 0
        self.e2el_us = LogHistogram()
        self.render_ns = 0
        self._in_flight: Callable[[], int] = _nothing_open
        self._start_ns = time.perf_counter_ns()

    @property
    def every_s(self) -> float:
        return self.view.every_s

    @property
    def room_ns(self) -> int:
        """Time to leave free before a send for a refresh: twice the last one, and 0.2 ms."""
        return 2 * self.render_ns + 200_000

    def start(self, in_flight: Callable[[], int] = _nothing_open) -> None:
        """The phase begins; ``in_flight`` says how many requests are open at a refresh."""
        self._in_flight = in_flight
        self._start_ns = time.perf_counter_ns()
        self.view.start(self.phase)

    def ended(self, rec: RequestRecord) -> None:
        outcome = rec.outcome
        if outcome == "completed":
            self.completed += 1
            if rec.sent_ns:
                self.e2el_us.record((rec.end_ns - rec.sent_ns) / NS_PER_US)
        elif outcome == "error":
            self.errors += 1
        else:
            self.lost += 1

    def counts(self, elapsed_s: float | None = None) -> PhaseCounts:
        """The counts now; ``elapsed_s`` None is the time since ``start``."""
        p99_us = self.e2el_us.percentile(RUNNING_PERCENTILE)
        if elapsed_s is None:
            elapsed_s = (time.perf_counter_ns() - self._start_ns) / 1e9
        return PhaseCounts(
            self.phase,
            self.completed,
            self.errors,
            self.lost,
            self._in_flight(),
            elapsed_s,
            None if p99_us is None else p99_us / US_PER_MS,
        )

    def refresh(self) -> None:
        t0 = time.perf_counter_ns()
        self.view.show(self.counts())
        self.render_ns = time.perf_counter_ns() - t0

    def finish(self, elapsed_s: float | None = None) -> None:
        """The phase is over: a last refresh with the final counts."""
        self.view.finish(self.counts(elapsed_s))


def phase_progress(
    style: ProgressStyle | None,
    phase: Phase,
    *,
    stream: TextIO | None = None,
    lines_every_s: float = LINES_EVERY_S,
) -> PhaseProgress | None:
    """The progress of ``phase`` in ``style`` on ``stream`` (stdout by default); None if quiet."""
    out = stream or sys.stdout
    match resolve_style(style, out):
        case ProgressStyle.QUIET:
            return None
        case ProgressStyle.BAR:
            return PhaseProgress(phase, BarView(Console(file=out)))
        case _:
            return PhaseProgress(phase, LinesView(out, lines_every_s))


def load_phase(stack: str, profile: Profile, total: int) -> Phase:
    """How every loader names a phase: ``zerolayer / a_latency @ 8 req/s``."""
    label = f"{stack} / {profile.name} @ {profile.rate:g} req/s"
    return Phase(label, profile.rate, total)


def offered_rate(offsets_s: Sequence[float]) -> float:
    """Requests per second over a schedule's span (0 for fewer than two requests)."""
    span = offsets_s[-1] - offsets_s[0] if len(offsets_s) > 1 else 0.0
    return (len(offsets_s) - 1) / span if span > 0 else 0.0


def report_phase(
    style: ProgressStyle | None,
    phase: Phase,
    records: Sequence[RequestRecord],
    stream: TextIO | None = None,
) -> None:
    """A phase run elsewhere (k6, locust): its final counts once, from its records."""
    progress = phase_progress(style, phase, stream=stream)
    if progress is None:
        return
    progress.start()
    for rec in records:
        progress.ended(rec)
    progress.finish(run_duration_s(records))
