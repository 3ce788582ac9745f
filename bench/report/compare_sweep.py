"""Two sweeps of one profile compared, for ``zl-bench compare`` (compare.py holds plain runs and
the command).

Each stack's headline figures (max goodput, knee, highest rate within the SLOs; intervals over
repeats, harness.curves') regress when B's lies below A's with the intervals apart (for one
repeat: the values) and the change is beyond the threshold. Where the sweeps ran different rates
a figure read off a grid is known only to within its step and is widened to it. The added-latency
rate is shown and marked "shifted", never a regression: it also rises when the zero-layer stack
gets slower. The points at the offered rates both sweeps ran are listed side by side (means over
repeats); a rate where a loader lagged, as invalid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated

import numpy as np
from pydantic import computed_field

from bench.report.compare_common import (
    BY_NAME,
    Metric,
    change_text,
    difference,
    format_value,
    relative_change,
    text_table,
)
from harness import curves, metrics, schema
from harness.curves import Interval

RATE_TOLERANCE = 0.005
"""Two offered rates are one point when within 0.5 % of each other."""

POINT_METRICS: tuple[Metric, ...] = (
    Metric("request_goodput", "", higher_is_better=True),
    Metric("median_ttft_ms", "ttft"),
    Metric("p99_ttft_ms", "ttft"),
    Metric("median_e2el_ms", "e2el"),
    Metric("p99_e2el_ms", "e2el"),
)
HEADLINE_FIGURES: tuple[str, ...] = ("max_goodput", "knee", "highest_within_slos")
ADDED_LATENCY_RATE = "added_latency_rate"
ADDED_LATENCY_STACK = f"{curves.BASELINE}-{curves.ZEROLAYER}"


class Flag(StrEnum):
    """What compare says of one headline figure; only REGRESSION fails the gate."""

    SAME = "same"
    REGRESSION = "REGRESSION"
    SHIFTED = "shifted"
    UNMEASURED = "not measured"


@dataclass(frozen=True, slots=True)
class Span:
    """Where a figure lies: its interval over repeats (``value`` the mean), or, for a figure
    beyond the rates swept, the one-sided range that implies (``value`` None): a knee not
    reached by 40 req/s lies in [40, inf)."""

    low: float
    high: float
    value: float | None
    n: int
    text: str

    @classmethod
    def of(cls, interval: Interval) -> Span | None:
        if interval.value is None:
            return None
        low = interval.value if interval.low is None else interval.low
        high = interval.value if interval.high is None else interval.high
        return cls(low, high, interval.value, interval.n, interval.text(".2f"))

    @classmethod
    def above(cls, rate: float) -> Span:
        return cls(rate, math.inf, None, 0, f"> {rate:.2f} (not reached)")

    @classmethod
    def below(cls, rate: float, why: str) -> Span:
        return cls(0.0, rate, None, 0, f"< {rate:.2f} ({why})")


def _unmeasured(a: Span | None, b: Span | None) -> str:
    """Which sides lack a span: "A", "B" or "A and B"."""
    return " and ".join(side for side, s in (("A", a), ("B", b)) if s is None)


def _drop(upper: Span, lower: Span, threshold: float) -> float | None:
    """How far ``lower`` lies below ``upper`` (a fraction of ``upper``'s mean, or of the bound
    a one-sided span gives) when wholly below it and by more than ``threshold``; else None."""
    if not lower.high < upper.low:
        return None
    if upper.value is not None and lower.value is not None:
        ref_up, ref_low = upper.value, lower.value
    else:
        ref_up, ref_low = upper.low, lower.high
    gap = ref_up - ref_low
    if gap <= threshold * abs(ref_up):
        return None
    return gap / abs(ref_up) if ref_up else math.inf


def _below_text(lower: str, upper: str, drop: float) -> str:
    pct = "" if math.isinf(drop) else f" ({-drop:+.0%})"
    return f"{lower} lies below {upper}{pct}"


def judge(a: Span | None, b: Span | None, threshold: float) -> tuple[Flag, str]:
    """B's figure against A's where higher is better: a regression when B's span lies wholly
    below A's (the intervals apart; for one repeat, the values) and the drop exceeds
    ``threshold`` of A's (its mean, or the bound a one-sided span gives)."""
    if a is None or b is None:
        return Flag.UNMEASURED, f"not measured in {_unmeasured(a, b)}"
    drop = _drop(a, b, threshold)
    if drop is None:
        return Flag.SAME, ""
    return Flag.REGRESSION, _below_text("B", "A", drop)


