"""``zl-bench compare A B``: two runs side by side, plain runs here, sweeps in compare_sweep.

Plain runs are compared on trials (``harness.validity``): for every (stack, profile) in both runs,
each run's valid trials give one value of each metric per trial, and the difference of the
means, B - A, gets a Welch interval over trials (never over requests: open-loop latencies within
a run are autocorrelated, and a run's own noise says nothing of the next run's). A change is a
regression only when that interval lies wholly beyond the threshold on the worse side: beyond
``--threshold`` of A's value and the metric's noise floor. A side with fewer than
``MIN_TRIALS`` valid trials, or hosts whose speeds differ by more than ``SPEED_DIFFERS``, makes
the runs incomparable (exit 2) unless ``--force``. A trial is valid here when the harness kept
its part (``harness.validity.harness_problems``: loader on schedule, host measured, not saturated
and steady); a stack that saturates or loses requests is what compare is for, so those count.

Sweeps (both runs swept the same profile) are judged on their headline figures and listed at the
offered rates both ran, by bench.report.compare_sweep; this module checks the two runs are alike,
joins the verdicts and prints them. compare_sweep's public names are re-exported here.

Exit status for CI: 0 no regression, 1 regression, 2 error or incomparable runs (different
scale, engine, seed, loader or SLOs, too few valid trials, hosts of different speeds, unless
forced; a sweep against a plain run, always). A fall to zero completions is a regression: with
nothing completed there is no latency to compare, not a -100 % "improvement".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import orjson
from pydantic import computed_field

from bench.report import claims
from bench.report.compare_common import (
    BY_NAME,
    Metric,
    change_text,
    difference,
    format_value,
    relative_change,
    text_table,
)
from bench.report.compare_sweep import (
    ADDED_LATENCY_RATE,
    ADDED_LATENCY_STACK,
    HEADLINE_FIGURES,
    POINT_METRICS,
    RATE_TOLERANCE,
    Flag,
    HeadlineRow,
    PointRow,
    Span,
    SweepComparison,
    compare_sweeps,
    format_headline,
    format_points,
    judge,
    judge_shift,
    print_sweep,
    sweep_differences,
)
from bench.report.data import RunData, load_run
from harness import curves, schema, validity
from harness.errors import UsageError
from harness.outputs import output_file
from harness.telemetry.host import speed_note

__all__ = [
    "ADDED_LATENCY_RATE",
    "ADDED_LATENCY_STACK",
    "HEADLINE_FIGURES",
    "ITL_FLOOR_MS",
    "LATENCY_FLOOR_MS",
    "METRICS",
    "POINT_METRICS",
    "RATE_TOLERANCE",
    "ClaimChange",
    "Comparison",
    "Flag",
    "HeadlineRow",
    "Metric",
    "PointRow",
    "Row",
    "Span",
    "SweepComparison",
    "Verdict",
    "add_arguments",
    "check_settings",
    "compare_runs",
    "compare_sweeps",
    "format_claims",
    "format_headline",
    "format_points",
    "format_table",
    "judge",
    "judge_shift",
    "main",
    "run_command",
]


# The smallest change worth a flag whatever the interval says (timer and scheduler jitter of a
# shared machine, a few ms here): changes smaller than these floors are never flagged.
LATENCY_FLOOR_MS = 5.0
ITL_FLOOR_MS = 1.0

METRICS: tuple[Metric, ...] = (
    Metric("median_ttft_ms", "ttft", min_abs_change=LATENCY_FLOOR_MS),
    Metric("p99_ttft_ms", "ttft", min_abs_change=LATENCY_FLOOR_MS),
    Metric("median_itl_ms", "itl", min_abs_change=ITL_FLOOR_MS),
    Metric("median_e2el_ms", "e2el", min_abs_change=LATENCY_FLOOR_MS),
    Metric("p99_e2el_ms", "e2el", min_abs_change=LATENCY_FLOOR_MS),
    Metric("std_e2el_ms", "e2el", min_abs_change=LATENCY_FLOOR_MS),
    Metric("request_throughput", "", higher_is_better=True),
    Metric("failed_fraction", "", min_abs_change=0.01),
)


class Verdict(IntEnum):
    """compare's exit status, as a CI gate reads it."""

    NO_REGRESSION = 0
    REGRESSION = 1
    INCOMPARABLE = 2


