"""A sweep's points as the load curves and the report's tables read them: repeats grouped by
offered rate, and the headline figures as recorded (``harness.curves`` where absent)."""

from __future__ import annotations

from dataclasses import dataclass

from harness import curves, metrics, schema
from harness.curves import Interval
from harness.schema import SummaryRow


@dataclass(frozen=True, slots=True)
class RatePoint:
    """One stack's repeats at one offered rate. Usable repeats pool into intervals over repeats
    (``harness.curves.interval``); loader-limited ones are the loader's and are drawn apart."""

    rate: float
    rows: tuple[SummaryRow, ...]

    @property
    def valid(self) -> list[SummaryRow]:
        return [r for r in self.rows if curves.usable(r)]

    @property
    def invalid(self) -> list[SummaryRow]:
        return [r for r in self.rows if not curves.usable(r)]

    def stat(self, key: str) -> Interval:
        """A series statistic (vLLM key, e.g. ``p99_e2el_ms``) over the usable repeats."""
        return curves.interval([r.stat(key) for r in self.valid])

    def throughput(self, name: str) -> Interval:
        """``request_goodput`` or ``request_throughput`` over the usable repeats."""
        return curves.interval([getattr(r, name) for r in self.valid])

    @property
    def saturated(self) -> bool:
        return any(r.saturated for r in self.valid)

    @property
    def host_saturated(self) -> bool:
        return any(r.host_saturated for r in self.rows)


def _rate_key(row: SummaryRow) -> float:
    """Repeats of one point share its offered rate to three significant figures (the sweep
    places its rates so)."""
    return float(f"{row.offered_rate:.3g}")


def rate_points(sweep: schema.SweepSection, stack: str) -> list[RatePoint]:
    """One stack's sweep points grouped by offered rate, in order of rate."""
    groups: dict[float, list[SummaryRow]] = {}
    for row in sweep.stack_points(stack):
        groups.setdefault(_rate_key(row), []).append(row)
    return [RatePoint(rate, tuple(rows)) for rate, rows in sorted(groups.items())]


def sweep_stacks(sweep: schema.SweepSection) -> list[str]:
    """The sweep's stacks: zerolayer first, baseline second, the rest by name."""
    rank = {curves.ZEROLAYER: 0, curves.BASELINE: 1}
    names = {p.stack for p in sweep.points} | set(sweep.stacks)
    return sorted(names, key=lambda s: (rank.get(s, 2), s))


def sweep_slos(sweep: schema.SweepSection) -> list[metrics.Slo]:
    return [schema.from_data(metrics.Slo, d) for d in sweep.slos]


def sweep_headline(sweep: schema.SweepSection, stack: str) -> dict[str, Interval]:
    """A stack's headline figures as the sweep recorded them; computed by ``harness.curves``
    from its points where summary.json lacks them (a sweep cut short)."""
    stored = sweep.stacks.get(stack, {}).get("headline")
    if stored:
        return {name: schema.from_data(Interval, value) for name, value in stored.items()}
    return curves.headline(sweep.stack_points(stack), sweep_slos(sweep))


def sweep_added_latency(sweep: schema.SweepSection) -> curves.AddedLatency:
    """The baseline-minus-zero-layer latency as recorded; computed from the points if absent."""
    stored = sweep.added_latency
    if not stored:
        return curves.added_latency(sweep.points, sweep.added_latency_bound_ms)
    return schema.from_data(curves.AddedLatency, stored)
