"""``zl-bench compare A B``: two runs side by side with bootstrap confidence intervals.

For every (stack, profile) in both runs and every compared metric, the difference B - A gets a
percentile bootstrap interval from resampling whole requests (so a request's ITL gaps stay
together). A change is flagged as a regression when the interval excludes zero in the worse
direction *and* the change is beyond the threshold: statistically real and big enough to matter.
Point values are harness.metrics' own; the resampled statistics use the same functions.

Exit status for CI: 0 no regression, 1 regression, 2 error or incomparable runs (different
scale, engine, seed or loader, unless forced). A fall to zero completions is a regression: with
nothing completed there is no latency to compare, not a -100 % "improvement".
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.report.data import RunData, load_run
from harness import metrics, schema
from harness.errors import UsageError


@dataclass(frozen=True, slots=True)
class Metric:
    """A compared metric: its summary key, the series it is a statistic of, and its direction."""

    key: str
    series: str
    higher_is_better: bool = False
    min_abs_change: float = 0.0


# Resampling requests sees the noise inside a run, not between runs (timer and scheduler jitter
# of a shared machine, a few ms here): changes smaller than these floors are never flagged.
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

    @property
    def diff(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def change(self) -> float | None:
        """Relative change B vs A (inf when A is 0 and B is not; None when not measured)."""
        diff = self.diff
        if diff is None or self.a is None:
            return None
        if self.a:
            return diff / abs(self.a)
        return 0.0 if not diff else float("inf")


@dataclass(slots=True)
class Comparison:
    """Everything ``compare`` decided, as printed and as written by ``--json``."""

    a: str
    b: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    incomparable: list[str] = field(default_factory=list)
    forced: bool = False

    @property
    def regressions(self) -> list[Row]:
        return [r for r in self.rows if r.regression]

    @property
    def verdict(self) -> Verdict:
        if (self.incomparable and not self.forced) or not self.rows:
            return Verdict.INCOMPARABLE
        return Verdict.REGRESSION if self.regressions else Verdict.NO_REGRESSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "verdict": self.verdict.name.lower(),
            "exit_status": int(self.verdict),
            "regressions": len(self.regressions),
            "incomparable": self.incomparable,
            "forced": self.forced,
            "notes": self.notes,
            "rows": [asdict(r) | {"diff": r.diff, "change": r.change} for r in self.rows],
        }


class _Sample:
    """One (stack, profile)'s requests, pre-split per request for fast resampling."""

    def __init__(self, records: list[schema.RequestRecord]) -> None:
        self.records = records
        per = [metrics.series([r]) for r in records]
        self.single = {
            name: np.array([s[name][0] if s[name] else np.nan for s in per])
            for name in ("ttft", "e2el")
        }
        self.itl = [np.asarray(s["itl"], dtype=float) for s in per]
        self.completed = np.array([r.outcome == "completed" for r in records])
        self.duration = metrics.run_duration_s(records)
        self.summary = schema.SummaryRow.from_dict(metrics.summarize(records))

    def point(self, metric: Metric) -> float | None:
        if metric.key == "failed_fraction":
            n = self.summary.num_requests
            return self.summary.failed / n if n else 0.0
        if metric.key == "request_throughput":
            return self.summary.request_throughput
        return self.summary.stat(metric.key)

    def resampled(self, metric: Metric, idx: np.ndarray) -> float:
        """The metric on one resample; NaN where the resample has no such figure."""
        if metric.key == "failed_fraction":
            return float(1.0 - self.completed[idx].mean())
        if metric.key == "request_throughput":
            return float(self.completed[idx].sum() / self.duration) if self.duration else 0.0
        if metric.series == "itl":
            parts = [self.itl[i] for i in idx]
            values = np.concatenate(parts) if parts else np.zeros(0)
        else:
            values = self.single[metric.series][idx]
            values = values[~np.isnan(values)]
        value = metrics.describe(metric.series, list(values))[metric.key]
        return float("nan") if value is None else value


def _ci(diffs: np.ndarray, confidence: float) -> tuple[float | None, float | None]:
    finite = diffs[np.isfinite(diffs)]
    if finite.size == 0:
        return None, None
    lo, hi = np.percentile(finite, [50 * (1 - confidence), 50 * (1 + confidence)])
    return float(lo), float(hi)


def _metric_row(
    key: tuple[str, str],
    metric: Metric,
    samples: tuple[_Sample, _Sample],
    draws: tuple[np.ndarray, np.ndarray],
    threshold: float,
    confidence: float,
) -> Row:
    a, b = samples
    va, vb = a.point(metric), b.point(metric)
    if va is None or vb is None:
        return Row(key[0], key[1], metric.key, va, vb, None, None, False)
    diffs = np.array(
        [b.resampled(metric, ib) - a.resampled(metric, ia) for ia, ib in zip(*draws, strict=True)]
    )
    lo, hi = _ci(diffs, confidence)
    worse = va - vb if metric.higher_is_better else vb - va
    real = lo is not None and hi is not None and (hi < 0 if metric.higher_is_better else lo > 0)
    big = worse > max(threshold * abs(va), metric.min_abs_change)
    return Row(key[0], key[1], metric.key, va, vb, lo, hi, bool(real and big))


