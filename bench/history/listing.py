"""The runs of the results store, filtered, with their headline figures: what ``zl-bench
history`` prints, ``results/index.html`` shows and ``zl-bench history trend`` draws.

A headline figure of a plain run is, per stack and profile, the mean over its trials that may
decide a comparison (``trials.decides``: ``zl-bench compare``'s rule) with a 95 % Student-t
interval over them (``harness.curves.interval``); where no trial may, the mean over all its
trials, marked. A sweep's are the headline figures it computed (``sweeps``): max goodput and
the knee, each an interval over repeats.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import duckdb
import pyarrow as pa

from harness import store
from harness.curves import Interval, interval
from harness.errors import UsageError
from harness.profile import resolve_name
from harness.tables import fmt

RUN_FIGURES: Final = ("median_e2el_ms", "median_ttft_ms", "request_throughput")
SWEEP_FIGURES: Final = ("max_goodput", "knee", "highest_within_slos")
# The figures a listing shows (``zl-bench history``, index.html), under these headings.
HEADINGS: Final = {
    "median_e2el_ms": "E2EL p50 (ms)",
    "median_ttft_ms": "TTFT p50 (ms)",
    "request_throughput": "req/s",
    "max_goodput": "max goodput (req/s)",
    "knee": "knee (req/s)",
}
RATES: Final = frozenset({"request_throughput", *SWEEP_FIGURES})
# Columns of ``trials`` a trend can draw: its numbers, less what identifies a trial.
_NOT_METRICS: Final = frozenset({"repeat", "sweep_point"})
TRIAL_METRICS: Final = tuple(
    f.name
    for f in store.TRIALS.schema
    if (pa.types.is_floating(f.type) or pa.types.is_integer(f.type)) and f.name not in _NOT_METRICS
)


@dataclass(frozen=True, slots=True)
class Filters:
    """What ``zl-bench history`` narrows the runs to; None: any. ``commit`` matches a prefix,
    ``since``/``until`` bound the start (UTC), ``until`` exclusive."""

    profile: str | None = None
    stack: str | None = None
    engine: str | None = None
    model: str | None = None
    scale: str | None = None
    commit: str | None = None
    host: str | None = None
    tag: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def where(self) -> tuple[str, list[Any]]:
        """The runs' WHERE clause and its parameters."""
        tests = [
            (self.engine, "engine = ?"),
            (self.model, "model = ?"),
            (self.scale, "scale = ?"),
            (self.host, "host = ?"),
            (self.commit, "starts_with(git_revision, ?)"),
            (self.tag, "run_id IN (SELECT run_id FROM tags WHERE tag = ?)"),
            (self.profile, "list_contains(profiles, ?)"),
            (self.stack, "list_contains(stacks, ?)"),
            (self.since, "started >= ?"),
            (self.until, "started < ?"),
        ]
        given = [(value, sql) for value, sql in tests if value is not None]
        clause = " AND ".join(sql for _, sql in given) or "true"
        return clause, [value for value, _ in given]


def profile_name(text: str) -> str:
    """A profile as the store names it: ``a`` is ``a_latency``; another name is taken as is."""
    try:
        return resolve_name(text)
    except ValueError:
        return text


def parse_date(text: str, end: bool = False) -> datetime:
    """``2026-12-01`` or an ISO date and time (UTC unless it names its offset) as naive UTC; a
    bare date as an ``end`` is the day after it (``--until 2026-12-01`` takes in that day)."""
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(f"{text!r} is not a date: write 2026-12-01 or 2026-12-01T14:30") from None
    if stamp.tzinfo is not None:
        stamp = stamp.astimezone(UTC).replace(tzinfo=None)
    bare = len(text.strip()) == len("2026-12-01")
    return stamp + timedelta(days=1) if end and bare else stamp


@dataclass(frozen=True, slots=True)
class StoredRun:
    """A row of ``runs`` as listings show it, with its tags."""

    run_id: str
    kind: str
    path: str
    report: str | None
    started: datetime
    end_state: str
    partial: bool
    partial_reasons: list[str]
    scale: str
    engine: str
    model: str
    git_revision: str
    host: str
    cpu_speed_start: int | None
    cpu_speed_end: int | None
    profiles: list[str]
    stacks: list[str]
    tags: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        return "partial" if self.partial else "complete"


_RUN_COLUMNS: Final = tuple(f for f in StoredRun.__dataclass_fields__ if f != "tags")


