"""Every figure of the report, drawn from a loaded run (matplotlib, Agg, no display needed).

Each function takes a :class:`RunData` and returns a pyplot-free Figure whose title names the
run's scale and whose axes carry units; ``render_all`` writes those that apply to the run (a
sweep's load curves, or a plain run's per-profile figures) to ``plots/``. The notebook calls the
same functions, so a researcher redraws exactly what the report shows. Per-request values come
from ``harness.metrics.series`` and load curves from ``harness.curves``: plots and tables share
one definition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from bench.report.data import RunData
from harness import curves, metrics, schema
from harness.curves import Interval
from harness.schema import SummaryRow

STACK_COLORS = {"zerolayer": "#1f77b4", "baseline": "#d62728"}
OTHER_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
NS = 1e9
# The gid of the text a figure (or one of its panels) shows in place of data it does not have.
NO_DATA: Final = "zl-no-data"


def _figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Figure, Any]:
    """A pyplot-free Figure (Agg canvas): no global state, safe in threads and notebooks."""
    figsize = kwargs.pop("figsize", None)
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def _stacks(run: RunData) -> list[str]:
    """The run's stacks: those with records, else those of its sweep."""
    return run.stacks or (sweep_stacks(run.sweep) if run.sweep is not None else [])


def stack_color(run: RunData, stack: str) -> str:
    if stack in STACK_COLORS:
        return STACK_COLORS[stack]
    others = [s for s in _stacks(run) if s not in STACK_COLORS]
    return OTHER_COLORS[others.index(stack) % len(OTHER_COLORS)] if stack in others else "k"


def _title(fig: Figure, run: RunData, what: str) -> None:
    stacks = ", ".join(_stacks(run)) or "no stacks"
    fig.suptitle(f"{what}\nrun {run.run_id} · scale {run.scale} · stacks: {stacks}", fontsize=11)


def _empty(fig: Figure, message: str) -> Figure:
    fig.text(0.5, 0.5, message, ha="center", va="center", fontsize=12, wrap=True, gid=NO_DATA)
    return fig


def _no_completions(ax: Axes, what: str) -> None:
    """Say, where the figures would be, that there are none (an outage completes nothing)."""
    _note(ax, what)
    ax.set_xticks([])
    ax.set_yticks([])


def _note(ax: Axes, what: str) -> None:
    """Say, in the middle of a panel, what it has no data for."""
    ax.text(
        0.5,
        0.5,
        what,
        ha="center",
        va="center",
        transform=ax.transAxes,
        fontsize=10,
        wrap=True,
        gid=NO_DATA,
    )


