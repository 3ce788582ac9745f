"""``zl-bench compare A B``: two runs side by side with bootstrap confidence intervals.

For every (stack, profile) in both runs and every compared metric, the difference B - A gets a
percentile bootstrap interval from resampling whole requests (so a request's ITL gaps stay
together). A change is flagged as a regression when the interval excludes zero in the worse
direction *and* the change is beyond the threshold: statistically real and big enough to matter.
Point values are harness.metrics' own; the resampled statistics use the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.report.data import RunData, load_run
from harness import metrics, schema


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


@dataclass(frozen=True, slots=True)
class Row:
    stack: str
    profile: str
    metric: str
    a: float
    b: float
    ci_low: float
    ci_high: float
    regression: bool

    @property
    def diff(self) -> float:
        return self.b - self.a

    @property
    def change(self) -> float:
        """Relative change B vs A (inf when A is 0 and B is not)."""
        if self.a:
            return self.diff / abs(self.a)
        return 0.0 if not self.diff else float("inf")


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
        self.summary = metrics.summarize(records)

    def point(self, metric: Metric) -> float:
        if metric.key == "failed_fraction":
            n = self.summary["num_requests"]
            return (self.summary["errors"] + self.summary["lost"]) / n if n else 0.0
        return float(self.summary[metric.key])

    def resampled(self, metric: Metric, idx: np.ndarray) -> float:
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
        return metrics.describe(metric.series, values)[metric.key]


def _compare_pair(
    stack: str,
    profile: str,
    a: _Sample,
    b: _Sample,
    n_boot: int,
    threshold: float,
    confidence: float,
    rng: np.random.Generator,
) -> list[Row]:
    ia = rng.integers(0, len(a.records), size=(n_boot, len(a.records)))
    ib = rng.integers(0, len(b.records), size=(n_boot, len(b.records)))
    lo_q, hi_q = 50 * (1 - confidence), 50 * (1 + confidence)
    rows = []
    for metric in METRICS:
        diffs = np.array(
            [b.resampled(metric, ib[k]) - a.resampled(metric, ia[k]) for k in range(n_boot)]
        )
        lo, hi = (float(x) for x in np.percentile(diffs, [lo_q, hi_q]))
        va, vb = a.point(metric), b.point(metric)
        worse = va - vb if metric.higher_is_better else vb - va
        real = hi < 0 if metric.higher_is_better else lo > 0
        big = worse > max(threshold * abs(va), metric.min_abs_change)
        rows.append(Row(stack, profile, metric.key, va, vb, lo, hi, bool(real and big)))
    return rows


def compare_runs(
    a: RunData,
    b: RunData,
    n_boot: int = 1000,
    threshold: float = 0.10,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[list[Row], list[str]]:
    """Rows for every (stack, profile) both runs have, and notes on what only one of them has."""
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    notes = []
    for key in sorted(set(a.records) | set(b.records)):
        ra, rb = a.records.get(key, []), b.records.get(key, [])
        if not ra or not rb:
            where = "A" if ra else "B"
            notes.append(f"{key[0]}/{key[1]}: only in run {where}, not compared")
            continue
        rows += _compare_pair(
            key[0], key[1], _Sample(ra), _Sample(rb), n_boot, threshold, confidence, rng
        )
    return rows, notes


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
        change = "n/a" if r.change == float("inf") else f"{r.change:+.1%}"
        lines.append(
            (
                r.stack,
                r.profile,
                r.metric,
                f"{r.a:.3f}",
                f"{r.b:.3f}",
                f"{r.diff:+.3f}",
                f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}]",
                change,
                "REGRESSION" if r.regression else "",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def main(
    a_dir: str | Path,
    b_dir: str | Path,
    n_boot: int = 1000,
    threshold: float = 0.10,
    confidence: float = 0.95,
) -> int:
    """Print the comparison; exit status 1 when a regression is flagged, else 0."""
    a, b = load_run(a_dir), load_run(b_dir)
    rows, notes = compare_runs(a, b, n_boot=n_boot, threshold=threshold, confidence=confidence)
    print(
        f"A = {a.path}  B = {b.path}  ({n_boot} bootstrap resamples of requests, regression: "
        f"CI of B-A excludes 0 on the worse side and the change exceeds {threshold:.0%} and "
        f"the noise floor: {LATENCY_FLOOR_MS:g} ms latency, {ITL_FLOOR_MS:g} ms ITL)"
    )
    for run, name in ((a, "A"), (b, "B")):
        if run.incomplete:
            print(f"note: run {name} is incomplete: {'; '.join(run.incomplete_reasons)}")
    print(format_table(rows, confidence))
    for note in notes:
        print(f"note: {note}")
    flagged = [r for r in rows if r.regression]
    if not rows:
        print("nothing to compare: the runs share no stack and profile")
        return 2
    print(f"{len(flagged)} regression(s) flagged" if flagged else "no regression flagged")
    return 1 if flagged else 0