@dataclass(frozen=True, slots=True)
class Row:
    """One metric of one (stack, profile): A, B, the CI of B - A, and the flag.

    ``a``/``b`` are None where a run has no such figure (no completions, no latency).
    """

    stack: str
    profile: str
    metric: str
    a: float | None
    b: float | None
    ci_low: float | None
    ci_high: float | None
    regression: bool

    @computed_field  # type: ignore[prop-decorator]
    @property
    def diff(self) -> float | None:
        return difference(self.a, self.b)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def change(self) -> float | None:
        return relative_change(self.a, self.b)


@dataclass(frozen=True, slots=True)
class ClaimChange:
    """One seed claim as each run's ``claims.json`` decided it: shown beside the metrics, never
    a regression by itself (a claim is about the architecture, not about a change)."""

    key: str
    a: str
    b: str
    a_measured: str
    b_measured: str

    @property
    def changed(self) -> bool:
        return self.a != self.b


@dataclass(slots=True)
class Comparison:
    """Everything ``compare`` decided, as printed and as written by ``--json``.

    ``incomparable`` lists what makes the runs unlike (refused unless ``forced``);
    ``differences`` configuration that differs but is what a comparison is for (engine options,
    sweep placement); ``mismatch`` a difference no ``--force`` overrides (a sweep against a plain
    run, sweeps of different profiles).
    """

    a: str
    b: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    incomparable: list[str] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    mismatch: str = ""
    sweep: SweepComparison | None = None
    forced: bool = False
    claims: list[ClaimChange] = field(default_factory=list)

    @property
    def regressions(self) -> list[Row]:
        return [r for r in self.rows if r.regression]

    @computed_field(alias="regressions")  # type: ignore[prop-decorator]
    @property
    def regression_count(self) -> int:
        swept = len(self.sweep.regressions) if self.sweep is not None else 0
        return len(self.regressions) + swept

    @property
    def measured(self) -> bool:
        """Whether anything was compared at all (a row, or a headline figure of both sweeps)."""
        return bool(self.rows) or (self.sweep is not None and self.sweep.measured)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def verdict(self) -> Annotated[Verdict, BY_NAME]:
        if self.mismatch or (self.incomparable and not self.forced) or not self.measured:
            return Verdict.INCOMPARABLE
        return Verdict.REGRESSION if self.regression_count else Verdict.NO_REGRESSION

    @computed_field  # type: ignore[prop-decorator]
    @property
    def exit_status(self) -> int:
        return int(self.verdict)


def _trial_value(row: schema.SummaryRow, metric: Metric) -> float | None:
    if metric.key == "failed_fraction":
        return row.failed / row.num_requests if row.num_requests else 0.0
    if metric.key == "request_throughput":
        return row.request_throughput
    return row.stat(metric.key)


def _metric_row(
    key: tuple[str, str],
    metric: Metric,
    trials: tuple[list[schema.SummaryRow], list[schema.SummaryRow]],
    threshold: float,
    confidence: float,
) -> Row:
    """One metric over both runs' trials: the means, the Welch interval of B - A, and whether
    the whole interval lies beyond the threshold on the worse side."""
    a = [v for v in (_trial_value(r, metric) for r in trials[0]) if v is not None]
    b = [v for v in (_trial_value(r, metric) for r in trials[1]) if v is not None]
    if not a or not b:
        va = float(np.mean(a)) if a else None
        vb = float(np.mean(b)) if b else None
        return Row(key[0], key[1], metric.key, va, vb, None, None, False)
    va, vb = float(np.mean(a)), float(np.mean(b))
    _, lo, hi = curves.difference_interval(a, b, confidence)
    bound = max(threshold * abs(va), metric.min_abs_change)
    if lo is None or hi is None:
        beyond = False
    else:
        beyond = hi < -bound if metric.higher_is_better else lo > bound
    return Row(key[0], key[1], metric.key, va, vb, lo, hi, beyond)