def _per_record(recs: list[schema.RequestRecord], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(send time in ns, value in ms) for each record that has the series ``name``."""
    times, values = [], []
    for rec in recs:
        for value in metrics.series([rec])[name]:
            times.append(rec.intended_start_ns)
            values.append(value)
    return np.asarray(times, dtype=float), np.asarray(values, dtype=float)


def _itl_points(recs: list[schema.RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """(chunk time in ns, gap to the previous chunk in ms) for every pooled ITL sample."""
    times, values = [], []
    for rec in recs:
        gaps = metrics.series([rec])["itl"]
        times.extend(rec.chunk_ns[1 : 1 + len(gaps)])
        values.extend(gaps)
    return np.asarray(times, dtype=float), np.asarray(values, dtype=float)


def _log_ms(axis: Any) -> None:
    """Log scale with plain millisecond tick labels at 1-2-5 steps (no 2x10^0 clutter)."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _mark_faults(ax: Axes, run: RunData, label: bool) -> None:
    for i, fault in enumerate(run.faults):
        x = (fault.t_ns - run.t0_ns) / NS
        ax.axvline(x, color="black", linestyle="--", linewidth=1.2)
        if fault.end_ns:
            ax.axvspan(x, (fault.end_ns - run.t0_ns) / NS, color="black", alpha=0.08)
        if label:
            text = f"fault: {fault.name}" + (f" ({fault.stack})" if fault.stack else "")
            ax.annotate(
                text,
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                xytext=(-2, -2 - 4 * (i % 2)),
                textcoords="offset points",
            )


def _shade_phases(ax: Axes, run: RunData, label: bool) -> None:
    """Light spans for each stack/profile phase, so a time axis shows which load was running."""
    starts: dict[str, int] = {}
    for entry in run.phases:
        if entry.get("kind") != "phase":
            continue
        if entry.get("event") == "start":
            starts[entry["name"]] = entry["t_ns"]
        elif entry["name"] in starts:
            x0 = (starts.pop(entry["name"]) - run.t0_ns) / NS
            x1 = (entry["t_ns"] - run.t0_ns) / NS
            ax.axvspan(x0, x1, color="0.85", alpha=0.35, linewidth=0)
            if label:
                ax.annotate(
                    entry["name"],
                    ((x0 + x1) / 2, 0.0),
                    xycoords=("data", "axes fraction"),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    color="0.35",
                )


def latency_cdf(run: RunData) -> Figure:
    """E2E latency (solid) and TTFT (dashed) CDF per stack, one panel per profile."""
    profiles = run.profiles
    fig, axes = _figure(
        1, max(1, len(profiles)), figsize=(5 * max(1, len(profiles)), 4.2), squeeze=False
    )
    _title(fig, run, "Latency CDF per stack (E2EL solid, TTFT dashed)")
    if not profiles:
        return _empty(fig, "no request records in this run")
    for ax, profile in zip(axes[0], profiles, strict=True):
        ax.set_title(f"profile {profile}", fontsize=10)
        if not _cdf_panel(ax, run, profile):
            _no_completions(ax, f"no completed requests in profile {profile}: no latency")
            continue
        ax.set_xscale("log")
        _log_ms(ax.xaxis)
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of completed requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def _cdf_panel(ax: Axes, run: RunData, profile: str) -> bool:
    """Draw one profile's CDF lines; False when no stack completed a request in it."""
    drawn = False
    for stack in run.stacks:
        values = metrics.series(run.records.get((stack, profile), []))
        for name, style in (("e2el", "-"), ("ttft", "--")):
            data = np.sort(np.asarray(values[name]))
            if data.size == 0:
                continue
            frac = np.arange(1, data.size + 1) / data.size
            ax.step(
                data,
                frac,
                style,
                where="post",
                color=stack_color(run, stack),
                label=f"{stack} {name.upper()} (n={data.size})",
            )
            drawn = True
    return drawn


def latency_variance(run: RunData) -> Figure:
    """Box plots of E2EL and TTFT per profile and stack, with each group's std deviation."""
    groups = [(p, s) for p in run.profiles for s in run.stacks if run.records.get((s, p))]
    fig, axes = _figure(2, 1, figsize=(max(6, 1.6 * len(groups) + 2), 7.5), squeeze=False)
    _title(fig, run, "Latency variance per profile and stack (box: quartiles, whiskers 1.5 IQR)")
    if not groups:
        return _empty(fig, "no request records in this run")
    for ax, name in zip(axes[:, 0], ("e2el", "ttft"), strict=True):
        data, labels, colors = [], [], []
        for profile, stack in groups:
            values = metrics.series(run.records[(stack, profile)])[name]
            std = metrics.describe(name, values)[f"std_{name}_ms"]
            if std is None:
                continue
            data.append(values)
            labels.append(f"{profile}\n{stack}\nstd {std:.1f} ms")
            colors.append(stack_color(run, stack))
        if not data:
            _no_completions(ax, f"no completed requests: no {name.upper()} to show")
            continue
        box = ax.boxplot(data, patch_artist=True, showfliers=True, flierprops={"markersize": 2})
        for patch, color in zip(box["boxes"], colors, strict=True):
            patch.set_facecolor(color)
            patch.set_alpha(0.45)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
        ax.set_yscale("log")
        _log_ms(ax.yaxis)
        ax.set_ylabel(f"{name.upper()} (ms, log scale)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def ttft_itl_timeline(run: RunData) -> Figure:
    """TTFT per request (at its intended send) and ITL per chunk over run time, with faults."""
    fig, axes = _figure(2, 1, figsize=(11, 7), sharex=True, squeeze=False)
    _title(fig, run, "TTFT and ITL over time (dashed lines: faults; grey spans: phases)")
    if not run.records:
        return _empty(fig, "no request records in this run")
    ax_ttft, ax_itl = axes[:, 0]
    shown = {ax_ttft: 0, ax_itl: 0}
    for (stack, profile), recs in sorted(run.records.items()):
        color = stack_color(run, stack)
        label = stack if profile == run.profiles[0] else None
        t, v = _per_record(recs, "ttft")
        shown[ax_ttft] += v.size
        ax_ttft.scatter(
            (t - run.t0_ns) / NS, v, s=6, color=color, alpha=0.7, label=label, rasterized=True
        )
        t, v = _itl_points(recs)
        shown[ax_itl] += v.size
        ax_itl.scatter(
            (t - run.t0_ns) / NS, v, s=2, color=color, alpha=0.3, label=label, rasterized=True
        )
        errors = [r for r in recs if r.outcome != "completed"]
        if errors:
            ax_ttft.scatter(
                [(r.intended_start_ns - run.t0_ns) / NS for r in errors],
                [0.0] * len(errors),
                marker="x",
                color=color,
                s=18,
                label=f"{stack} {profile}: error/lost ({len(errors)})",
            )
    missing = {ax_ttft: "no request got a first token", ax_itl: "no request streamed 2 chunks"}
    for ax, ylabel in ((ax_ttft, "TTFT (ms)"), (ax_itl, "ITL (ms, per chunk)")):
        if not shown[ax]:
            _note(ax, f"{missing[ax]}: no {ylabel.split()[0]} to show")
        _shade_phases(ax, run, label=ax is ax_itl)
        _mark_faults(ax, run, label=ax is ax_ttft)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", markerscale=2)
    ax_itl.set_xlabel("time since run start (s)")
    fig.tight_layout()
    return fig


def _telemetry(run: RunData, source: str) -> list[dict[str, Any]]:
    return [r for r in run.telemetry if r.get("source") == source and not r.get("error")]


def gpu_fragmentation(run: RunData) -> Figure:
    """GPU utilisation (NVML, else the sim engine's busy share) and KV/allocator fragmentation."""
    fig, axes = _figure(2, 1, figsize=(11, 7), sharex=True, squeeze=False)
    _title(fig, run, "GPU utilisation and memory fragmentation over time")
    ax_util, ax_frag = axes[:, 0]
    nvml = [r for r in _telemetry(run, "nvml") if r.get("gpu_util_pct") is not None]
    engine = _telemetry(run, "engine")
    if not nvml and not engine:
        return _empty(fig, "no GPU or engine telemetry in this run")
    if nvml:
        for gpu in sorted({r["name"] for r in nvml}):
            rows = [r for r in nvml if r["name"] == gpu]
            ax_util.plot(
                [(r["t_ns"] - run.t0_ns) / NS for r in rows],
                [r["gpu_util_pct"] for r in rows],
                label=f"{gpu} (NVML)",
            )
        ax_util.set_ylabel("GPU utilisation (%, NVML samples)")
    else:
        ax_util.set_ylabel("engine busy (% of wall time)\nsim engine: no NVML GPU")
    series_styles = (
        ("kv_usage", "-", "KV occupancy"),
        ("kv_waste", "--", "KV waste"),
        ("alloc_split_ratio", ":", "allocator split ratio"),
    )
    for stack in run.stacks or sorted({r.get("stack", "") for r in engine}):
        color = stack_color(run, stack)
        for replica in sorted({r["name"] for r in engine if r.get("stack") == stack}):
            rows = [r for r in engine if r.get("stack") == stack and r["name"] == replica]
            t = np.asarray([(r["t_ns"] - run.t0_ns) / NS for r in rows])
            if not nvml:
                busy = [(r["t_ns"], r["engine_busy"]) for r in rows if "engine_busy" in r]
                if busy:
                    ax_util.plot(
                        [(b[0] - run.t0_ns) / NS for b in busy],
                        [100 * b[1] for b in busy],
                        color=color,
                        linewidth=1,
                        label=f"{stack}/{replica}",
                    )
            for key, style, label in series_styles:
                vals = [100 * r[key] if key in r else np.nan for r in rows]
                if not np.all(np.isnan(vals)):
                    ax_frag.plot(
                        t, vals, style, color=color, linewidth=1, label=f"{stack}/{replica} {label}"
                    )
    ax_frag.set_ylabel("% (occupancy: of KV blocks;\nwaste: of allocated KV slots)")
    ax_frag.set_xlabel("time since run start (s)")
    for ax in (ax_util, ax_frag):
        _shade_phases(ax, run, label=ax is ax_frag)
        _mark_faults(ax, run, label=ax is ax_util)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper right", ncol=2)
    fig.tight_layout()
    return fig


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


@dataclass(frozen=True, slots=True)
class RatePoint:
    """One stack's repeats at one offered rate. Usable repeats pool into intervals over repeats
    (``harness.curves.interval``); loader-limited ones are the loader's and are drawn apart."""

    rate: float
    rows: tuple[SummaryRow, ...]

    @property
    def valid(self) -> list[SummaryRow]:
        return [r for r in self.rows if curves.usable(r)]

    @property
    def invalid(self) -> list[SummaryRow]:
        return [r for r in self.rows if not curves.usable(r)]

    def stat(self, key: str) -> Interval:
        """A series statistic (vLLM key, e.g. ``p99_e2el_ms``) over the usable repeats."""
        return curves.interval([r.stat(key) for r in self.valid])

    def throughput(self, name: str) -> Interval:
        """``request_goodput`` or ``request_throughput`` over the usable repeats."""
        return curves.interval([getattr(r, name) for r in self.valid])

    @property
    def saturated(self) -> bool:
        return any(r.saturated for r in self.valid)

    @property
    def host_saturated(self) -> bool:
        return any(r.host_saturated for r in self.rows)


def _rate_key(row: SummaryRow) -> float:
    """Repeats of one point share its offered rate to three significant figures (the sweep
    places its rates so)."""
    return float(f"{row.offered_rate:.3g}")


def rate_points(sweep: schema.SweepSection, stack: str) -> list[RatePoint]:
    """One stack's sweep points grouped by offered rate, in order of rate."""
    groups: dict[float, list[SummaryRow]] = {}
    for row in sweep.stack_points(stack):
        groups.setdefault(_rate_key(row), []).append(row)
    return [RatePoint(rate, tuple(rows)) for rate, rows in sorted(groups.items())]


def sweep_stacks(sweep: schema.SweepSection) -> list[str]:
    """The sweep's stacks: zerolayer first, baseline second, the rest by name."""
    rank = {curves.ZEROLAYER: 0, curves.BASELINE: 1}
    names = {p.stack for p in sweep.points} | set(sweep.stacks)
    return sorted(names, key=lambda s: (rank.get(s, 2), s))


def sweep_slos(sweep: schema.SweepSection) -> list[metrics.Slo]:
    return [metrics.Slo.from_dict(d) for d in sweep.slos]


def sweep_headline(sweep: schema.SweepSection, stack: str) -> dict[str, Interval]:
    """A stack's headline figures as the sweep recorded them; computed by ``harness.curves``
    from its points where summary.json lacks them (a sweep cut short)."""
    stored = sweep.stacks.get(stack, {}).get("headline")
    if stored:
        return {name: Interval.from_dict(value) for name, value in stored.items()}
    return curves.headline(sweep.stack_points(stack), sweep_slos(sweep))


def sweep_added_latency(sweep: schema.SweepSection) -> curves.AddedLatency:
    """The baseline-minus-zero-layer latency as recorded; computed from the points if absent."""
    stored = sweep.added_latency
    if not stored:
        return curves.added_latency(sweep.points, sweep.added_latency_bound_ms)
    return curves.AddedLatency.from_dict(stored)


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


def _invalid_points(ax: Axes, xy: list[tuple[float, float | None]]) -> None:
    """Loader-limited repeats: hollow grey, labelled as the loader's, never joined to a curve."""
    got = [(x, y) for x, y in xy if y is not None]
    if got:
        ax.scatter(
            [x for x, _ in got],
            [y for _, y in got],
            s=46,
            facecolors="none",
            edgecolors="0.5",
            linewidths=1.3,
            label=INVALID_LABEL,
            zorder=5,
        )


def _saturated_points(ax: Axes, xy: list[tuple[float, float | None]]) -> None:
    got = [(x, y) for x, y in xy if y is not None]
    if got:
        ax.scatter(
            [x for x, _ in got],
            [y for _, y in got],
            s=36,
            marker="x",
            color="black",
            linewidths=1.2,
            label=SATURATED_LABEL,
            zorder=6,
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


def _mark_rate(ax: Axes, figure: Interval, color: str, what: str) -> None:
    """A rate headline (knee, crossing) as a vertical line with its interval shaded; where it
    has no value the legend says why (e.g. not reached by the highest rate measured)."""
    if figure.value is None:
        ax.plot([], [], " ", label=f"{what}: {figure.text()}")
        return
    ax.axvline(
        figure.value,
        color=color,
        linestyle=":",
        linewidth=1.6,
        label=f"{what} {figure.text('.3g', 'req/s')}",
    )
    if figure.n > 1 and figure.low is not None and figure.high is not None and figure.low > 0:
        ax.axvspan(figure.low, figure.high, color=color, alpha=0.08, lw=0)


def _legend(ax: Axes, **kwargs: Any) -> None:
    """One legend entry per label (bands and markers repeat theirs per stack and rate)."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, **kwargs)


def _rate_axis(ax: Axes) -> None:
    ax.set_xscale("log")
    _log_ms(ax.xaxis)
    ax.set_xlabel("offered load (requests/s, log scale)")
    ax.grid(True, which="both", alpha=0.3)


def _sweep_title(fig: Figure, run: RunData, sweep: schema.SweepSection, what: str) -> None:
    slos = "; ".join(str(s) for s in sweep_slos(sweep)) or "no SLOs"
    _title(fig, run, f"{what}\nprofile {sweep.profile} · {sweep.mode} sweep · SLOs: {slos}")


def load_latency(run: RunData) -> Figure:
    """p50 and p99 TTFT and E2EL against offered rate, every stack, with SLO bounds and knees."""
    fig, axes = _figure(1, 2, figsize=(13, 8), squeeze=False)
    sweep = run.sweep
    if sweep is None:
        _title(fig, run, "Latency against offered load")
        return _empty(fig, NO_SWEEP)
    _sweep_title(fig, run, sweep, f"Latency against offered load (p50 solid, p99 dashed; {BARS})")
    points = {stack: rate_points(sweep, stack) for stack in sweep_stacks(sweep)}
    host = False
    for ax, name in zip(axes[0], LATENCY_SERIES, strict=True):
        for stack, pts in points.items():
            _latency_curves(ax, stack_color(run, stack), stack, pts, name)
            _mark_rate(
                ax, sweep_headline(sweep, stack)["knee"], stack_color(run, stack), f"{stack} knee"
            )
        for slo in sweep_slos(sweep):
            if slo.series == name:
                ax.axhline(slo.bound_ms, color="black", linestyle="-.", linewidth=1, label=str(slo))
        host = _host_bands(ax, points)
        _rate_axis(ax)
        ax.set_yscale("log")
        _log_ms(ax.yaxis)
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
        _invalid_points(ax, [(p.rate, r.stat(key)) for p in pts for r in p.invalid])
        _saturated_points(
            ax, [(p.rate, v.value) for p, v in zip(pts, values, strict=True) if p.saturated]
        )


def load_goodput(run: RunData) -> Figure:
    """Goodput and throughput against offered rate, with served = offered and max goodput."""
    fig, ax = _figure(figsize=(12, 6))
    sweep = run.sweep
    if sweep is None:
        _title(fig, run, "Goodput against offered load")
        return _empty(fig, NO_SWEEP)
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
        _invalid_points(ax, [(p.rate, getattr(r, name)) for p in pts for r in p.invalid])
        _saturated_points(
            ax, [(p.rate, v.value) for p, v in zip(pts, values, strict=True) if p.saturated]
        )


def _mark_max_goodput(
    ax: Axes, color: str, stack: str, pts: list[RatePoint], headline: dict[str, Interval]
) -> None:
    """The stack's max goodput (interval over repeats) as a level, and a star on the rate
    whose mean goodput is highest."""
    best = headline["max_goodput"]
    if best.value is None:
        ax.plot([], [], " ", label=f"{stack} max goodput: {best.text()}")
        return
    ax.axhline(
        best.value,
        color=color,
        linestyle=":",
        linewidth=1.2,
        label=f"{stack} max goodput {best.text('.3g', 'req/s')}",
    )
    if best.n > 1 and best.low is not None and best.high is not None:
        ax.axhspan(best.low, best.high, color=color, alpha=0.08, lw=0)
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
    fig, ax = _figure(figsize=(12, 6))
    sweep = run.sweep
    if sweep is None:
        _title(fig, run, "Added latency of the middle layer against offered load")
        return _empty(fig, NO_SWEEP)
    _sweep_title(fig, run, sweep, f"Added latency: baseline minus zero-layer E2EL; {BARS}")
    added = sweep_added_latency(sweep)
    if not added.by_rate:
        return _empty(fig, "no offered rate measured validly on both zerolayer and baseline")
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
    _mark_rate(ax, added.rate, STACK_COLORS[curves.BASELINE], "median crosses the bound at")
    points = {stack: rate_points(sweep, stack) for stack in sweep_stacks(sweep)}
    lagged = sorted({p.rate for pts in points.values() for p in pts if p.invalid})
    _invalid_points(ax, [(rate, 0.0) for rate in lagged])
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


def time_breakdown(run: RunData) -> dict[tuple[str, str], tuple[str, dict[str, float]]]:
    """Mean per-request time split, per (stack, profile), and what the split is based on.

    With engine-side accounting (``engine_ns``) on most completed requests: engine time against
    layer time (E2EL - engine). Without it: client queue, TTFT and generation time, which does
    not separate the layer from the engine and says so.
    """
    out = {}
    for (stack, profile), recs in run.records.items():
        done = [r for r in recs if r.outcome == "completed"]
        if not done:
            continue
        values = metrics.series(done)
        accounted = [r for r in done if r.engine_ns]
        if len(accounted) >= 0.9 * len(done):
            engine_ms = [r.engine_ns / 1e6 for r in accounted]
            e2el = [metrics.series([r])["e2el"][0] for r in accounted]
            layer = [e - g for e, g in zip(e2el, engine_ms, strict=True)]
            out[(stack, profile)] = (
                "engine-side accounting",
                {"engine": float(np.mean(engine_ms)), "layer": float(np.mean(layer))},
            )
        else:
            queue, ttft = np.mean(values["client_queue"] or [0.0]), np.mean(values["ttft"] or [0.0])
            out[(stack, profile)] = (
                "TTFT decomposition",
                {
                    "client queue": float(queue),
                    "TTFT (layer + engine prefill)": float(ttft),
                    "generation after first token": float(np.mean(values["e2el"]) - ttft),
                },
            )
    return out


def where_time_goes(run: RunData) -> Figure:
    """Mean request time split into engine and layer (or TTFT parts), per stack and profile."""
    split = time_breakdown(run)
    fig, ax = _figure(figsize=(10, max(3.5, 0.6 * len(split) + 2)))
    bases = sorted({basis for basis, _ in split.values()})
    _title(
        fig,
        run,
        f"Where the time goes (mean per completed request; based on: "
        f"{' and '.join(bases) or 'nothing'})",
    )
    if not split:
        return _empty(fig, "no completed requests in this run")
    palette = {
        "engine": "#4c72b0",
        "layer": "#dd8452",
        "client queue": "#8c8c8c",
        "TTFT (layer + engine prefill)": "#c44e52",
        "generation after first token": "#55a868",
    }
    keys = [(s, p) for p in run.profiles for s in run.stacks if (s, p) in split]
    seen: set[str] = set()
    for y, key in enumerate(keys):
        parts = split[key][1]
        left = 0.0
        for part, value in parts.items():
            width = max(value, 0.0)
            ax.barh(
                y,
                width,
                left=left,
                color=palette[part],
                label=None if part in seen else part,
                edgecolor="white",
            )
            if width > 0.06 * sum(max(v, 0) for v in parts.values()):
                ax.text(
                    left + width / 2,
                    y,
                    f"{value:.1f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
            seen.add(part)
            left += width
    ax.set_yticks(
        range(len(keys)), [f"{s} · {p}\n({split[(s, p)][0]})" for s, p in keys], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xlabel("mean time per completed request (ms)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def cpu_by_component(run: RunData) -> Figure:
    """CPU (% of one core) per component over time, so the layer's own CPU share is visible."""
    fig, axes = _figure(2, 1, figsize=(11, 6.5), sharex=True, squeeze=False)
    _title(fig, run, "CPU and memory per component (psutil)")
    rows = [r for r in _telemetry(run, "process") if r.get("alive")]
    if not rows:
        return _empty(fig, "no process telemetry in this run")
    ax_cpu, ax_rss = axes[:, 0]
    for name in sorted({r["name"] for r in rows}):
        mine = [r for r in rows if r["name"] == name]
        label = f"{name} ({mine[0].get('role', '?')}" + (
            f", {mine[0]['stack']})" if mine[0].get("stack") else ")"
        )
        t = [(r["t_ns"] - run.t0_ns) / NS for r in mine]
        ax_cpu.plot(t, [r.get("cpu_pct", np.nan) for r in mine], linewidth=1, label=label)
        ax_rss.plot(t, [r["rss_bytes"] / 2**20 for r in mine], linewidth=1, label=label)
    ax_cpu.set_ylabel("CPU (% of one core)")
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_xlabel("time since run start (s)")
    for ax in (ax_cpu, ax_rss):
        _shade_phases(ax, run, label=ax is ax_rss)
        _mark_faults(ax, run, label=ax is ax_cpu)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def ttft_by_turn(run: RunData, profile: str) -> Figure:
    """TTFT p50 (solid) and p90 (dashed) against turn number, one line per stack: with a prefix
    cache, later turns prefill only their new message when routing finds the cached history."""
    fig, ax = _figure(figsize=(8, 4.8))
    _title(fig, run, f"TTFT by turn, profile {profile} (p50 solid, p90 dashed)")
    drawn = False
    for stack in run.stacks:
        turns = metrics.by_turn(run.records.get((stack, profile), []))
        color = stack_color(run, stack)
        for key, label, style in (("p50_ttft_ms", "p50", "-"), ("p90_ttft_ms", "p90", "--")):
            points = [(t.turn, getattr(t, key)) for t in turns if getattr(t, key) is not None]
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, marker="o", color=color, label=f"{stack} TTFT {label}")
            drawn = True
    if not drawn:
        _no_completions(ax, f"no completed requests with a turn in profile {profile}")
        return fig
    ax.set_xlabel("turn in session")
    ax.set_ylabel("TTFT (ms)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


Draw = Callable[[RunData], Figure]
TTFT_BY_TURN: Final = "ttft_by_turn"

RUN_PLOTS: dict[str, Draw] = {
    "latency_cdf": latency_cdf,
    "latency_variance": latency_variance,
    "ttft_itl_timeline": ttft_itl_timeline,
    "gpu_fragmentation": gpu_fragmentation,
    "where_time_goes": where_time_goes,
    "cpu_by_component": cpu_by_component,
}
SWEEP_PLOTS: dict[str, Draw] = {
    "load_latency": load_latency,
    "load_goodput": load_goodput,
    "load_added_latency": load_added_latency,
}
TELEMETRY_PLOTS: Final = frozenset({"gpu_fragmentation", "cpu_by_component"})
PLOTS: dict[str, Draw] = {**RUN_PLOTS, **SWEEP_PLOTS}


def plots_for(run: RunData) -> dict[str, Draw]:
    """The figures that have data in this run: a sweep's load curves and its telemetry over
    time; a plain run's per-profile figures (the load curves would only say "no sweep"); TTFT
    by turn for each profile with multi-turn sessions (``ttft_by_turn-<profile>``)."""
    chosen = dict(SWEEP_PLOTS) if run.sweep is not None else {}
    for name, draw in RUN_PLOTS.items():
        if run.sweep is None or run.records or name in TELEMETRY_PLOTS:
            chosen[name] = draw
    for profile in run.turn_profiles:
        chosen[f"{TTFT_BY_TURN}-{profile}"] = partial(ttft_by_turn, profile=profile)
    return chosen


def data_notes(fig: Figure) -> list[str]:
    """What a drawn figure says, in place of a plot, it has no data for (whole or per panel)."""
    texts = [*fig.texts, *(text for ax in fig.axes for text in ax.texts)]
    return [text.get_text() for text in texts if text.get_gid() == NO_DATA]


def plots_absent(run: RunData) -> dict[str, str]:
    """The report's figures that ``plots_for`` leaves out of this run, each with why."""
    absent: dict[str, str] = {}
    if run.sweep is None:
        absent |= dict.fromkeys(SWEEP_PLOTS, NO_SWEEP)
    elif not run.records:
        reason = "a sweep keeps its requests per offered-rate point: the load curves carry them"
        absent |= {name: reason for name in RUN_PLOTS if name not in TELEMETRY_PLOTS}
    if not run.turn_profiles:
        absent[f"{TTFT_BY_TURN}-<profile>"] = (
            "no profile of this run has multi-turn sessions (workload sessions, sharegpt with "
            "max_turns > 1, or a trace with session ids)"
        )
    return absent


def render_all(run: RunData, out_dir: str | Path | None = None, dpi: int = 110) -> list[Path]:
    """Draw every plot that applies to the run (``plots_for``) into ``out_dir`` (default
    ``<run>/plots``) and return the PNG paths."""
    out = Path(out_dir) if out_dir is not None else run.path / schema.PLOTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in plots_for(run).items():
        fig = draw(run)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths
