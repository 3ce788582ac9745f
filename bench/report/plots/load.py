"""A sweep's load curves: latency, goodput and the middle layer's added latency against offered
rate, with intervals over repeats, loader-limited and saturated points, and host-CPU bands."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter, methodcaller
from typing import Any, Final

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from bench.report.data import RunData
from bench.report.plots.common import (
    STACK_COLORS,
    empty,
    log_ms,
    new_figure,
    run_title,
    stack_color,
)
from bench.report.plots.points import (
    RatePoint,
    rate_points,
    sweep_added_latency,
    sweep_headline,
    sweep_slos,
    sweep_stacks,
)
from harness import curves, schema
from harness.curves import Interval
from harness.schema import SummaryRow

NO_SWEEP = "no sweep in this run: load curves come from `zl-bench sweep`"
INVALID_LABEL = "invalid: loader lagged"
BEST_LABEL = "rate of the highest mean goodput (star)"
SATURATED_LABEL = "saturated (queue growing or failing)"
HOST_LABEL = "host CPU saturated (all cores near full)"
HOST_NOTE = (
    "all cores near full at these rates: the latency measures the stacks' processes and the "
    "loader fighting for CPU, not their design"
)
LATENCY_SERIES = ("ttft", "e2el")
PERCENTILE_STYLES = (("median", "p50", "-"), ("p99", "p99", "--"))
BARS = "bars: range over repeats"
HOST_COLOR = "#ff9900"
DIFF_LINTHRESH_MS = 10.0
LEGEND_RIGHT = 0.97  # tight_layout leaves an outside legend a few pixels short
HOST_BAND = 1.08


def _spread(figure: Interval) -> tuple[float, float]:
    """The lowest and highest repeat's figure. The bars show this range: with two or three
    repeats the t-interval reaches below zero, off a log axis; the headline figures keep it."""
    got = [v for v in figure.per_repeat if v is not None]
    value = figure.value if figure.value is not None else float("nan")
    return (min(got), max(got)) if got else (value, value)


def _errorbars(ax: Axes, xs: list[float], values: list[Interval], **style: Any) -> None:
    """Each rate's mean over repeats with the repeats' range as bars; rates with nothing
    measured are left out (no completions is no latency, not 0 ms)."""
    got = [(x, v) for x, v in zip(xs, values, strict=True) if v.value is not None]
    if not got:
        return
    mean = np.asarray([v.value for _, v in got], dtype=float)
    low = np.asarray([_spread(v)[0] for _, v in got], dtype=float)
    high = np.asarray([_spread(v)[1] for _, v in got], dtype=float)
    ax.errorbar(
        [x for x, _ in got], mean, yerr=[mean - low, high - mean], capsize=3, markersize=4, **style
    )


# Loader-limited repeats: hollow grey, labelled as the loader's, never joined to a curve.
INVALID_STYLE: Final = {
    "s": 46, "facecolors": "none", "edgecolors": "0.5", "linewidths": 1.3,
    "label": INVALID_LABEL, "zorder": 5,
}  # fmt: skip
SATURATED_STYLE: Final = {
    "s": 36, "marker": "x", "color": "black", "linewidths": 1.2, "label": SATURATED_LABEL,
    "zorder": 6,
}  # fmt: skip


def _points(ax: Axes, xy: list[tuple[float, float | None]], style: dict[str, Any]) -> None:
    """Markers at the points that have a value, unjoined (e.g. ``INVALID_STYLE``)."""
    got = [(x, y) for x, y in xy if y is not None]
    if got:
        ax.scatter([x for x, _ in got], [y for _, y in got], **style)


def _invalid_and_saturated(
    ax: Axes,
    pts: list[RatePoint],
    values: list[Interval],
    invalid: Callable[[SummaryRow], float | None],
) -> None:
    """A curve's loader-limited repeats (their own figure, ``invalid``) and its saturated rates."""
    _points(ax, [(p.rate, invalid(r)) for p in pts for r in p.invalid], INVALID_STYLE)
    _points(
        ax,
        [(p.rate, v.value) for p, v in zip(pts, values, strict=True) if p.saturated],
        SATURATED_STYLE,
    )


def _host_bands(ax: Axes, points: dict[str, list[RatePoint]]) -> bool:
    """Shade the rates at which all the host's cores were near full; True when any were."""
    rates = sorted({p.rate for pts in points.values() for p in pts if p.host_saturated})
    for rate in rates:
        ax.axvspan(
            rate / HOST_BAND, rate * HOST_BAND, color=HOST_COLOR, alpha=0.14, lw=0, label=HOST_LABEL
        )
    return bool(rates)


