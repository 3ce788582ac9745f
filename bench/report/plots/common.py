"""What every figure shares: pyplot-free figures, stack colours, titles, the marking of data a
figure does not have (``NO_DATA``, read back by ``data_notes``), and the fault and phase marks
of a time axis."""

from __future__ import annotations

from typing import Any, Final

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from bench.report.data import RunData
from bench.report.plots.points import sweep_stacks

STACK_COLORS = {"zerolayer": "#1f77b4", "baseline": "#d62728"}
OTHER_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
NS = 1e9
# The gid of the text a figure (or one of its panels) shows in place of data it does not have.
NO_DATA: Final = "zl-no-data"


def new_figure(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Figure, Any]:
    """A pyplot-free Figure (Agg canvas): no global state, safe in threads and notebooks."""
    figsize = kwargs.pop("figsize", None)
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def run_stacks(run: RunData) -> list[str]:
    """The run's stacks: those with records, else those of its sweep."""
    return run.stacks or (sweep_stacks(run.sweep) if run.sweep is not None else [])


def stack_color(run: RunData, stack: str) -> str:
    if stack in STACK_COLORS:
        return STACK_COLORS[stack]
    others = [s for s in run_stacks(run) if s not in STACK_COLORS]
    return OTHER_COLORS[others.index(stack) % len(OTHER_COLORS)] if stack in others else "k"


def run_title(fig: Figure, run: RunData, what: str) -> None:
    stacks = ", ".join(run_stacks(run)) or "no stacks"
    fig.suptitle(f"{what}\nrun {run.run_id} · scale {run.scale} · stacks: {stacks}", fontsize=11)


def empty(fig: Figure, message: str) -> Figure:
    fig.text(0.5, 0.5, message, ha="center", va="center", fontsize=12, wrap=True, gid=NO_DATA)
    return fig


def no_completions(ax: Axes, what: str) -> None:
    """Say, where the figures would be, that there are none (an outage completes nothing)."""
    note(ax, what)
    ax.set_xticks([])
    ax.set_yticks([])


def note(ax: Axes, what: str) -> None:
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


def log_ms(axis: Any) -> None:
    """Log scale with plain millisecond tick labels at 1-2-5 steps (no 2x10^0 clutter)."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def mark_faults(ax: Axes, run: RunData, label: bool) -> None:
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


def shade_phases(ax: Axes, run: RunData, label: bool) -> None:
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


def telemetry_rows(run: RunData, source: str) -> list[dict[str, Any]]:
    return [r for r in run.telemetry if r.get("source") == source and not r.get("error")]


def data_notes(fig: Figure) -> list[str]:
    """What a drawn figure says, in place of a plot, it has no data for (whole or per panel)."""
    texts = [*fig.texts, *(text for ax in fig.axes for text in ax.texts)]
    return [text.get_text() for text in texts if text.get_gid() == NO_DATA]
