"""Load curves: the headline figures of a sweep, each an interval over its repeats.

A sweep runs one profile at a series of offered rates, ``repeats`` times each (one seed per
repeat), on every stack. From each repeat's curve this module reads:
- **max goodput**: the highest ``request_goodput`` (requests/s meeting every SLO) on the curve;
- **knee**: the offered rate at which the run leaves its SLOs (the worst SLO's percentile over
  its bound, ``harness.metrics.slo_met``), interpolated linearly between the last point within
  and the first point past;
- **added-latency rate**: the offered rate at which the baseline's median E2EL exceeds the
  zero-layer stack's by more than a stated bound, interpolated the same way.
Points whose loader could not keep to its schedule (``loader_limited``) are the loader's, not the
stack's, and take no part. Each figure is the mean over repeats with a Student-t interval
(scipy), so a single repeat gives a value and no interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from scipy import stats as sps

from harness.metrics import Slo
from harness.schema import SummaryRow

CONFIDENCE: Final = 0.95
ZEROLAYER: Final = "zerolayer"
BASELINE: Final = "baseline"


@dataclass(frozen=True, slots=True)
class Interval:
    """A figure over repeats: ``value`` (mean), ``low``-``high`` (Student-t at ``confidence``;
    equal to ``value`` for one repeat), and each repeat's own figure. ``note`` says why a
    figure is missing or only bounded (e.g. the knee lies beyond the rates swept)."""

    value: float | None = None
    low: float | None = None
    high: float | None = None
    n: int = 0
    per_repeat: tuple[float | None, ...] = ()
    confidence: float = CONFIDENCE
    note: str = ""

    def text(self, spec: str = ".2f", unit: str = "") -> str:
        """``12.30 [11.90, 12.70] req/s (n=3)``, or the note when there is no value."""
        if self.value is None:
            return self.note or "-"
        unit = f" {unit}" if unit else ""
        if self.n < 2 or self.low is None or self.high is None:
            return f"{self.value:{spec}}{unit} (n={self.n})"
        return f"{self.value:{spec}} [{self.low:{spec}}, {self.high:{spec}}]{unit} (n={self.n})"


def interval(
    values: Sequence[float | None], note: str = "", floor: float | None = None
) -> Interval:
    """Mean and Student-t interval of the repeats' figures that exist; ``note`` explains the
    ones that do not (and is kept when some do, so a partial figure says so). ``floor`` clips
    the interval for a figure that cannot go below it (a rate is never negative)."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return Interval(None, None, None, 0, tuple(values), note=note)
    mean = float(np.mean(got))
    low = high = mean
    if len(got) > 1:
        sem = float(np.std(got, ddof=1)) / math.sqrt(len(got))
        half = float(sps.t.ppf(0.5 + CONFIDENCE / 2, len(got) - 1)) * sem
        low, high = mean - half, mean + half
    if floor is not None:
        low = max(low, floor)
    partial = note if len(got) < len(values) else ""
    return Interval(mean, low, high, len(got), tuple(values), note=partial)


def difference_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float | None, float | None]:
    """Mean of ``b`` minus mean of ``a`` and its Welch interval (unequal variances: scipy's
    ``ttest_ind``), for trials of two runs that are not paired; no interval with fewer than two
    on a side, and a point interval where neither side varies (scipy gives NaN there)."""
    diff = float(np.mean(b)) - float(np.mean(a))
    if len(a) < 2 or len(b) < 2:
        return diff, None, None
    if np.var(a) == 0 and np.var(b) == 0:
        return diff, diff, diff
    ci = sps.ttest_ind(b, a, equal_var=False).confidence_interval(confidence)
    return diff, float(ci.low), float(ci.high)


def usable(row: SummaryRow) -> bool:
    """A point that measured the stack: its loader kept to the schedule."""
    return not row.loader_limited


def repeats(points: Sequence[SummaryRow]) -> list[int]:
    return sorted({p.repeat for p in points})


