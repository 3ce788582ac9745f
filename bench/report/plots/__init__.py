"""Every figure of the report, drawn from a loaded run (matplotlib, Agg, no display needed).

Each function takes a :class:`RunData` and returns a pyplot-free Figure whose title names the
run's scale and whose axes carry units; ``render_all`` writes those that apply to the run (a
sweep's load curves, or a plain run's per-profile figures) to ``plots/``. The notebook calls the
same functions, so a researcher redraws exactly what the report shows. Per-request values come
from ``harness.metrics.series`` and load curves from ``harness.curves``: plots and tables share
one definition. The modules hold one family of figures each; this one is their registry.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Final

from matplotlib.figure import Figure

from bench.report.data import RunData
from bench.report.plots.breakdown import cpu_by_component, time_breakdown, where_time_goes
from bench.report.plots.claims import claim_trials
from bench.report.plots.common import data_notes
from bench.report.plots.gpu import gpu_fragmentation
from bench.report.plots.latency import latency_cdf, latency_variance, ttft_by_turn
from bench.report.plots.load import (
    HOST_LABEL,
    HOST_NOTE,
    INVALID_LABEL,
    NO_SWEEP,
    SATURATED_LABEL,
    load_added_latency,
    load_goodput,
    load_latency,
)
from bench.report.plots.points import (
    rate_points,
    sweep_added_latency,
    sweep_headline,
    sweep_slos,
    sweep_stacks,
)
from bench.report.plots.timeline import ttft_itl_timeline
from harness import schema

__all__ = [
    "CLAIM_PLOTS",
    "HOST_LABEL",
    "HOST_NOTE",
    "INVALID_LABEL",
    "PLOTS",
    "RUN_PLOTS",
    "SATURATED_LABEL",
    "SWEEP_PLOTS",
    "TTFT_BY_TURN",
    "claim_trials",
    "cpu_by_component",
    "data_notes",
    "gpu_fragmentation",
    "latency_cdf",
    "latency_variance",
    "load_added_latency",
    "load_goodput",
    "load_latency",
    "plots_absent",
    "plots_for",
    "rate_points",
    "render_all",
    "sweep_added_latency",
    "sweep_headline",
    "sweep_slos",
    "sweep_stacks",
    "time_breakdown",
    "ttft_by_turn",
    "ttft_itl_timeline",
    "where_time_goes",
]

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
# Drawn for every run, plain or sweep: the claims as claims.json holds them.
CLAIM_PLOTS: dict[str, Draw] = {"claim_trials": claim_trials}
PLOTS: dict[str, Draw] = {**RUN_PLOTS, **SWEEP_PLOTS, **CLAIM_PLOTS}


def plots_for(run: RunData) -> dict[str, Draw]:
    """The figures that have data in this run: a sweep's load curves and its telemetry over
    time; a plain run's per-profile figures (the load curves would only say "no sweep"); TTFT
    by turn for each profile with multi-turn sessions (``ttft_by_turn-<profile>``); and the
    claims' trials, from ``claims.json``."""
    chosen = dict(SWEEP_PLOTS) if run.sweep is not None else {}
    for name, draw in RUN_PLOTS.items():
        if run.sweep is None or run.records or name in TELEMETRY_PLOTS:
            chosen[name] = draw
    for profile in run.turn_profiles:
        chosen[f"{TTFT_BY_TURN}-{profile}"] = partial(ttft_by_turn, profile=profile)
    return chosen | CLAIM_PLOTS


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