def _compare_pair(
    key: tuple[str, str],
    a: list[schema.SummaryRow],
    b: list[schema.SummaryRow],
    threshold: float,
    confidence: float,
) -> list[Row]:
    rows = [_metric_row(key, m, (a, b), threshold, confidence) for m in METRICS]
    done_a, done_b = sum(r.completed for r in a), sum(r.completed for r in b)
    if done_a > 0 and done_b == 0:
        rows.append(Row(key[0], key[1], "completed", done_a / len(a), 0.0, None, None, True))
    return rows


def _valid_trials(run: RunData, key: tuple[str, str]) -> tuple[list[schema.SummaryRow], str]:
    """The run's trials of ``key`` that may decide, and what is wrong with the others."""
    rows = [r for r in run.summaries if (r.stack, r.profile) == key]
    reference = run.meta.machine.cpu_speed_start or validity.first_speed(rows)
    good = [r for r in rows if not validity.harness_problems(r, reference)]
    bad = [f"trial {r.repeat}: {'; '.join(validity.harness_problems(r, reference))}"
           for r in rows if r not in good]  # fmt: skip
    return good, " | ".join(bad)


def _differences(a: RunData, b: RunData) -> list[str]:
    """What makes two runs not like for like: scale, engine, seed, loader."""
    out = []
    pairs: list[tuple[str, object, object]] = [
        ("scale", a.meta.scale, b.meta.scale),
        ("engine", a.meta.engine, b.meta.engine),
        ("seed", a.meta.seed, b.meta.seed),
        ("loader", a.meta.loader, b.meta.loader),
    ]
    seeds_a, seeds_b = a.meta.profile_seeds(), b.meta.profile_seeds()
    for profile in sorted(set(seeds_a) & set(seeds_b)):
        pairs.append((f"{profile} seed", seeds_a[profile], seeds_b[profile]))
    loaders_a = {(r.stack, r.profile): r.loader for r in a.summaries}
    for row in b.summaries:
        other = loaders_a.get((row.stack, row.profile))
        if other is not None:
            pairs.append((f"{row.stack}/{row.profile} loader", other, row.loader))
    for what, va, vb in pairs:
        if va != vb:
            out.append(f"{what} differs: A {va!r}, B {vb!r}")
    return out


def _invalid_notes(run: RunData, name: str) -> list[str]:
    notes = [f"run {name} is incomplete: {r}" for r in run.incomplete_reasons]
    for row in run.summaries:
        if not row.valid:
            reasons = "; ".join(row.invalid_reasons)
            notes.append(f"run {name} {row.stack}/{row.profile} is INVALID: {reasons}")
    return notes


def _engine_differences(a: RunData, b: RunData) -> list[str]:
    """Engine options that differ: what a comparison is often for, so listed, not refused."""
    opts_a, opts_b = a.meta.engine_options, b.meta.engine_options

    def shown(opts: dict[str, Any], key: str) -> str:
        return repr(opts[key]) if key in opts else "unset"

    return [
        f"engine option {key}: A {shown(opts_a, key)}, B {shown(opts_b, key)}"
        for key in sorted(set(opts_a) | set(opts_b))
        if opts_a.get(key) != opts_b.get(key) or (key in opts_a) != (key in opts_b)
    ]


def _kind(run: RunData) -> str:
    return f"a sweep of {run.sweep.profile}" if run.sweep is not None else "a plain run"


def _mismatch(a: RunData, b: RunData) -> str:
    """Why two runs cannot be compared at all, whatever ``--force`` says; "" when they can."""
    if (a.sweep is None) != (b.sweep is None):
        return f"A is {_kind(a)}, B is {_kind(b)}: compare a sweep with a sweep"
    if a.sweep is not None and b.sweep is not None and a.sweep.profile != b.sweep.profile:
        return f"A is {_kind(a)}, B is {_kind(b)}: compare sweeps of one profile"
    return ""