def judge_shift(a: Span | None, b: Span | None, threshold: float) -> tuple[Flag, str]:
    """A figure with no better direction (the added-latency rate also rises when the zero-layer
    stack gets slower): SHIFTED when the spans lie apart beyond ``threshold`` either way."""
    if a is None or b is None:
        return Flag.UNMEASURED, f"not measured in {_unmeasured(a, b)}"
    down, up = _drop(a, b, threshold), _drop(b, a, threshold)
    if down is not None:
        return Flag.SHIFTED, _below_text("B", "A", down)
    if up is not None:
        return Flag.SHIFTED, "B lies above A"
    return Flag.SAME, ""


@dataclass(frozen=True, slots=True)
class HeadlineRow:
    """One headline figure of one stack in both sweeps (req/s), with compare's flag. In the
    JSON form an unbounded end of a span (``inf``) is written as null."""

    stack: str
    figure: str
    a: Span | None
    b: Span | None
    flag: Annotated[Flag, BY_NAME]
    why: str = ""

    @property
    def regression(self) -> bool:
        return self.flag is Flag.REGRESSION

    @computed_field  # type: ignore[prop-decorator]
    @property
    def change(self) -> float | None:
        return relative_change(_span_value(self.a), _span_value(self.b))


def _span_value(span: Span | None) -> float | None:
    return None if span is None else span.value


@dataclass(frozen=True, slots=True)
class PointRow:
    """One metric at an offered rate both sweeps ran: means over repeats. ``invalid`` says why
    the rate was not compared (a side's loader could not keep to the schedule there)."""

    stack: str
    rate: float
    metric: str
    a: float | None
    b: float | None
    invalid: str = ""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def diff(self) -> float | None:
        return difference(self.a, self.b)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def change(self) -> float | None:
        return relative_change(self.a, self.b)


@dataclass(slots=True)
class SweepComparison:
    """Two sweeps of one profile: headline rows per stack, point rows at the shared rates."""

    profile: str
    headline: list[HeadlineRow] = field(default_factory=list)
    points: list[PointRow] = field(default_factory=list)
    shared_rates: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[HeadlineRow]:
        return [h for h in self.headline if h.regression]

    @property
    def measured(self) -> bool:
        return any(h.flag is not Flag.UNMEASURED for h in self.headline)


@dataclass(frozen=True, slots=True)
class _Side:
    """One stack in one sweep: its headline intervals and the valid points they came from."""

    headline: dict[str, Interval]
    valid: list[schema.SummaryRow]
    slos: tuple[metrics.Slo, ...]

    @classmethod
    def of(cls, sweep: schema.SweepSection, stack: str) -> _Side:
        slos = _slos(sweep)
        points = sweep.stack_points(stack)
        stored = (sweep.stacks.get(stack) or {}).get("headline") or {}
        computed = curves.headline(points, slos) if set(HEADLINE_FIGURES) - set(stored) else {}
        headline = {
            name: schema.from_data(Interval, stored[name]) if name in stored else computed[name]
            for name in HEADLINE_FIGURES
        }
        return cls(headline, [p for p in points if curves.usable(p)], slos)

    def span(self, figure: str, on_grid: bool) -> Span | None:
        """The figure's span. Off the other sweep's grid (``on_grid`` False: it ran other rates)
        a figure read off the rates swept is known only to within their step, so widened to it;
        on one grid both read it at the same rates and are compared as they are."""
        found = Span.of(self.headline[figure])
        if found is None:
            return self._beyond(figure)
        return found if on_grid else self._widened(figure, found)

    def _widened(self, figure: str, span: Span) -> Span:
        """A knee to the rates either side of it; the highest goodput or rate within the SLOs
        up to the next rate swept (where it may have peaked unseen)."""
        rates = sorted({p.offered_rate for p in self.valid})
        low = span.low
        if figure == "knee":
            low = max((r for r in rates if r <= span.low), default=0.0)
            high = next((r for r in rates if r >= span.high), math.inf)
        else:
            high = next((r for r in rates if r > span.high), math.inf)
        return Span(low, high, span.value, span.n, f"{span.text}, grid [{low:.2f}, {high:.2f}]")

    def _beyond(self, figure: str) -> Span | None:
        """Where a figure has no value: the range the valid points imply, if they imply one."""
        if not self.valid or not self.slos:
            return None
        lowest = min(p.offered_rate for p in self.valid)
        if figure == "highest_within_slos":
            return Span.below(lowest, "none within the SLOs")
        if figure != "knee":
            return None
        loads = [(p.offered_rate, curves.slo_load(p, self.slos) or 0.0) for p in self.valid]
        if all(load <= 1.0 for _, load in loads):
            return Span.above(max(rate for rate, _ in loads))
        if all(load > 1.0 for rate, load in loads if _same_rate(rate, lowest)):
            return Span.below(lowest, "below the lowest rate")
        return None


