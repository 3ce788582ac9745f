"""The claims check gives verdicts only from valid measurements.

Plain runs: a latency claim whose rows were flagged (loader lag, lost requests, saturation) is
"not measured (invalid inputs)". Sweeps: the latency claims are judged at the highest offered
rate at which both stacks measured themselves in every repeat, on the interval over repeats.
The sweeps below are built by hand with realistic shapes: the zero-layer stack serving up to
about 40 req/s, the baseline saturating around 16 req/s, one loader-limited point.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.report import claims
from bench.report.data import RunData
from harness.curves import Interval
from harness.schema import RunMeta, SummaryRow, SweepSection

RATES = (4.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0)
LAG = "loader lagged: p99 scheduling lag 1.900 ms > 1.0 ms"


def row(
    stack: str,
    p50: float,
    *,
    tail: tuple[float, float, float] = (1.2, 1.5, 0.2),
    rate: float = 0.0,
    repeat: int = 0,
    profile: str = "a_latency",
    invalid: Sequence[str] = (),
    loader_limited: bool = False,
    saturated: bool = False,
    host_saturated: bool = False,
    failed: int = 0,
) -> SummaryRow:
    """A summary row whose p95, p99 and std are ``tail`` multiples of its median E2EL."""
    p95, p99, std = (p50 * f for f in tail)
    return SummaryRow(
        stack=stack,
        profile=profile,
        loader="native",
        num_requests=200,
        completed=200 - failed,
        errors=failed,
        stats={
            "median_e2el_ms": p50,
            "p95_e2el_ms": p95,
            "p99_e2el_ms": p99,
            "std_e2el_ms": std,
        },
        valid=not invalid,
        invalid_reasons=list(invalid),
        loader_limited=loader_limited,
        saturated=saturated,
        saturation_reasons=["queue growing: 600 ms in the first quarter, 9000 ms in the last"]
        if saturated
        else [],
        host_saturated=host_saturated,
        host_cpu_pct=97.0 if host_saturated else 55.0,
        offered_rate=rate,
        repeat=repeat,
    )


def run_of(summaries: Sequence[SummaryRow] = (), sweep: SweepSection | None = None) -> RunData:
    return RunData(Path("/nonexistent"), RunMeta("t"), {}, list(summaries), [], [], [], [], sweep)


def sweep_of(points: Sequence[SummaryRow], repeats: int) -> SweepSection:
    return SweepSection(
        "a_latency", "laptop", "grid", [], list(RATES), repeats, points=list(points)
    )


def realistic_sweep(
    base_p50: Sequence[float], base_tail: tuple[float, float, float] = (1.2, 1.5, 0.2)
) -> SweepSection:
    """Repeat ``k`` has baseline P50 ``base_p50[k]`` ms at 8 req/s over a 600 ms zero-layer;
    the baseline saturates from 16 req/s (and loses requests from 24), the zero-layer stack
    past 40, and the loader falls off its schedule at 48 req/s on the zero-layer stack."""
    points = []
    for k, b50 in enumerate(base_p50):
        for rate in RATES:
            zl_sat = rate > 40.0
            points.append(
                row(
                    "zerolayer",
                    600.0 + rate,
                    rate=rate,
                    repeat=k,
                    saturated=zl_sat,
                    loader_limited=rate == 48.0,
                    invalid=[LAG] if rate == 48.0 else [],
                )
            )
            points.append(
                row(
                    "baseline",
                    b50 if rate <= 8.0 else 9000.0,
                    tail=base_tail,
                    rate=rate,
                    repeat=k,
                    saturated=rate >= 16.0,
                    invalid=["30 requests lost (no answer by deadline + grace)"]
                    if rate >= 24.0
                    else [],
                )
            )
    return sweep_of(points, len(base_p50))


def results(run: RunData) -> dict[str, claims.ClaimResult]:
    return {c.key: c for c in claims.evaluate(run)}


def test_invalid_baseline_rows_are_not_measured() -> None:
    """The defect: INVALID baseline rows at 10.4 s once gave "held" for the tail claim."""
    run = run_of(
        [
            row("zerolayer", 620.0),
            row("baseline", 10_400.0, tail=(3.0, 24.0, 40.0), invalid=[LAG], loader_limited=True),
        ]
    )
    got = results(run)
    for key in ("tail_latency", "layer_overhead"):
        assert got[key].status == claims.INVALID_INPUTS == "not measured (invalid inputs)"
        assert "baseline a_latency" in got[key].measured and LAG in got[key].measured
        assert "zerolayer" not in got[key].measured, "only the flagged row is named"


def test_saturated_rows_are_not_judged_for_latency() -> None:
    run = run_of([row("zerolayer", 600.0), row("baseline", 700.0, saturated=True)])
    got = results(run)
    assert got["layer_overhead"].status == claims.INVALID_INPUTS
    assert "saturated: queue growing" in got["layer_overhead"].measured
    # a busy host is noted beside the figures, not a reason to withhold the verdict
    host = run_of([row("zerolayer", 600.0), row("baseline", 700.0, host_saturated=True)])
    assert results(host)["tail_latency"].status != claims.INVALID_INPUTS


def test_valid_plain_rows_keep_their_verdict() -> None:
    got = results(run_of([row("zerolayer", 600.0), row("baseline", 700.0)]))
    overhead = got["layer_overhead"]
    assert overhead.status == claims.HELD and overhead.measured == "+100.0 ms at P50 (a_latency)"
    assert got["tail_latency"].status == claims.NOT_HELD, "equal tails: ratios of 1.17x"
    assert "from a sweep" not in overhead.rule


def test_sweep_ratios_above_threshold_hold_at_the_highest_shared_valid_rate() -> None:
    """Baseline tails far beyond half the claimed ratios in every repeat, at 8 req/s: the
    highest rate below the baseline's saturation (16) and the loader's limit (48)."""
    zl_tail = (1.2, 1.5, 0.2)
    ratio = 3.0  # p50 ratio well above 1.15x; tails scale p95/p99/std far above theirs
    base_tail = (zl_tail[0] * 6, zl_tail[1] * 12, zl_tail[2] * 25)
    sweep = realistic_sweep([608 * ratio, 608 * ratio * 1.02, 608 * ratio * 0.98], base_tail)
    tail = results(run_of(sweep=sweep))["tail_latency"]
    assert tail.status == claims.HELD, tail.measured
    assert "a_latency at 8 req/s, 3 repeats" in tail.measured
    assert "from a sweep" in tail.rule


def test_sweep_interval_spanning_the_threshold_is_inconclusive() -> None:
    """P50 deltas of 20, 60 and 100 ms: their interval spans the 40 ms threshold."""
    sweep = realistic_sweep([628.0, 668.0, 708.0])
    overhead = results(run_of(sweep=sweep))["layer_overhead"]
    assert overhead.status == claims.INCONCLUSIVE
    assert overhead.measured.startswith("+60.0 [") and "(n=3)" in overhead.measured


def test_sweep_interval_wholly_outside_is_not_held() -> None:
    sweep = realistic_sweep([610.0, 612.0, 611.0])
    overhead = results(run_of(sweep=sweep))["layer_overhead"]
    assert overhead.status == claims.NOT_HELD, overhead.measured


def test_sweep_with_only_low_rates_valid_on_both_is_judged_there() -> None:
    """The baseline saturates from 8 req/s in repeat 1 only: 8 is not shared, so 4 is judged
    even though repeat 0 measured both stacks at 8."""
    sweep = realistic_sweep([700.0, 700.0])
    points = [
        row("baseline", 9000.0, rate=8.0, repeat=1, saturated=True)
        if p.stack == "baseline" and p.repeat == 1 and p.offered_rate == 8.0
        else p
        for p in sweep.points
    ]
    overhead = results(run_of(sweep=sweep_of(points, 2)))["layer_overhead"]
    assert "a_latency at 4 req/s, 2 repeats" in overhead.measured
    assert overhead.status == claims.HELD, "700 - 604 ms = +96 ms in both repeats"


def test_sweep_with_no_shared_valid_rate_is_invalid_inputs() -> None:
    points = [
        row("zerolayer", 600.0, rate=r, repeat=0, invalid=[LAG], loader_limited=True) for r in RATES
    ] + [row("baseline", 700.0, rate=r, repeat=0) for r in RATES]
    got = results(run_of(sweep=sweep_of(points, 1)))
    for key in ("tail_latency", "layer_overhead"):
        assert got[key].status == claims.INVALID_INPUTS
        assert "(highest such rate by repeat: repeat 0 none)" in got[key].measured
        assert "at the lowest, 4 req/s: zerolayer a_latency repeat 0: INVALID: loader lagged" in (
            got[key].measured
        )


def test_sweep_without_the_baseline_is_not_measured() -> None:
    points = [row("zerolayer", 600.0, rate=r) for r in RATES]
    assert results(run_of(sweep=sweep_of(points, 1)))["layer_overhead"].status == (
        claims.NOT_MEASURED
    )


def test_fault_claim_counts_lost_requests_but_not_a_lagging_loader() -> None:
    lost = ["12 requests lost (no answer by deadline + grace)"]
    judged = run_of(
        [
            row("zerolayer", 600.0, profile="d_fault", failed=2),
            row("baseline", 700.0, profile="d_fault", failed=30, invalid=lost),
        ]
    )
    assert results(judged)["fault_errors"].status == claims.HELD
    lagged = run_of(
        [
            row("zerolayer", 600.0, profile="d_fault", failed=2),
            row("baseline", 700.0, profile="d_fault", invalid=[LAG], loader_limited=True),
        ]
    )
    fault = results(lagged)["fault_errors"]
    assert fault.status == claims.INVALID_INPUTS and "baseline d_fault" in fault.measured


def test_every_status_has_a_css_class_name() -> None:
    names = {status.css for status in claims.Status}
    assert len(names) == len(claims.Status)
    assert all(re.fullmatch(r"[a-z][a-z-]*", name) for name in names)
    assert claims.Status.INVALID_INPUTS.css == "invalid-inputs"


finite = st.floats(-1e4, 1e4, allow_nan=False)


@given(finite, finite, finite, finite)
def test_decide_is_held_only_within_and_not_held_only_wholly_outside(
    a: float, b: float, c: float, d: float
) -> None:
    low, high = sorted((a, b))
    band = claims.Band(*sorted((c, d)))
    status = claims.decide(Interval((low + high) / 2, low, high, 3), band)
    inside = [band.low <= x <= band.high for x in (low, high)]
    if all(inside):
        assert status is claims.HELD
    elif high < band.low or low > band.high:
        assert status is claims.NOT_HELD
    else:
        assert status is claims.INCONCLUSIVE


@st.composite
def sweeps(draw: st.DrawFn) -> list[SummaryRow]:
    """Random sweeps: each (stack, repeat, rate) point present or not, eligible or not."""
    repeats = draw(st.integers(1, 3))
    points = []
    for k in range(repeats):
        for rate in RATES[:4]:
            for stack in ("zerolayer", "baseline"):
                kind = draw(st.sampled_from(["ok", "ok", "saturated", "lagged", "missing"]))
                if kind == "missing":
                    continue
                p50 = draw(st.floats(100.0, 5000.0))
                points.append(
                    row(
                        stack,
                        p50,
                        rate=rate,
                        repeat=k,
                        saturated=kind == "saturated",
                        invalid=[LAG] if kind == "lagged" else [],
                        loader_limited=kind == "lagged",
                    )
                )
    return points


@settings(max_examples=60, deadline=None)
@given(sweeps(), st.randoms())
def test_sweep_verdicts_do_not_depend_on_point_order(
    points: list[SummaryRow], rnd: random.Random
) -> None:
    """The same configuration gives the same verdict: point order carries no weight."""
    shuffled = list(points)
    rnd.shuffle(shuffled)
    reps = len({p.repeat for p in points}) or 1
    first = claims.evaluate(run_of(sweep=sweep_of(points, reps)))
    second = claims.evaluate(run_of(sweep=sweep_of(shuffled, reps)))
    assert first == second


@settings(max_examples=60, deadline=None)
@given(sweeps())
def test_the_judged_rate_is_the_highest_eligible_in_every_repeat(
    points: list[SummaryRow],
) -> None:
    judged = claims.sweep_pairs(sweep_of(points, 3))
    reps = {p.repeat for p in points}

    def shared(rate: float) -> bool:
        at = {(p.stack, p.repeat): p for p in points if p.offered_rate == rate}
        return bool(reps) and all(
            (s, k) in at and claims.eligible(at[(s, k)])
            for k in reps
            for s in ("zerolayer", "baseline")
        )

    good = [r for r in RATES if shared(r)]
    if isinstance(judged, claims.Judged):
        assert judged.rate == max(good) and len(judged.pairs) == len(reps)
    else:
        assert not good