def _host_caption(fig: Figure, shown: bool) -> None:
    """The caption line under a load figure when any rate had the host's CPU full."""
    if shown:
        fig.text(0.01, 0.01, f"Orange bands: {HOST_NOTE}.", fontsize=8, color="#8a4b00")


def _mark_headline(ax: Axes, figure: Interval, color: str, what: str, *, rate: bool) -> bool:
    """A headline figure as a dotted line with its interval over repeats shaded: a rate (knee,
    crossing) across the rate axis, else a level (max goodput) along it. Where it has no value
    the legend says why (e.g. not reached by the highest rate measured); False then."""
    if figure.value is None:
        ax.plot([], [], " ", label=f"{what}: {figure.text()}")
        return False
    line, span = (ax.axvline, ax.axvspan) if rate else (ax.axhline, ax.axhspan)
    label = f"{what} {figure.text('.3g', 'req/s')}"
    line(figure.value, color=color, linestyle=":", linewidth=1.6 if rate else 1.2, label=label)
    low, high = figure.low, figure.high
    # the rate axis is logarithmic: an interval reaching 0 or below is not shaded
    if figure.n > 1 and low is not None and high is not None and (low > 0 or not rate):
        span(low, high, color=color, alpha=0.08, lw=0)
    return True


def _legend(ax: Axes, **kwargs: Any) -> None:
    """One legend entry per label (bands and markers repeat theirs per stack and rate)."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, **kwargs)


def _rate_axis(ax: Axes) -> None:
    ax.set_xscale("log")
    log_ms(ax.xaxis)
    ax.set_xlabel("offered load (requests/s, log scale)")
    ax.grid(True, which="both", alpha=0.3)


def _sweep_title(fig: Figure, run: RunData, sweep: schema.SweepSection, what: str) -> None:
    slos = "; ".join(str(s) for s in sweep_slos(sweep)) or "no SLOs"
    run_title(fig, run, f"{what}\nprofile {sweep.profile} · {sweep.mode} sweep · SLOs: {slos}")


def load_latency(run: RunData) -> Figure:
    """p50 and p99 TTFT and E2EL against offered rate, every stack, with SLO bounds and knees."""
    fig, axes = new_figure(1, 2, figsize=(13, 8), squeeze=False)
    sweep = run.sweep
    if sweep is None:
        run_title(fig, run, "Latency against offered load")
        return empty(fig, NO_SWEEP)
    _sweep_title(fig, run, sweep, f"Latency against offered load (p50 solid, p99 dashed; {BARS})")
    points = {stack: rate_points(sweep, stack) for stack in sweep_stacks(sweep)}
    host = False
    for ax, name in zip(axes[0], LATENCY_SERIES, strict=True):
        for stack, pts in points.items():
            _latency_curves(ax, stack_color(run, stack), stack, pts, name)
            knee = sweep_headline(sweep, stack)["knee"]
            _mark_headline(ax, knee, stack_color(run, stack), f"{stack} knee", rate=True)
        for slo in sweep_slos(sweep):
            if slo.series == name:
                ax.axhline(slo.bound_ms, color="black", linestyle="-.", linewidth=1, label=str(slo))
        host = _host_bands(ax, points)
        _rate_axis(ax)
        ax.set_yscale("log")
        log_ms(ax.yaxis)
        ax.set_ylabel(f"{name.upper()} (ms, log scale)")
        ax.set_title(name.upper(), fontsize=10)
        _legend(ax, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.tight_layout(rect=(0, 0.04 if host else 0, 1, 1))
    _host_caption(fig, host)
    return fig


def _latency_curves(ax: Axes, color: str, stack: str, pts: list[RatePoint], name: str) -> None:
    """One stack's p50 and p99 of one series, its invalid repeats and its saturated rates."""
    xs = [p.rate for p in pts]
    for stat, label, style in PERCENTILE_STYLES:
        key = f"{stat}_{name}_ms"
        values = [p.stat(key) for p in pts]
        _errorbars(
            ax, xs, values, color=color, linestyle=style, marker="o", label=f"{stack} {label}"
        )
        _invalid_and_saturated(ax, pts, values, methodcaller("stat", key))