def _slos(sweep: schema.SweepSection) -> tuple[metrics.Slo, ...]:
    return tuple(schema.from_data(metrics.Slo, d) for d in sweep.slos)


def _same_rate(x: float, y: float) -> bool:
    return abs(x - y) <= RATE_TOLERANCE * max(abs(x), abs(y))


def _by_rate(points: Sequence[schema.SummaryRow]) -> list[list[schema.SummaryRow]]:
    """Points grouped by offered rate: a rate's repeats together, in order of rate."""
    groups: list[list[schema.SummaryRow]] = []
    for p in sorted(points, key=lambda p: p.offered_rate):
        if groups and _same_rate(groups[-1][0].offered_rate, p.offered_rate):
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return float(np.mean(got)) if got else None


def _point_value(row: schema.SummaryRow, metric: Metric) -> float | None:
    return row.request_goodput if metric.key == "request_goodput" else row.stat(metric.key)


def _point_rows(
    stack: str, a: list[schema.SummaryRow], b: list[schema.SummaryRow]
) -> list[PointRow]:
    """One shared rate's rows; a single "invalid, not compared" row where either side's loader
    lagged at that rate (its figures are the loader's, not the stack's)."""
    rate = float(np.mean([p.offered_rate for p in a]))
    limited = [_limited_text(side, g) for side, g in (("A", a), ("B", b))]
    if any(limited):
        why = f"invalid, not compared: loader-limited in {' and '.join(t for t in limited if t)}"
        return [PointRow(stack, rate, "-", None, None, why)]
    return [
        PointRow(
            stack,
            rate,
            m.key,
            _mean([_point_value(p, m) for p in a]),
            _mean([_point_value(p, m) for p in b]),
        )
        for m in POINT_METRICS
    ]


def _limited_text(side: str, group: Sequence[schema.SummaryRow]) -> str:
    """``A (repeat 0, 2)`` for a side whose loader lagged at some repeats of a rate; else ""."""
    repeats = sorted(p.repeat for p in group if p.loader_limited)
    if not repeats:
        return ""
    return f"{side} (repeat {', '.join(map(str, repeats))})"


def _rates_text(groups: Sequence[Sequence[schema.SummaryRow]]) -> str:
    return ", ".join(f"{g[0].offered_rate:.3g}" for g in groups) or "none"


def _side_notes(sweep: schema.SweepSection, stack: str, name: str) -> list[str]:
    """Why a stack's sweep stopped, and the points whose figures are not the stack's."""
    notes = []
    stopped = (sweep.stacks.get(stack) or {}).get("stopped")
    if stopped:
        notes.append(f"run {name} {stack}'s sweep stopped: {stopped}")
    points = sweep.stack_points(stack)
    limited = [p for p in points if p.loader_limited]
    if limited:
        rates = _rates_text(_by_rate(limited))
        notes.append(
            f"run {name} {stack}: loader-limited at {rates} req/s; left out of its figures"
        )
    hot = [p for p in points if p.host_saturated]
    if hot:
        notes.append(
            f"run {name} {stack}: host CPU saturated at {_rates_text(_by_rate(hot))} req/s; "
            "latency there measures CPU contention, not the stack"
        )
    return notes


