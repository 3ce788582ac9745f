"""``zl-bench history trend METRIC``: one metric across the runs of the store, a line per stack
and profile, each run's figure with its 95 % interval over trials (``bench.history.listing``).

Runs are placed in the order they started, one step apart, so a night of runs and a month of
them read alike; each is labelled with its id. A partial run is drawn hollow. A run whose host
ran at a speed more than 25 % from the runs' median (``harness.telemetry.host.speed_note``,
compare's test of two hosts) is ringed in red with its difference, since its latency may be the
machine's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import duckdb
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from bench.history.listing import SWEEP_FIGURES, TRIAL_METRICS, Filters, StoredRun, lines
from bench.report.plots.common import OTHER_COLORS, STACK_COLORS, new_figure
from harness import store
from harness.curves import Interval
from harness.errors import UsageError
from harness.schema import Machine
from harness.telemetry.host import speed_note

SWEPT: Final = (*SWEEP_FIGURES, "added_latency_rate")
METRICS: Final = (*TRIAL_METRICS, *SWEPT)
SPREAD: Final = 0.12  # how far apart the lines' points at one run are drawn


@dataclass(frozen=True, slots=True)
class TrendPoint:
    """One run's figure for one stack and profile; ``speed_change`` is its host's speed against
    the runs' median where the two differ by more than compare allows (None otherwise)."""

    run: StoredRun
    stack: str
    profile: str
    figure: Interval
    speed_change: float | None = None


def _slowest(run: StoredRun) -> float | None:
    speeds = [s for s in (run.cpu_speed_start, run.cpu_speed_end) if s is not None]
    return float(min(speeds)) if speeds else None


def _speed_changes(runs: Sequence[StoredRun]) -> dict[str, float]:
    """Each run whose host's speed differs from the runs' median by more than compare allows."""
    speeds = {r.run_id: s for r in runs if (s := _slowest(r)) is not None}
    if not speeds:
        return {}
    median = statistics.median(speeds.values())
    reference = Machine(cpu_speed_start=round(median))
    return {
        run_id: speed / median - 1.0
        for run_id, speed in speeds.items()
        if speed_note(reference, Machine(cpu_speed_start=round(speed)))
    }


def unit(metric: str) -> str:
    """The metric's unit, as the store's schema documents it (a sweep's figures: req/s)."""
    units = {f.name: c.unit for c in store.TRIALS.columns for f in c.fields()}
    return units.get(metric) or "req/s"


def trend_points(con: duckdb.DuckDBPyConnection, metric: str, filters: Filters) -> list[TrendPoint]:
    """``metric`` for every stack and profile of every run passing ``filters``; UsageError for
    a metric the store does not hold."""
    if metric not in METRICS:
        raise UsageError(
            f"unknown metric {metric!r}: a number of the trials table (median_e2el_ms, "
            "p99_ttft_ms, request_throughput, ...: docs/history.md) or a sweep's "
            + ", ".join(SWEPT)
        )
    wanted = [] if metric in SWEPT else [metric]
    shown = [line for line in lines(con, filters, wanted) if metric in line.figures]
    changes = _speed_changes(list({line.run.run_id: line.run for line in shown}.values()))
    return [
        TrendPoint(
            line.run, line.stack, line.profile, line.figures[metric], changes.get(line.run.run_id)
        )
        for line in shown
    ]


def _color(index: int, stack: str) -> str:
    return STACK_COLORS.get(stack) or OTHER_COLORS[index % len(OTHER_COLORS)]


def _error_bars(points: Sequence[TrendPoint]) -> list[list[float]]:
    """How far each point's interval reaches below and above it (0 without an interval)."""
    below, above = [], []
    for point in points:
        fig = point.figure
        value = fig.value or 0.0
        below.append(value - (fig.low if fig.low is not None else value))
        above.append((fig.high if fig.high is not None else value) - value)
    return [below, above]


def _draw_series(ax: Axes, points: Sequence[TrendPoint], xs: list[float], color: str) -> None:
    """One stack and profile: its intervals joined by a line, each run's point, its marks."""
    values = [p.figure.value or 0.0 for p in points]
    label = f"{points[0].stack} / {points[0].profile}"
    ax.errorbar(xs, values, yerr=_error_bars(points), color=color, capsize=4, label=label)
    for point, x, value in zip(points, xs, values, strict=True):
        face = "white" if point.run.partial else color
        ax.plot([x], [value], "o", color=color, markerfacecolor=face, markersize=7)
        if point.speed_change is not None:
            ax.plot([x], [value], "o", markersize=15, markerfacecolor="none", markeredgecolor="red")
            ax.annotate(
                f"host {point.speed_change:+.0%}",
                (x, value),
                textcoords="offset points",
                xytext=(8, 8),
                fontsize=7,
                color="red",
            )


def _mark_keys(points: Sequence[TrendPoint]) -> list[Line2D]:
    """Legend entries for the marks the figure shows: a partial run, a host off speed."""
    keys = []
    if any(p.run.partial for p in points):
        keys.append(
            Line2D([], [], ls="", marker="o", color="grey", mfc="white", label="partial run")
        )
    if any(p.speed_change is not None for p in points):
        ring = Line2D([], [], ls="", marker="o", ms=12, mfc="none", mec="red")
        ring.set_label("host speed > 25 % off the runs' median")
        keys.append(ring)
    return keys


def draw(points: Sequence[TrendPoint], metric: str, what: str) -> Figure:
    """The figure: a line per stack and profile over the runs in the order they started."""
    ordered = sorted(points, key=lambda p: (p.run.started, p.run.run_id))
    order = list(dict.fromkeys(p.run.run_id for p in ordered))
    series = list(dict.fromkeys((p.stack, p.profile) for p in ordered))
    fig, ax = new_figure(figsize=(max(7.0, 1.1 * len(order) + 3), 5.0))
    for index, key in enumerate(series):
        mine = [p for p in ordered if (p.stack, p.profile) == key and p.figure.value is not None]
        shift = (index - (len(series) - 1) / 2) * SPREAD
        if mine:
            xs = [order.index(p.run.run_id) + shift for p in mine]
            _draw_series(ax, mine, xs, _color(index, key[0]))
    ax.set_xticks(range(len(order)), order, rotation=25, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(order) - 0.4)
    ax.set_ylabel(f"{metric} ({unit(metric)})")
    ax.set_title(f"{metric} across runs{what}\nmean over trials, 95 % interval", fontsize=10)
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + _mark_keys(ordered), fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def write_trend(points: Sequence[TrendPoint], metric: str, what: str, out: Path) -> Path:
    """The figure as a PNG at ``out``; UsageError when no run has the metric."""
    if not any(p.figure.value is not None for p in points):
        raise UsageError(f"no run in the store has a {metric} for these filters")
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(points, metric, what).savefig(out, dpi=120)
    return out
