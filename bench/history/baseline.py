"""``zl-bench history --baseline TAG``: each run listed against the tagged run, by
``zl-bench compare``'s own decision (``bench.report.compare.compare_runs``), on the trials the
store holds: the run directories need not be at hand (a shared store may list other people's
runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import orjson

from bench.history.listing import rows
from bench.report.compare import Comparison, Verdict, compare_runs
from bench.report.compare_common import change_text
from bench.report.data import RunData
from harness import schema
from harness.errors import UsageError


def tagged(con: duckdb.DuckDBPyConnection, tag: str) -> str:
    """The run ``tag`` names; UsageError for a tag nobody set."""
    found = con.execute("SELECT run_id FROM tags WHERE tag = ?", [tag]).fetchall()
    if not found:
        known = [r[0] for r in con.execute("SELECT tag FROM tags ORDER BY tag").fetchall()]
        listed = f"; tags: {', '.join(known)}" if known else "; no run is tagged yet"
        raise UsageError(f"unknown tag {tag!r}: set it with zl-bench tag RUN {tag}{listed}")
    return str(found[0][0])


def _rows_of(data: list[dict[str, Any]]) -> list[schema.SummaryRow]:
    return [schema.from_data(schema.SummaryRow, orjson.loads(d["row_json"])) for d in data]


def stored_run(con: duckdb.DuckDBPyConnection, run_id: str) -> RunData:
    """A run as the store holds it, in the shape ``compare`` reads: its metadata, trials and
    sweep, and why it is partial (no records, telemetry or phases: compare needs none)."""
    found = rows(con.execute("SELECT * FROM runs WHERE run_id = ?", [run_id]))
    if not found:
        raise UsageError(f"unknown run {run_id!r}: it is not in the results store")
    run = found[0]
    trials = rows(
        con.execute(
            "SELECT row_json, sweep_point IS NOT NULL AS swept FROM trials WHERE run_id = ? "
            "ORDER BY stack, profile, repeat, sweep_point",
            [run_id],
        )
    )
    sweep = None
    if run["sweep_json"]:
        section = orjson.loads(run["sweep_json"])
        points = [schema.to_data(p) for p in _rows_of([t for t in trials if t["swept"]])]
        sweep = schema.from_data(schema.SweepSection, {**section, "points": points})
    return RunData(
        path=Path(run["path"]),
        meta=schema.from_data(schema.RunMeta, orjson.loads(run["meta_json"])),
        records={},
        summaries=_rows_of([t for t in trials if not t["swept"]]),
        telemetry=[],
        phases=[],
        faults=[],
        incomplete_reasons=list(run["partial_reasons"] or []),
        sweep=sweep,
    )


@dataclass(frozen=True, slots=True)
class Against:
    """One run against the baseline: compare's verdict and, in words, what it flagged or why
    the two could not be compared."""

    run_id: str
    verdict: Verdict | None
    findings: list[str]

    @property
    def cell(self) -> str:
        if self.verdict is None:
            return "baseline"
        if self.verdict is Verdict.REGRESSION:
            return f"REGRESSION ({len(self.findings)})"
        return "no regression" if self.verdict is Verdict.NO_REGRESSION else "incomparable"


def _findings(result: Comparison) -> list[str]:
    if result.verdict is Verdict.INCOMPARABLE:
        return [result.mismatch] if result.mismatch else list(result.incomparable)
    found = [
        f"{r.stack}/{r.profile} {r.metric}: {r.a if r.a is None else f'{r.a:.3f}'} -> "
        f"{r.b if r.b is None else f'{r.b:.3f}'} ({change_text(r.change)}; 95 % interval of "
        f"the difference [{r.ci_low or 0.0:+.3f}, {r.ci_high or 0.0:+.3f}])"
        for r in result.regressions
    ]
    if result.sweep is not None:
        found += [
            f"{h.stack} {h.figure}: {change_text(h.change)} ({h.why})"
            for h in result.sweep.regressions
        ]
    return found


def against(con: duckdb.DuckDBPyConnection, tag: str, run_ids: list[str]) -> dict[str, Against]:
    """Each of ``run_ids`` against the run ``tag`` names, by compare's rules (its defaults:
    10 % threshold, 95 % intervals)."""
    base_id = tagged(con, tag)
    base = stored_run(con, base_id)
    out = {}
    for run_id in run_ids:
        if run_id == base_id:
            out[run_id] = Against(run_id, None, [])
            continue
        result = compare_runs(base, stored_run(con, run_id))
        out[run_id] = Against(run_id, result.verdict, _findings(result))
    return out