def _stack_order(stacks: set[str]) -> list[str]:
    return sorted(stacks, key=lambda s: (s != curves.ZEROLAYER, s != curves.BASELINE, s))


def _compare_stack(
    result: SweepComparison,
    stack: str,
    sweeps: tuple[schema.SweepSection, schema.SweepSection],
    threshold: float,
) -> None:
    a, b = sweeps
    groups_a, groups_b = _by_rate(a.stack_points(stack)), _by_rate(b.stack_points(stack))
    shared = 0
    for group_a in groups_a:
        rate = group_a[0].offered_rate
        group_b = next((g for g in groups_b if _same_rate(rate, g[0].offered_rate)), None)
        if group_b is not None:
            shared += 1
            result.points += _point_rows(stack, group_a, group_b)
            if not any(_same_rate(rate, r) for r in result.shared_rates):
                result.shared_rates.append(rate)
    on_grid = shared == len(groups_a) == len(groups_b)
    if not on_grid:
        result.notes.append(
            f"{stack}: the sweeps ran different rates; figures read off each grid are compared "
            "to within its step"
        )
    side_a, side_b = _Side.of(a, stack), _Side.of(b, stack)
    for figure in HEADLINE_FIGURES:
        span_a, span_b = side_a.span(figure, on_grid), side_b.span(figure, on_grid)
        flag, why = judge(span_a, span_b, threshold)
        result.headline.append(HeadlineRow(stack, figure, span_a, span_b, flag, why))
    result.notes += _side_notes(a, stack, "A") + _side_notes(b, stack, "B")


def _added_latency_span(sweep: schema.SweepSection) -> Span | None:
    """The rate at which the baseline's median E2EL passes the zero-layer stack's by the bound;
    where it has no value, the range its per-rate differences imply."""
    data = sweep.added_latency
    if not data:
        return None
    found = Span.of(schema.from_data(Interval, data.get("rate") or {}))
    if found is not None:
        return found
    bound = float(data.get("bound_ms") or sweep.added_latency_bound_ms)
    measured = []
    for entry in data.get("by_rate") or []:
        p50 = schema.from_data(Interval, entry.get("p50_ms") or {}).value
        if p50 is not None:
            measured.append((float(entry["rate"]), p50))
    measured.sort()
    if not measured:
        return None
    if all(p50 <= bound for _, p50 in measured):
        return Span.above(measured[-1][0])
    if measured[0][1] > bound:
        return Span.below(measured[0][0], "below the lowest rate")
    return None


def _added_latency_row(
    a: schema.SweepSection, b: schema.SweepSection, threshold: float
) -> HeadlineRow | None:
    if not a.added_latency and not b.added_latency:
        return None
    span_a, span_b = _added_latency_span(a), _added_latency_span(b)
    bound_a = a.added_latency.get("bound_ms", a.added_latency_bound_ms)
    bound_b = b.added_latency.get("bound_ms", b.added_latency_bound_ms)
    if a.added_latency and b.added_latency and bound_a != bound_b:
        why = f"bounds differ: A {bound_a:g} ms, B {bound_b:g} ms"
        return HeadlineRow(
            ADDED_LATENCY_STACK, ADDED_LATENCY_RATE, span_a, span_b, Flag.UNMEASURED, why
        )
    flag, why = judge_shift(span_a, span_b, threshold)
    return HeadlineRow(ADDED_LATENCY_STACK, ADDED_LATENCY_RATE, span_a, span_b, flag, why)