def _claim_changes(a: RunData, b: RunData) -> tuple[list[ClaimChange], list[str]]:
    """Each claim both runs' ``claims.json`` decided, A's verdict beside B's; a note for a run
    that has no such file (its report was never rendered)."""
    read = {name: claims.read(run.path) for name, run in (("A", a), ("B", b))}
    notes = [f"run {name} has no {claims.CLAIMS_FILE} (`zl-bench report` writes it): its claims "
             "are not shown" for name, got in read.items() if got is None]  # fmt: skip
    if read["A"] is None or read["B"] is None:
        return [], notes
    by_key = {c.key: c for c in read["B"].claims}
    return [
        ClaimChange(c.key, c.status, by_key[c.key].status, c.measured, by_key[c.key].measured)
        for c in read["A"].claims
        if c.key in by_key
    ], notes


def compare_runs(
    a: RunData,
    b: RunData,
    threshold: float = 0.10,
    confidence: float = 0.95,
    force: bool = False,
) -> Comparison:
    """Rows for every (stack, profile) both runs have and, for two sweeps, their headline
    figures and shared points; with notes and what makes the runs unlike."""
    result = Comparison(str(a.path), str(b.path), forced=force)
    result.mismatch = _mismatch(a, b)
    if result.mismatch:
        return result
    result.incomparable = _differences(a, b)
    result.differences = _engine_differences(a, b)
    if a.sweep is not None and b.sweep is not None:
        unlike, placement = sweep_differences(a.sweep, b.sweep)
        result.incomparable += unlike
        result.differences += placement
        result.sweep = compare_sweeps(a.sweep, b.sweep, threshold)
    if a.path.resolve() == b.path.resolve():
        result.notes.append("A and B are the same run: every difference is 0 by construction")
    result.notes += _invalid_notes(a, "A") + _invalid_notes(b, "B")
    result.claims, claim_notes = _claim_changes(a, b)
    result.notes += claim_notes
    speed = speed_note(a.meta.machine, b.meta.machine)
    if speed:
        result.incomparable.append(speed)
    keys_a = {(r.stack, r.profile) for r in a.summaries}
    keys_b = {(r.stack, r.profile) for r in b.summaries}
    for key in sorted(keys_a | keys_b):
        if key not in keys_a or key not in keys_b:
            where = "A" if key in keys_a else "B"
            result.notes.append(f"{key[0]}/{key[1]}: only in run {where}, not compared")
            continue
        (ta, why_a), (tb, why_b) = _valid_trials(a, key), _valid_trials(b, key)
        for name, got, why in (("A", ta, why_a), ("B", tb, why_b)):
            if len(got) < validity.MIN_TRIALS:
                result.incomparable.append(
                    f"{key[0]}/{key[1]}: run {name} has {validity.too_few(len(got))}"
                    + (f" ({why})" if why else "")
                )
        if ta and tb:
            result.rows += _compare_pair(key, ta, tb, threshold, confidence)
    return result


def format_table(rows: list[Row], confidence: float = 0.95) -> str:
    """A plain-text table, one line per stack/profile/metric; REGRESSION marks flagged ones."""
    header = (
        "stack",
        "profile",
        "metric",
        "A",
        "B",
        "B-A",
        f"{confidence:.0%} CI of B-A",
        "change",
        "flag",
    )
    lines = [header]
    for r in rows:
        ci = "n/a" if r.ci_low is None else f"[{r.ci_low:+.3f}, {r.ci_high or 0.0:+.3f}]"
        lines.append(
            (
                r.stack,
                r.profile,
                r.metric,
                format_value(r.a, ".3f"),
                format_value(r.b, ".3f"),
                format_value(r.diff, "+.3f"),
                ci,
                change_text(r.change),
                "REGRESSION" if r.regression else "",
            )
        )
    return text_table(lines)


