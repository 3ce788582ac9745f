"""``zl-bench history [trend METRIC]``: the runs of the results store, filtered, with their
headline figures and intervals (``bench.history.listing``); ``--baseline TAG`` marks each run's
regressions against the tagged run by ``zl-bench compare``'s rules; ``trend METRIC`` plots one
metric across the runs.

Exit status: 0, or 1 when ``--baseline`` flagged a regression in a run listed (as ``compare``
exits 1), 2 for a mistake on the command line (an unknown metric or tag, a bad date, no store).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import duckdb

from bench.history.baseline import Against, against
from bench.history.listing import (
    HEADINGS,
    Filters,
    Line,
    lines,
    parse_date,
    profile_name,
)
from bench.history.trend import trend_points, write_trend
from bench.report.compare import Verdict
from harness import store
from harness.errors import UsageError
from harness.outputs import output_file
from harness.tables import Align, Column, text_table

FILTERS: Final = ("profile", "stack", "engine", "model", "scale", "commit", "host", "tag")


def filters_from(args: argparse.Namespace) -> Filters:
    return Filters(
        profile=profile_name(args.profile) if args.profile else None,
        stack=args.stack,
        engine=args.engine,
        model=args.model,
        scale=args.scale,
        commit=args.commit,
        host=args.host,
        tag=args.tag,
        since=parse_date(args.since) if args.since else None,
        until=parse_date(args.until, end=True) if args.until else None,
    )


def _columns(baseline: str | None) -> list[Column]:
    left = ["run", "started (UTC)", "state", "commit", "host", "scale", "engine", "stack"]
    left += ["profile", "trials"]
    columns = [Column(h, align=Align.LEFT) for h in left]
    columns += [Column(heading) for heading in HEADINGS.values()]
    columns.append(Column("tags", align=Align.LEFT))
    if baseline:
        columns.append(Column(f"vs {baseline}", align=Align.LEFT))
    return columns


def _cells(line: Line, verdicts: dict[str, Against]) -> list[str]:
    run = line.run
    trials = f"{line.deciding}/{line.trials}" + ("*" if line.all_trials else "")
    cells = [
        run.run_id, f"{run.started:%Y-%m-%d %H:%M}", run.state, run.git_revision, run.host,
        run.scale, run.engine, line.stack, line.profile, trials if line.trials else "-",
        *(line.figure_text(f) for f in HEADINGS),
        ",".join(run.tags) or "-",
    ]  # fmt: skip
    if verdicts:
        cells.append(verdicts[run.run_id].cell)
    return cells


def _notes(shown: Sequence[Line], verdicts: dict[str, Against], baseline: str | None) -> list[str]:
    """Under the table: what the marks mean, why runs are partial, what compare found."""
    notes = [
        "figures: the mean over the trials that may decide a comparison (compare's rule) "
        "[95 % interval]; trials: deciding/all, * none may decide, so the mean is over all"
    ]
    runs = {line.run.run_id: line.run for line in shown}.values()
    notes += [f"{r.run_id} is partial: {'; '.join(r.partial_reasons)}" for r in runs if r.partial]
    for run_id, verdict in verdicts.items():
        notes += [f"{run_id} against {baseline}: {finding}" for finding in verdict.findings]
    return notes


def list_runs(con: duckdb.DuckDBPyConnection, filters: Filters, baseline: str | None) -> int:
    """Print the listing; 1 when the baseline comparison flagged a regression."""
    shown = lines(con, filters)
    if not shown:
        print("no run in the store matches these filters")
        return 0
    ids = list(dict.fromkeys(line.run.run_id for line in shown))
    verdicts = against(con, baseline, ids) if baseline else {}
    print(text_table(_columns(baseline), [_cells(line, verdicts) for line in shown], gap=2))
    for note in _notes(shown, verdicts, baseline):
        print(f"note: {note}")
    return 1 if any(v.verdict is Verdict.REGRESSION for v in verdicts.values()) else 0


def _described(filters: Filters) -> str:
    """The filters as a title's tail: `` (profile a_latency, stack zerolayer)``."""
    given = [f"{name} {value}" for name in FILTERS if (value := getattr(filters, name))]
    given += [
        f"{name} {value:%Y-%m-%d %H:%M}"
        for name in ("since", "until")
        if (value := getattr(filters, name))
    ]
    return f" ({', '.join(given)})" if given else ""


def trend(con: duckdb.DuckDBPyConnection, metric: str, filters: Filters, out: Path) -> int:
    """Draw ``metric`` across the runs into ``out`` and say what was drawn."""
    points = trend_points(con, metric, filters)
    path = write_trend(points, metric, _described(filters), out)
    runs = len({p.run.run_id for p in points})
    marked = sorted({p.run.run_id for p in points if p.speed_change is not None})
    print(f"trend: {path} ({metric}, {runs} run(s), {len(points)} point(s))")
    if marked:
        print(f"note: the host's speed differed by more than 25 % in {', '.join(marked)}")
    return 0


def _action(words: Sequence[str]) -> str | None:
    """The metric of ``trend METRIC``; None for the listing; UsageError for anything else."""
    if not words:
        return None
    if words[0] == "trend" and len(words) == 2:
        return words[1]
    raise UsageError(f"expected nothing or trend METRIC after history, got {' '.join(words)!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench history``'s arguments: what to show, where the store is, the filters."""
    parser.add_argument(
        "action",
        nargs="*",
        metavar="trend METRIC",
        help="plot METRIC across the runs (a trials column or a sweep's figure); without "
        "it, list the runs",
    )
    parser.add_argument(
        "--results",
        default="results",
        help="the results directory (its store, and where a trend's PNG goes)",
    )
    parser.add_argument(
        "--store", default=None, help=f"the store (default: ${store.STORE_ENV}, else RESULTS/store)"
    )
    for name in FILTERS:
        parser.add_argument(
            f"--{name}",
            default=None,
            help=f"only runs of this {name}" + (" (a prefix)" if name == "commit" else ""),
        )
    parser.add_argument(
        "--since",
        default=None,
        help="only runs started on or after this date (UTC): 2026-12-01[T14:30]",
    )
    parser.add_argument(
        "--until", default=None, help="only runs started before the end of this date (UTC)"
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="TAG",
        help="mark each run's regressions against the run tagged TAG by zl-bench compare's "
        "rules (exit 1 if any)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="trend: the PNG to write (default RESULTS/history-METRIC.png)",
    )


def run_command(args: argparse.Namespace) -> int:
    metric = _action(args.action)
    filters = filters_from(args)
    results = Path(args.results).expanduser()
    if args.out is not None:
        output_file(args.out)
    with store.connect(store.Store(store.store_path(results, args.store))) as con:
        if metric is None:
            return list_runs(con, filters, args.baseline)
        if args.baseline:
            raise UsageError("--baseline marks a listing's regressions; it does not apply to trend")
        return trend(con, metric, filters, args.out or results / f"history-{metric}.png")