def compare_sweeps(
    a: schema.SweepSection, b: schema.SweepSection, threshold: float = 0.10
) -> SweepComparison:
    """Headline rows for every stack both sweeps ran, the added-latency rate, and the points at
    the offered rates both ran (within RATE_TOLERANCE)."""
    result = SweepComparison(a.profile)
    stacks_a = {p.stack for p in a.points} | set(a.stacks)
    stacks_b = {p.stack for p in b.points} | set(b.stacks)
    for stack in _stack_order(stacks_a | stacks_b):
        if stack in stacks_a and stack in stacks_b:
            _compare_stack(result, stack, (a, b), threshold)
        else:
            where = "A" if stack in stacks_a else "B"
            result.notes.append(f"{stack}: swept only in run {where}, not compared")
    added = _added_latency_row(a, b, threshold)
    if added is not None:
        result.headline.append(added)
    result.shared_rates.sort()
    if stacks_a & stacks_b and not result.shared_rates:
        result.notes.append(
            f"the sweeps share no offered rate (A: {_rates_text(_by_rate(a.points))}; "
            f"B: {_rates_text(_by_rate(b.points))} req/s): headline figures compared only"
        )
    return result


def _slo_text(sweep: schema.SweepSection) -> str:
    return ", ".join(str(s) for s in _slos(sweep)) or "none"


def sweep_differences(
    a: schema.SweepSection, b: schema.SweepSection
) -> tuple[list[str], list[str]]:
    """(what makes two sweeps unlike: SLOs, loaders; what differs in their placement)."""
    unlike = []
    if sorted(map(str, _slos(a))) != sorted(map(str, _slos(b))):
        unlike.append(f"SLOs differ: A {_slo_text(a)}; B {_slo_text(b)}")
    loaders_a = {p.stack: p.loader for p in a.points}
    for stack, loader in sorted({p.stack: p.loader for p in b.points}.items()):
        other = loaders_a.get(stack)
        if other is not None and other != loader:
            unlike.append(f"{stack}/{a.profile} loader differs: A {other!r}, B {loader!r}")
    placement: list[tuple[str, object, object]] = [
        ("sweep mode", a.mode, b.mode),
        ("repeats", a.repeats, b.repeats),
        ("resolution", a.resolution, b.resolution),
        ("added-latency bound (ms)", a.added_latency_bound_ms, b.added_latency_bound_ms),
        ("rates", a.rates, b.rates),
        ("capacity preflight (req/s)", a.capacity_rps, b.capacity_rps),
    ]
    return unlike, [f"{what}: A {va!r}, B {vb!r}" for what, va, vb in placement if va != vb]


def format_headline(rows: list[HeadlineRow]) -> str:
    """The sweeps' headline figures (req/s), one line per stack and figure; the flag column
    says REGRESSION, shifted or not measured, and why."""
    lines = [("stack", "figure (req/s)", "A", "B", "change", "flag")]
    for h in rows:
        flag = "" if h.flag is Flag.SAME else h.flag.value
        lines.append(
            (
                h.stack,
                h.figure,
                h.a.text if h.a is not None else "-",
                h.b.text if h.b is not None else "-",
                change_text(h.change),
                f"{flag}: {h.why}" if h.why else flag,
            )
        )
    return text_table(lines)


def format_points(rows: list[PointRow]) -> str:
    """The points at the offered rates both sweeps ran, one line per stack, rate and metric."""
    lines = [("stack", "rate (req/s)", "metric", "A", "B", "B-A", "change", "note")]
    for p in rows:
        lines.append(
            (
                p.stack,
                f"{p.rate:.3g}",
                p.metric,
                "" if p.invalid else format_value(p.a, ".3f"),
                "" if p.invalid else format_value(p.b, ".3f"),
                "" if p.invalid else format_value(p.diff, "+.3f"),
                "" if p.invalid else change_text(p.change),
                p.invalid,
            )
        )
    return text_table(lines)


def print_sweep(sweep: SweepComparison) -> None:
    """The points first, the headline figures (what the verdict is read from) below them."""
    if sweep.points:
        print("points at the offered rates both sweeps ran (means over repeats):")
        print(format_points(sweep.points))
    print("headline figures: mean [interval] over repeats (n); > or < where beyond the rates swept")
    print(format_headline(sweep.headline))
    for note in sweep.notes:
        print(f"note: {note}")