def _compare_pair(
    key: tuple[str, str],
    a: _Sample,
    b: _Sample,
    n_boot: int,
    threshold: float,
    confidence: float,
    rng: np.random.Generator,
) -> list[Row]:
    draws = (
        rng.integers(0, len(a.records), size=(n_boot, len(a.records))),
        rng.integers(0, len(b.records), size=(n_boot, len(b.records))),
    )
    rows = [_metric_row(key, m, (a, b), draws, threshold, confidence) for m in METRICS]
    done_a, done_b = a.summary.completed, b.summary.completed
    if done_a > 0 and done_b == 0:
        rows.append(Row(key[0], key[1], "completed", done_a, 0.0, None, None, True))
    return rows


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


def compare_runs(
    a: RunData,
    b: RunData,
    n_boot: int = 1000,
    threshold: float = 0.10,
    confidence: float = 0.95,
    seed: int = 0,
    force: bool = False,
) -> Comparison:
    """Rows for every (stack, profile) both runs have, with notes and what makes them unlike."""
    rng = np.random.default_rng(seed)
    result = Comparison(str(a.path), str(b.path), forced=force)
    result.incomparable = _differences(a, b)
    if a.path.resolve() == b.path.resolve():
        result.notes.append("A and B are the same run: every difference is 0 by construction")
    result.notes += _invalid_notes(a, "A") + _invalid_notes(b, "B")
    for key in sorted(set(a.records) | set(b.records)):
        ra, rb = a.records.get(key, []), b.records.get(key, [])
        if not ra or not rb:
            where = "A" if ra else "B"
            result.notes.append(f"{key[0]}/{key[1]}: only in run {where}, not compared")
            continue
        result.rows += _compare_pair(
            key, _Sample(ra), _Sample(rb), n_boot, threshold, confidence, rng
        )
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


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
        change = r.change
        ci = "n/a" if r.ci_low is None else f"[{r.ci_low:+.3f}, {r.ci_high or 0.0:+.3f}]"
        lines.append(
            (
                r.stack,
                r.profile,
                r.metric,
                _fmt(r.a, ".3f"),
                _fmt(r.b, ".3f"),
                _fmt(r.diff, "+.3f"),
                ci,
                "n/a" if change is None or change == float("inf") else f"{change:+.1%}",
                "REGRESSION" if r.regression else "",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _print(result: Comparison, n_boot: int, threshold: float, confidence: float) -> None:
    print(
        f"A = {result.a}  B = {result.b}  ({n_boot} bootstrap resamples of requests, regression: "
        f"CI of B-A excludes 0 on the worse side and the change exceeds {threshold:.0%} and "
        f"the noise floor: {LATENCY_FLOOR_MS:g} ms latency, {ITL_FLOOR_MS:g} ms ITL)"
    )
    for problem in result.incomparable:
        print(f"{'warning' if result.forced else 'incomparable'}: {problem}")
    if result.incomparable and not result.forced:
        print("the runs are not like for like; --force compares them anyway")
        return
    if result.rows:
        print(format_table(result.rows, confidence))
    for note in result.notes:
        print(f"note: {note}")
    if not result.rows:
        print("nothing to compare: the runs share no stack and profile")
        return
    flagged = result.regressions
    print(f"{len(flagged)} regression(s) flagged" if flagged else "no regression flagged")


def main(
    a_dir: str | Path,
    b_dir: str | Path,
    n_boot: int = 1000,
    threshold: float = 0.10,
    confidence: float = 0.95,
    force: bool = False,
    json_path: Path | None = None,
) -> int:
    """Print the comparison (and write ``json_path``); returns the Verdict as exit status."""
    check_settings(n_boot, threshold, confidence)
    a, b = load_run(a_dir), load_run(b_dir)
    result = compare_runs(
        a, b, n_boot=n_boot, threshold=threshold, confidence=confidence, force=force
    )
    _print(result, n_boot, threshold, confidence)
    if json_path is not None:
        json_path.write_bytes(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2))
    return int(result.verdict)


def check_settings(n_boot: int, threshold: float, confidence: float) -> None:
    """UsageError for settings that cannot give an interval (``--confidence 95`` means 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise UsageError(
            f"--confidence must lie strictly between 0 and 1 (e.g. 0.95), got {confidence:g}"
        )
    if n_boot < 1:
        raise UsageError(f"--bootstrap must be at least 1 resample, got {n_boot}")
    if threshold < 0:
        raise UsageError(f"--threshold must be 0 or more, got {threshold:g}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench compare``'s arguments."""
    parser.add_argument("a", help="baseline results directory (results/<run-id>)")
    parser.add_argument("b", help="candidate results directory")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument(
        "--threshold", type=float, default=0.10, help="relative change that counts as a regression"
    )
    parser.add_argument(
        "--confidence", type=float, default=0.95, help="CI level, a fraction in (0, 1)"
    )
    parser.add_argument(
        "--force", action="store_true", help="compare runs whose scale/engine/seed/loader differ"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the verdict here")


def run_command(args: argparse.Namespace) -> int:
    return main(
        args.a,
        args.b,
        n_boot=args.bootstrap,
        threshold=args.threshold,
        confidence=args.confidence,
        force=args.force,
        json_path=args.json,
    )