def _curve(points: Sequence[SummaryRow], repeat: int) -> list[SummaryRow]:
    return sorted(
        (p for p in points if p.repeat == repeat and usable(p)), key=lambda p: p.offered_rate
    )


def slo_load(row: SummaryRow, slos: Sequence[Slo]) -> float | None:
    """The worst SLO's percentile as a fraction of its bound (1 is the edge); None without
    SLOs. A series with nothing measured counts as far past its bound."""
    if not slos:
        return None
    loads = []
    for slo in slos:
        value = row.stat(slo.stat_key)
        loads.append(math.inf if value is None else value / slo.bound_ms)
    return max(loads)


def crossing(curve: Sequence[tuple[float, float]], bound: float) -> tuple[float | None, str]:
    """The first rate at which ``y`` rises past ``bound`` along ``(rate, y)`` points sorted by
    rate, interpolated between the last point within and the first past; with a note when the
    crossing lies outside the rates measured."""
    if not curve:
        return None, "no valid points"
    previous: tuple[float, float] | None = None
    for rate, y in curve:
        if y > bound:
            if previous is None:
                return None, f"below the lowest rate measured ({rate:.4g} req/s)"
            r0, y0 = previous
            if not math.isfinite(y):
                return r0, ""
            return r0 + (rate - r0) * (bound - y0) / (y - y0), ""
        previous = (rate, y)
    return None, f"not reached by the highest rate measured ({curve[-1][0]:.4g} req/s)"


def max_goodput(points: Sequence[SummaryRow]) -> Interval:
    """The highest goodput on each repeat's curve, as an interval over repeats."""
    per = []
    for k in repeats(points):
        curve = _curve(points, k)
        per.append(max((p.request_goodput for p in curve), default=None))
    return interval(per, "no valid points", floor=0.0)


def knee(points: Sequence[SummaryRow], slos: Sequence[Slo]) -> Interval:
    """The offered rate at which each repeat leaves its SLOs, as an interval over repeats."""
    if not slos:
        return Interval(None, None, None, 0, note="no SLOs")
    per, notes = [], []
    for k in repeats(points):
        curve = [(p.offered_rate, slo_load(p, slos) or 0.0) for p in _curve(points, k)]
        rate, note = crossing(curve, 1.0)
        per.append(rate)
        notes.append(note)
    return interval(per, next((n for n in notes if n), ""), floor=0.0)


def highest_within(points: Sequence[SummaryRow], slos: Sequence[Slo]) -> Interval:
    """The highest offered rate each repeat served within its SLOs (what bisection finds)."""
    per = []
    for k in repeats(points):
        within = [p.offered_rate for p in _curve(points, k) if p.slo_met]
        per.append(max(within, default=None))
    return interval(per, "no point within the SLOs", floor=0.0)


@dataclass(frozen=True, slots=True)
class RateDelta:
    """The baseline's latency over the zero-layer stack's at one offered rate."""

    rate: float
    p50_ms: Interval
    p99_ms: Interval


def _paired(
    points: Sequence[SummaryRow], repeat: int, left: str, right: str
) -> list[tuple[SummaryRow, SummaryRow]]:
    """Points of two stacks at the same offered rate in one repeat (same seeded schedule)."""
    mine = [p for p in points if p.repeat == repeat]
    by_rate = {round(p.offered_rate, 9): p for p in mine if p.stack == left}
    pairs = []
    for p in mine:
        a = by_rate.get(round(p.offered_rate, 9))
        if p.stack == right and a is not None and usable(a) and usable(p):
            pairs.append((a, p))
    return sorted(pairs, key=lambda ab: ab[0].offered_rate)


def _delta(a: SummaryRow, b: SummaryRow, key: str) -> float | None:
    va, vb = a.stat(key), b.stat(key)
    return None if va is None or vb is None else vb - va