def format_claims(changes: list[ClaimChange]) -> str:
    """The seed claims as each run decided them (from ``claims.json``), changes marked."""
    lines = [("claim", "A", "B", "")]
    lines += [(c.key, str(c.a), str(c.b), "CHANGED" if c.changed else "") for c in changes]
    return "seed claims, as each run's claims.json decided them:\n" + text_table(lines)


def _preamble(result: Comparison, threshold: float) -> str:
    where = f"A = {result.a}  B = {result.b}"
    if result.sweep is not None:
        return (
            f"{where}  (sweeps of {result.sweep.profile}; regression: a headline figure of B "
            f"below A's with the intervals over repeats apart, or for one repeat the values, "
            f"by more than {threshold:.0%})"
        )
    return (
        f"{where}  (means over each run's valid trials, at least {validity.MIN_TRIALS}; "
        f"regression: the Welch interval of B-A over trials lies wholly beyond {threshold:.0%} "
        f"of A and the noise floor ({LATENCY_FLOOR_MS:g} ms latency, {ITL_FLOOR_MS:g} ms ITL) "
        "on the worse side)"
    )


def _print(result: Comparison, threshold: float, confidence: float) -> None:
    if result.mismatch:
        print(f"incomparable: {result.mismatch}")
        return
    print(_preamble(result, threshold))
    for problem in result.incomparable:
        print(f"{'warning' if result.forced else 'incomparable'}: {problem}")
    if result.incomparable and not result.forced:
        print("the runs are not like for like; --force compares them anyway")
        return
    for differing in result.differences:
        print(f"differs: {differing}")
    if result.sweep is not None:
        print_sweep(result.sweep)
    if result.rows:
        print(format_table(result.rows, confidence))
    if result.claims:
        print(format_claims(result.claims))
    for note in result.notes:
        print(f"note: {note}")
    if not result.measured:
        what = (
            "no headline figure was measured in both sweeps"
            if result.sweep is not None
            else "the runs share no stack and profile"
        )
        print(f"nothing to compare: {what}")
        return
    count = result.regression_count
    print(f"{count} regression(s) flagged" if count else "no regression flagged")


def main(
    a_dir: str | Path,
    b_dir: str | Path,
    threshold: float = 0.10,
    confidence: float = 0.95,
    force: bool = False,
    json_path: Path | None = None,
) -> int:
    """Print the comparison (and write ``json_path``); returns the Verdict as exit status."""
    check_settings(threshold, confidence)
    a, b = load_run(a_dir), load_run(b_dir)
    result = compare_runs(a, b, threshold=threshold, confidence=confidence, force=force)
    _print(result, threshold, confidence)
    if json_path is not None:
        json_path.write_bytes(orjson.dumps(schema.to_data(result), option=orjson.OPT_INDENT_2))
    return int(result.verdict)


def check_settings(threshold: float, confidence: float) -> None:
    """UsageError for settings that cannot give an interval (``--confidence 95`` means 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise UsageError(
            f"--confidence must lie strictly between 0 and 1 (e.g. 0.95), got {confidence:g}"
        )
    if threshold < 0:
        raise UsageError(f"--threshold must be 0 or more, got {threshold:g}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench compare``'s arguments."""
    parser.add_argument("a", help="baseline results directory (results/<run-id>)")
    parser.add_argument("b", help="candidate results directory")
    parser.add_argument(
        "--threshold", type=float, default=0.10, help="relative change that counts as a regression"
    )
    parser.add_argument(
        "--confidence", type=float, default=0.95, help="CI level, a fraction in (0, 1)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="compare runs whose scale/engine/seed/loader/SLOs or host speeds differ, or with "
        "fewer valid trials than a verdict needs",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the verdict here")


def run_command(args: argparse.Namespace) -> int:
    if args.json is not None:
        output_file(args.json, "--json")
    return main(
        args.a,
        args.b,
        threshold=args.threshold,
        confidence=args.confidence,
        force=args.force,
        json_path=args.json,
    )