def rows(cursor: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """A query's rows as dicts by column name."""
    names = [d[0] for d in cursor.description or []]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def runs(con: duckdb.DuckDBPyConnection, filters: Filters) -> list[StoredRun]:
    """The runs that pass ``filters``, oldest first."""
    clause, params = filters.where()
    found = rows(
        con.execute(
            f"SELECT {', '.join(_RUN_COLUMNS)}, "
            "(SELECT list(tag ORDER BY tag) FROM tags t WHERE t.run_id = r.run_id) AS tags "
            f"FROM runs r WHERE {clause} ORDER BY started, run_id",
            params,
        )
    )
    return [StoredRun(**{**row, "tags": row["tags"] or []}) for row in found]


@dataclass(frozen=True, slots=True)
class Line:
    """One stack and profile of one run: its trials, how many may decide, and its headline
    figures (``all_trials``: none may decide, so over every trial)."""

    run: StoredRun
    stack: str
    profile: str
    trials: int = 0
    deciding: int = 0
    figures: dict[str, Interval] = field(default_factory=dict)

    @property
    def all_trials(self) -> bool:
        return self.trials > 0 and self.deciding == 0

    def figure_text(self, name: str) -> str:
        got = self.figures.get(name)
        if got is None or got.value is None:
            return "-"
        spec = ".2f" if name in RATES else ".1f"
        if got.n < 2 or got.low is None or got.high is None:
            return fmt(got.value, spec)
        return f"{got.value:{spec}} [{got.low:{spec}}, {got.high:{spec}}]"


def _of_runs(
    table: str, ids: Sequence[str], filters: Filters, *tests: str
) -> tuple[str, list[Any]]:
    """``table``'s rows of the runs ``ids`` (and ``tests``), narrowed to the filters' stack
    and profile: the WHERE clause and its parameters."""
    where: list[str] = ["list_contains(?, run_id)", *tests]
    params: list[Any] = [list(ids)]
    for value, column in ((filters.stack, "stack"), (filters.profile, "profile")):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    return f"FROM {table} WHERE {' AND '.join(where)}", params


def _trial_figures(
    con: duckdb.DuckDBPyConnection, ids: Sequence[str], metrics: Sequence[str], filters: Filters
) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """Each plain trial's ``metrics`` per (run, stack, profile), the runs ``ids`` only."""
    source, params = _of_runs("trials", ids, filters, "sweep_point IS NULL")
    columns = ", ".join(["run_id", "stack", "profile", "decides", *(f'"{m}"' for m in metrics)])
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows(con.execute(f"SELECT {columns} {source} ORDER BY repeat", params)):
        grouped[(row["run_id"], row["stack"], row["profile"])].append(row)
    return grouped


def _over_trials(trials: list[dict[str, Any]], metric: str) -> Interval:
    deciding = [t for t in trials if t["decides"]] or trials
    return interval([t[metric] for t in deciding])


def _sweep_figures(
    con: duckdb.DuckDBPyConnection, ids: Sequence[str], filters: Filters
) -> dict[tuple[str, str, str], dict[str, Interval]]:
    """Each sweep's headline figures per (run, stack, profile)."""
    source, params = _of_runs("sweeps", ids, filters)
    found: dict[tuple[str, str, str], dict[str, Interval]] = defaultdict(dict)
    for row in rows(con.execute(f"SELECT * {source}", params)):
        found[(row["run_id"], row["stack"], row["profile"])][row["figure"]] = Interval(
            row["value"], row["low"], row["high"], row["n"] or 0, note=row["note"] or ""
        )
    return found


def lines(
    con: duckdb.DuckDBPyConnection, filters: Filters, metrics: Sequence[str] = RUN_FIGURES
) -> list[Line]:
    """Every stack and profile of every run passing ``filters``, with its headline figures; a
    run with none (killed before its first trial) as one line with none."""
    listed = runs(con, filters)
    ids = [r.run_id for r in listed]
    trials = _trial_figures(con, ids, metrics, filters)
    swept = _sweep_figures(con, ids, filters)
    out = []
    for run in listed:
        mine = [k for k in trials if k[0] == run.run_id]
        for key in mine:
            group = trials[key]
            figures = {m: _over_trials(group, m) for m in metrics}
            deciding = sum(1 for t in group if t["decides"])
            out.append(Line(run, key[1], key[2], len(group), deciding, figures))
        sweeps = [k for k in swept if k[0] == run.run_id]
        out += [Line(run, k[1], k[2], figures=swept[k]) for k in sweeps]
        if not mine and not sweeps:
            out.append(Line(run, "-", "-"))
    return out