@dataclass(frozen=True, slots=True)
class AddedLatency:
    """Where the middle layer starts to cost: per rate, the baseline-minus-zero-layer E2EL, and
    the rate at which its median passes ``bound_ms``."""

    bound_ms: float
    rate: Interval
    by_rate: tuple[RateDelta, ...] = field(default=())


def added_latency(
    points: Sequence[SummaryRow],
    bound_ms: float,
    zerolayer: str = ZEROLAYER,
    baseline: str = BASELINE,
) -> AddedLatency:
    """The baseline's median and p99 E2EL over the zero-layer stack's at each shared rate, and
    the rate (interval over repeats) at which the median difference passes ``bound_ms``."""
    per_rate: dict[float, dict[str, list[float | None]]] = {}
    crossings, notes = [], []
    for k in repeats(points):
        pairs = _paired(points, k, zerolayer, baseline)
        curve = []
        for a, b in pairs:
            d50, d99 = _delta(a, b, "median_e2el_ms"), _delta(a, b, "p99_e2el_ms")
            slot = per_rate.setdefault(a.offered_rate, {"p50": [], "p99": []})
            slot["p50"].append(d50)
            slot["p99"].append(d99)
            curve.append((a.offered_rate, math.inf if d50 is None else d50))
        rate, note = crossing(curve, bound_ms)
        crossings.append(rate)
        notes.append(note)
    deltas = tuple(
        RateDelta(rate, interval(v["p50"]), interval(v["p99"]))
        for rate, v in sorted(per_rate.items())
    )
    note = next((n for n in notes if n), "") if per_rate else "no rate run on both stacks"
    return AddedLatency(bound_ms, interval(crossings, note, floor=0.0), deltas)


def headline(points: Sequence[SummaryRow], slos: Sequence[Slo]) -> dict[str, Interval]:
    """One stack's headline figures: max goodput, knee and the highest rate within the SLOs."""
    return {
        "max_goodput": max_goodput(points),
        "knee": knee(points, slos),
        "highest_within_slos": highest_within(points, slos),
    }


def geometric_rates(low: float, high: float, count: int) -> list[float]:
    """``count`` rates from ``low`` to ``high``, evenly spaced in log (as capacity is in
    multiples), rounded to three significant figures so that runs repeat exactly."""
    if count < 1 or low <= 0 or high < low:
        raise ValueError(f"need 0 < low <= high and count >= 1, got {low}, {high}, {count}")
    if count == 1:
        return [_round3(low)]
    raw = np.geomspace(low, high, count)
    return sorted({_round3(float(r)) for r in raw})


def _round3(value: float) -> float:
    return float(f"{value:.3g}")


Probe = Callable[[float], bool]


@dataclass(frozen=True, slots=True)
class Bisection:
    """The adaptive search's bracket: ``low`` met the SLOs, ``high`` did not (None where the
    search never found such a rate), after ``probes`` points."""

    low: float | None
    high: float | None
    probes: int


def bisect_rate(
    probe: Probe, low: float, high: float, resolution: float, max_probes: int = 12
) -> Bisection:
    """The highest rate at which ``probe`` still holds, to within ``resolution`` (a fraction of
    the rate), by bisection in log rate. The bracket is first widened (halving ``low`` until it
    holds, doubling ``high`` until it fails) within ``max_probes`` probes in all."""
    probes = 0

    def run(rate: float) -> bool:
        nonlocal probes
        probes += 1
        return probe(rate)

    lo: float | None = low
    while lo is not None and not run(lo):
        lo = lo / 2 if probes < max_probes // 3 else None
    if lo is None:
        return Bisection(None, low, probes)
    hi: float | None = high
    while hi is not None and run(hi):
        lo = hi
        hi = hi * 2 if probes < 2 * max_probes // 3 else None
    if hi is None:
        return Bisection(lo, None, probes)
    while hi / lo > 1 + resolution and probes < max_probes:
        mid = _round3(math.sqrt(lo * hi))
        if mid in (lo, hi):
            break
        if run(mid):
            lo = mid
        else:
            hi = mid
    return Bisection(lo, hi, probes)