def load_goodput(run: RunData) -> Figure:
    """Goodput and throughput against offered rate, with served = offered and max goodput."""
    fig, ax = new_figure(figsize=(12, 6))
    sweep = run.sweep
    if sweep is None:
        run_title(fig, run, "Goodput against offered load")
        return empty(fig, NO_SWEEP)
    _sweep_title(
        fig, run, sweep, f"Goodput (solid) and throughput (dashed) against offered load; {BARS}"
    )
    points = {stack: rate_points(sweep, stack) for stack in sweep_stacks(sweep)}
    for stack, pts in points.items():
        _goodput_curves(ax, stack_color(run, stack), stack, pts)
        _mark_max_goodput(ax, stack_color(run, stack), stack, pts, sweep_headline(sweep, stack))
    rates = [p.rate for pts in points.values() for p in pts]
    if rates:
        diagonal = np.geomspace(min(rates), max(rates), 64)
        ax.plot(diagonal, diagonal, color="0.55", linestyle="--", label="served = offered")
    if sweep.capacity_rps:
        ax.axvline(
            sweep.capacity_rps,
            color="0.4",
            linestyle=(0, (1, 3)),
            label=f"predicted capacity {sweep.capacity_rps:.3g} req/s",
        )
    host = _host_bands(ax, points)
    _rate_axis(ax)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("requests/s (goodput: completed within every SLO)")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout(rect=(0, 0.04 if host else 0, LEGEND_RIGHT, 1))
    _host_caption(fig, host)
    return fig


def _goodput_curves(ax: Axes, color: str, stack: str, pts: list[RatePoint]) -> None:
    xs = [p.rate for p in pts]
    for name, label, style, face in (
        ("request_goodput", "goodput", "-", color),
        ("request_throughput", "throughput", "--", "white"),
    ):
        values = [p.throughput(name) for p in pts]
        _errorbars(
            ax,
            xs,
            values,
            color=color,
            linestyle=style,
            marker="o",
            markerfacecolor=face,
            label=f"{stack} {label}",
        )
        _invalid_and_saturated(ax, pts, values, attrgetter(name))


def _mark_max_goodput(
    ax: Axes, color: str, stack: str, pts: list[RatePoint], headline: dict[str, Interval]
) -> None:
    """The stack's max goodput (interval over repeats) as a level, and a star on the rate
    whose mean goodput is highest."""
    if not _mark_headline(ax, headline["max_goodput"], color, f"{stack} max goodput", rate=False):
        return
    means = [(p.throughput("request_goodput").value, p.rate) for p in pts]
    top = max(((g, r) for g, r in means if g is not None), default=None)
    if top is not None:
        ax.scatter(
            [top[1]],
            [top[0]],
            marker="*",
            s=220,
            color=color,
            edgecolors="black",
            zorder=7,
            label=BEST_LABEL,
        )


def load_added_latency(run: RunData) -> Figure:
    """Baseline minus zero-layer E2EL (p50, p99) against offered rate, with the bound and the
    rate at which the median passes it."""
    fig, ax = new_figure(figsize=(12, 6))
    sweep = run.sweep
    if sweep is None:
        run_title(fig, run, "Added latency of the middle layer against offered load")
        return empty(fig, NO_SWEEP)
    _sweep_title(fig, run, sweep, f"Added latency: baseline minus zero-layer E2EL; {BARS}")
    added = sweep_added_latency(sweep)
    if not added.by_rate:
        return empty(fig, "no offered rate measured validly on both zerolayer and baseline")
    xs = [d.rate for d in added.by_rate]
    _errorbars(
        ax,
        xs,
        [d.p50_ms for d in added.by_rate],
        color="#333333",
        marker="o",
        label="E2EL p50 difference",
    )
    _errorbars(
        ax,
        xs,
        [d.p99_ms for d in added.by_rate],
        color="#333333",
        linestyle="--",
        marker="s",
        markerfacecolor="white",
        label="E2EL p99 difference",
    )
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.axhline(
        added.bound_ms,
        color=STACK_COLORS[curves.BASELINE],
        linestyle="-.",
        linewidth=1.2,
        label=f"bound: median {added.bound_ms:g} ms",
    )
    crossing = "median crosses the bound at"
    _mark_headline(ax, added.rate, STACK_COLORS[curves.BASELINE], crossing, rate=True)
    points = {stack: rate_points(sweep, stack) for stack in sweep_stacks(sweep)}
    lagged = sorted({p.rate for pts in points.values() for p in pts if p.invalid})
    _points(ax, [(rate, 0.0) for rate in lagged], INVALID_STYLE)
    host = _host_bands(ax, points)
    _rate_axis(ax)
    ax.set_yscale("symlog", linthresh=DIFF_LINTHRESH_MS)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    lows = [i.low for d in added.by_rate for i in (d.p50_ms, d.p99_ms) if i.low is not None]
    ax.set_ylim(bottom=min([-DIFF_LINTHRESH_MS, *(2 * low for low in lows)]))
    ax.set_ylabel("baseline - zerolayer (ms, symmetric log scale)")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout(rect=(0, 0.04 if host else 0, LEGEND_RIGHT, 1))
    _host_caption(fig, host)
    return fig
