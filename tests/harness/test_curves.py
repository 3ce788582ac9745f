"""The load-curve figures (harness.curves): intervals, crossings, bisection, headline figures."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from harness import curves, schema
from harness.metrics import Slo
from harness.schema import SummaryRow

SLOS = (Slo("ttft", 99, 500), Slo("e2el", 99, 2000))


def point(stack: str, rate: float, repeat: int = 0, **fields: object) -> SummaryRow:
    """A sweep point whose p99 TTFT grows with the rate (100 ms per req/s)."""
    ttft = float(fields.pop("ttft", 100.0 * rate))  # type: ignore[arg-type]
    row = SummaryRow(stack, "a_latency", "native", offered_rate=rate, repeat=repeat)
    row.stats = {"p99_ttft_ms": ttft, "p99_e2el_ms": 1000.0, "median_e2el_ms": 600.0}
    row.request_goodput = float(fields.pop("goodput", rate))  # type: ignore[arg-type]
    for key, value in fields.items():
        setattr(row, key, value)
    load = curves.slo_load(row, SLOS)
    row.slo_met = load is not None and load <= 1.0
    return row


@given(st.lists(st.floats(0.1, 1000.0), min_size=2, max_size=12))
def test_the_interval_is_scipys_student_t(values: list[float]) -> None:
    got = curves.interval(values)
    assert got.value == pytest.approx(np.mean(values))
    if sps.sem(values) > 0:
        low, high = sps.t.interval(0.95, len(values) - 1, np.mean(values), sps.sem(values))
        assert got.low == pytest.approx(low, abs=1e-9, rel=1e-9)
        assert got.high == pytest.approx(high, abs=1e-9, rel=1e-9)
    assert got.n == len(values)


def test_one_repeat_gives_a_value_and_no_interval_and_missing_ones_say_why() -> None:
    one = curves.interval([4.0])
    assert (one.value, one.low, one.high, one.n) == (4.0, 4.0, 4.0, 1)
    assert "(n=1)" in one.text() and "[" not in one.text()
    none = curves.interval([None, None], "beyond the rates swept")
    assert none.value is None and none.text() == "beyond the rates swept"
    part = curves.interval([3.0, None], "beyond")
    assert part.value == 3.0 and part.note == "beyond" and part.n == 1


def test_the_knee_is_interpolated_where_the_worst_slo_crosses_its_bound() -> None:
    # p99 TTFT = 100 ms per req/s: it reaches its 500 ms bound at exactly 5 req/s.
    points = [point("zerolayer", r) for r in (1, 2, 4, 8)]
    knee = curves.knee(points, SLOS)
    assert knee.value == pytest.approx(5.0)
    within = curves.highest_within(points, SLOS)
    assert within.value == 4


def test_a_knee_outside_the_rates_says_so() -> None:
    low = curves.knee([point("zerolayer", r) for r in (1, 2, 3)], SLOS)
    assert low.value is None and "not reached" in low.note
    high = curves.knee([point("zerolayer", r) for r in (6, 8)], SLOS)
    assert high.value is None and "below the lowest" in high.note


def test_loader_limited_points_take_no_part() -> None:
    points = [point("zerolayer", 1), point("zerolayer", 2)]
    points.append(point("zerolayer", 3, goodput=99.0, loader_limited=True))
    assert curves.max_goodput(points).value == 2.0


def test_max_goodput_and_knee_come_with_an_interval_over_repeats() -> None:
    points = [
        point("zerolayer", r, repeat=k, ttft=100.0 * r * (1 + 0.1 * k), goodput=r * (1 - 0.05 * k))
        for k in range(3)
        for r in (2, 4, 8)
    ]
    best = curves.max_goodput(points)
    assert best.n == 3 and best.per_repeat == pytest.approx((8.0, 7.6, 7.2))
    assert best.low < best.value < best.high
    knee = curves.knee(points, SLOS)
    assert knee.n == 3 and knee.low < knee.value < knee.high


def test_the_added_latency_rate_is_where_the_medians_part_by_the_bound() -> None:
    points = []
    for r in (1, 2, 4, 8):
        points.append(point("zerolayer", r))
        base = point("baseline", r)
        base.stats = {**base.stats, "median_e2el_ms": 600.0 + 10.0 * r}
        points.append(base)
    added = curves.added_latency(points, bound_ms=50.0)
    assert added.rate.value == pytest.approx(5.0)  # 10 ms per req/s reaches 50 ms at 5 req/s
    assert [d.rate for d in added.by_rate] == [1, 2, 4, 8]
    assert added.by_rate[-1].p50_ms.value == pytest.approx(80.0)


@given(
    edge=st.floats(1.0, 500.0),
    low=st.floats(0.5, 50.0),
    span=st.floats(1.5, 20.0),
    resolution=st.sampled_from([0.05, 0.1, 0.2]),
)
def test_bisection_brackets_the_edge_within_its_resolution(
    edge: float, low: float, span: float, resolution: float
) -> None:
    found = curves.bisect_rate(lambda rate: rate <= edge, low, low * span, resolution, 40)
    assert found.low is not None and found.high is not None
    assert found.low <= edge < found.high
    # rates are kept to three significant figures, so the bracket can be a rounding wider
    assert found.high / found.low <= (1 + resolution) * 1.01


def test_bisection_says_when_no_rate_or_every_rate_held() -> None:
    assert curves.bisect_rate(lambda rate: False, 10, 20, 0.1).low is None
    every = curves.bisect_rate(lambda rate: True, 10, 20, 0.1)
    assert every.high is None and every.low is not None and every.low >= 20


@given(st.floats(0.01, 100.0), st.floats(1.0, 1000.0), st.integers(1, 16))
def test_geometric_rates_span_the_range_in_order(low: float, factor: float, count: int) -> None:
    rates = curves.geometric_rates(low, low * factor, count)
    assert rates == sorted(rates) and len(rates) <= count
    assert rates[0] == pytest.approx(low, rel=0.01)
    if count > 1:
        assert rates[-1] == pytest.approx(low * factor, rel=0.01)


def test_a_rates_interval_never_goes_below_zero() -> None:
    wide = curves.interval([0.5, 12.0], floor=0.0)
    assert wide.low == 0.0 and wide.high is not None and wide.high > 12.0
    assert curves.interval([0.5, 12.0]).low is not None and curves.interval([0.5, 12.0]).low < 0


def test_the_added_latency_round_trips_through_its_dict() -> None:
    points = [point("zerolayer", 2), point("baseline", 2), point("zerolayer", 4)]
    added = curves.added_latency(points, bound_ms=50.0)
    assert schema.from_data(curves.AddedLatency, schema.to_data(added)) == added


def test_the_added_latency_says_when_no_rate_ran_on_both_stacks() -> None:
    added = curves.added_latency([point("zerolayer", 2), point("zerolayer", 4)], bound_ms=50.0)
    assert added.rate.value is None and added.rate.note == "no rate run on both stacks"
