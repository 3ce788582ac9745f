"""The claims check gives verdicts only from enough valid, paired trials.

A latency claim is decided from at least ``MIN_TRIALS`` (zero-layer, baseline) pairs whose
trials are all valid (``harness.validity``): loader on schedule, nothing lost, not saturated,
the host not saturated (mean or one core), its speed probed and steady, all measured. Otherwise
it is "undecided" with the reason. Sweeps are judged at stated fractions of the lower knee. The
sweeps below are built by hand with realistic shapes: the zero-layer stack serving up to about
40 req/s, the baseline saturating around 16 req/s, one loader-limited point.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.report import claim_inputs, claims
from bench.report.console import claims_lines
from bench.report.data import RunData
from bench.report.plots import data_notes
from bench.report.plots.claims import NO_CLAIMS, claim_trials
from harness.curves import Interval
from harness.schema import Machine, RunMeta, SummaryRow, SweepSection
from harness.validity import MIN_TRIALS, trial_problems

RATES = (4.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0)
LAG = "loader lagged: p99 scheduling lag 1.900 ms > 1.0 ms"
SPEED = 1_000_000.0


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
    host_cpu: float | None = None,
    busiest: float | None = None,
    speed: float | None = SPEED,
) -> SummaryRow:
    """A summary row whose p95, p99 and std are ``tail`` multiples of its median E2EL."""
    p95, p99, std = (p50 * f for f in tail)
    cpu = host_cpu if host_cpu is not None else (97.0 if host_saturated else 55.0)
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
        host_cpu_pct=cpu,
        host_busiest_cpu_pct=busiest if busiest is not None else cpu,
        host_speed=speed,
        offered_rate=rate,
        repeat=repeat,
    )


def run_of(summaries: Sequence[SummaryRow] = (), sweep: SweepSection | None = None) -> RunData:
    meta = RunMeta("t", machine=Machine(cpu_speed_start=SPEED))
    return RunData(Path("/nonexistent"), meta, {}, list(summaries), [], [], [], [], sweep)


def trials(stack: str, p50s: Sequence[float], **fields: object) -> list[SummaryRow]:
    """One row per repeat, repeat k with median E2EL ``p50s[k]``."""
    return [row(stack, p50, repeat=k, **fields) for k, p50 in enumerate(p50s)]  # type: ignore[arg-type]


def sweep_of(
    points: Sequence[SummaryRow], repeats: int, knees: dict[str, float] | None = None
) -> SweepSection:
    stacks = {s: {"headline": {"knee": {"value": k}}} for s, k in (knees or {}).items()}
    return SweepSection(
        "a_latency", "laptop", "grid", [], list(RATES), repeats, points=list(points), stacks=stacks
    )


def realistic_sweep(
    base_p50: Sequence[float], base_tail: tuple[float, float, float] = (1.2, 1.5, 0.2)
) -> SweepSection:
    """Repeat ``k`` has baseline P50 ``base_p50[k]`` ms at 8 req/s over a 600 ms zero-layer;
    the baseline saturates from 16 req/s (its knee, 16, sets the judged loads: 50 % and 80 %
    of it fall at 8 req/s) and loses requests from 24, the zero-layer stack past 40, and the
    loader falls off its schedule at 48 req/s on the zero-layer stack."""
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
    return sweep_of(points, len(base_p50), {"zerolayer": 44.0, "baseline": 16.0})


def results(run: RunData) -> dict[str, claims.ClaimResult]:
    return {c.key: c for c in claims.evaluate(run)}


def plain(zl: Sequence[SummaryRow], base: Sequence[SummaryRow]) -> dict[str, claims.ClaimResult]:
    return results(run_of([*zl, *base]))


def test_valid_paired_trials_give_a_verdict_with_its_interval() -> None:
    got = plain(trials("zerolayer", [600.0, 601.0, 599.0]), trials("baseline", [700.0] * 3))
    overhead = got["layer_overhead"]
    assert overhead.status == claims.HELD and overhead.trials == 3
    assert overhead.measured.startswith("+100.0 [") and "(n=3) at P50 (a_latency, 3 paired" in (
        overhead.measured
    )
    assert got["tail_latency"].status == claims.NOT_HELD, "equal tails: ratios of 1.17x"
    assert "from a sweep" not in overhead.rule and claims.VALIDITY_RULE in overhead.rule


def test_one_pair_decides_nothing() -> None:
    """The default run once gave held from a single pair: now it is undecided, and says why."""
    got = plain([row("zerolayer", 600.0)], [row("baseline", 700.0)])
    for key in ("layer_overhead", "tail_latency"):
        assert got[key].status == claims.UNDECIDED
        assert "too few valid trials: 1 of the 3 needed" in got[key].reason


def test_each_invalid_trial_is_named_in_the_undecided_reason() -> None:
    """Each undecided reason, constructed: lag, loss, saturation, a saturated host (the mean or
    one core), a host not measured, a speed not probed or moved."""
    cases = {
        "invalid: " + LAG: dict(invalid=[LAG], loader_limited=True),
        "saturated: queue growing": dict(saturated=True),
        "host saturated (CPU 97 %": dict(host_saturated=True),
        "host saturated (CPU 55 %, busiest core 100 %)": dict(busiest=100.0),
        "the host's CPU was not measured": dict(host_cpu=None, busiest=None),
        "the host's speed was not probed before the trial": dict(speed=None),
        "host speed moved -40% from the run's first probe": dict(speed=0.6 * SPEED),
    }
    for reason, fields in cases.items():
        base = trials("baseline", [700.0] * 3)
        flagged = row("baseline", 700.0, repeat=1, **fields)  # type: ignore[arg-type]
        if fields.get("host_cpu", 0) is None:
            flagged.host_cpu_pct = None
        base[1] = flagged
        got = plain(trials("zerolayer", [600.0] * 3), base)["layer_overhead"]
        assert got.status == claims.UNDECIDED, reason
        assert "too few valid trials: 2 of the 3 needed" in got.reason, got.reason
        assert f"baseline trial 1: {reason}" in got.reason, (reason, got.reason)
        assert "zerolayer trial" not in got.reason, "only the flagged trial is named"


def test_a_host_saturated_by_the_baseline_leaves_the_latency_claims_undecided() -> None:
    """The printed rule said host-saturated rows were excluded while the code kept them: the
    defect this test locks out."""
    got = plain(trials("zerolayer", [600.0] * 3), trials("baseline", [900.0] * 3, busiest=96.0))
    for key in ("layer_overhead", "tail_latency"):
        assert got[key].status == claims.UNDECIDED
        assert "0 of the 3 needed" in got[key].reason and "host saturated" in got[key].reason


def test_an_interval_across_the_threshold_is_undecided() -> None:
    """P50 deltas of 20, 60 and 100 ms: their interval spans the 40 ms threshold."""
    got = plain(trials("zerolayer", [600.0] * 3), trials("baseline", [620.0, 660.0, 700.0]))
    overhead = got["layer_overhead"]
    assert overhead.status == claims.UNDECIDED and overhead.reason == claims.SPANS
    assert overhead.figures["p50_delta_ms"].n == 3


def test_sweep_ratios_above_threshold_hold_at_the_stated_loads() -> None:
    """Baseline tails far beyond half the claimed ratios in every repeat, at 8 req/s: 50 % and
    80 % of the baseline's knee (16 req/s) both fall on the 8 req/s points."""
    zl_tail = (1.2, 1.5, 0.2)
    ratio = 3.0
    base_tail = (zl_tail[0] * 6, zl_tail[1] * 12, zl_tail[2] * 25)
    sweep = realistic_sweep([608 * ratio, 608 * ratio * 1.02, 608 * ratio * 0.98], base_tail)
    tail = results(run_of(sweep=sweep))["tail_latency"]
    assert tail.status == claims.HELD, tail.measured
    assert "a_latency at 8 req/s (50% of baseline's knee 16 req/s), 3 paired trials" in (
        tail.measured
    )
    assert "(80% of baseline's knee 16 req/s)" in tail.measured


def test_sweep_interval_wholly_outside_is_not_held() -> None:
    sweep = realistic_sweep([610.0, 612.0, 611.0])
    overhead = results(run_of(sweep=sweep))["layer_overhead"]
    assert overhead.status == claims.NOT_HELD, overhead.measured


def test_a_sweep_with_too_few_repeats_is_undecided() -> None:
    overhead = results(run_of(sweep=realistic_sweep([700.0, 700.0])))["layer_overhead"]
    assert overhead.status == claims.UNDECIDED
    assert "at 8 req/s (50% of baseline's knee 16 req/s): too few valid trials: 2" in (
        overhead.reason
    )


def test_a_sweep_without_a_knee_is_judged_at_fractions_of_its_highest_rate() -> None:
    points = [row(s, p, rate=r, repeat=k) for k in range(3) for r in RATES
              for s, p in (("zerolayer", 600.0), ("baseline", 700.0))]  # fmt: skip
    overhead = results(run_of(sweep=sweep_of(points, 3)))["layer_overhead"]
    assert overhead.status == claims.HELD
    assert "at 24 req/s (50% of the highest rate swept, 48 req/s (no knee reached))" in (
        overhead.measured
    )


def test_sweep_without_the_baseline_is_not_measured() -> None:
    points = [row("zerolayer", 600.0, rate=r) for r in RATES]
    assert results(run_of(sweep=sweep_of(points, 1)))["layer_overhead"].status == (
        claims.NOT_MEASURED
    )


def test_a_claim_measured_once_per_stack_is_undecided_but_shows_its_reading() -> None:
    got = claims.common.once("k", "c", "x", "2 vs 30", held=True, rule="r")
    assert got.status == claims.UNDECIDED and got.measured == "2 vs 30"
    assert got.reason == f"{claims.ONE_SAMPLE} (it would read held)"


def test_claims_json_round_trips(tmp_path: Path) -> None:
    got = claims.evaluate(
        run_of([*trials("zerolayer", [600.0, 601.0, 602.0]), *trials("baseline", [700.0] * 3)])
    )
    claims.write(tmp_path, got)
    back = claims.read(tmp_path)
    assert back is not None and back.claims == got
    assert back.validity_rule == claims.VALIDITY_RULE
    held = next(c for c in back.claims if c.key == "layer_overhead")
    assert held.bands == {"p50_delta_ms": claims.Band(40.0, 300.0)}
    assert held.figures["p50_delta_ms"].per_repeat == (100.0, 99.0, 98.0)
    assert claims.read(tmp_path / "absent") is None


def test_the_claims_figure_shows_each_trial_beside_its_interval(tmp_path: Path) -> None:
    """The report's claim_trials figure is drawn from claims.json: a point per trial, the
    interval it was decided on, the held band; a run without the file says so."""
    run = dataclasses.replace(
        run_of([*trials("zerolayer", [600.0, 601.0, 602.0, 603.0]),
                *trials("baseline", [700.0] * 4)]),
        path=tmp_path,
    )  # fmt: skip
    assert data_notes(claim_trials(run)) == [NO_CLAIMS]
    decided = claims.evaluate(run)
    claims.write(tmp_path, decided)
    fig = claim_trials(run)
    overhead = next(ax for ax in fig.axes if ax.get_title().startswith("layer_overhead"))
    points = overhead.collections[0].get_offsets()[:, 1]
    assert sorted(points) == [97.0, 98.0, 99.0, 100.0]
    assert "held" in overhead.get_title()
    band = next(p for p in overhead.patches if p.get_label().startswith("held: 40 to 300"))
    assert band is not None
    tails = [ax for ax in fig.axes if ax.get_title().startswith("tail_latency")]
    assert len(tails) == len(claims.TAIL_KEYS)


def test_every_status_has_a_css_class_name() -> None:
    names = {status.css for status in claims.Status}
    assert len(names) == len(claims.Status)
    assert all(re.fullmatch(r"[a-z][a-z-]*", name) for name in names)
    assert claims.Status.NOT_MEASURED.css == "not-measured"


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
        assert status is claims.UNDECIDED


KINDS = ["ok", "ok", "ok", "saturated", "lagged", "host", "missing"]


@st.composite
def sweeps(draw: st.DrawFn) -> list[SummaryRow]:
    """Random sweeps: each (stack, repeat, rate) point present or not, valid or not."""
    repeats = draw(st.integers(1, 4))
    points = []
    for k in range(repeats):
        for rate in RATES[:4]:
            for stack in ("zerolayer", "baseline"):
                kind = draw(st.sampled_from(KINDS))
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
                        busiest=99.0 if kind == "host" else None,
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


@settings(max_examples=80, deadline=None)
@given(sweeps())
def test_a_verdict_needs_enough_valid_pairs_at_every_judged_load(points: list[SummaryRow]) -> None:
    """Held or not held only where each stated load's rate has MIN_TRIALS repeats with both
    stacks' trials valid."""
    sweep = sweep_of(points, 4, {"baseline": 40.0})
    overhead = results(run_of(sweep=sweep))["layer_overhead"]
    if overhead.status not in (claims.HELD, claims.NOT_HELD):
        return
    for inputs in claim_inputs.sweep_inputs(sweep, SPEED):
        if isinstance(inputs, claim_inputs.Unjudged):
            assert overhead.status is claims.NOT_HELD, "a part not held decides alone"
            continue
        at = {(p.stack, p.repeat): p for p in points if p.offered_rate == inputs.rate}
        good = [k for k in range(4)
                if all((s, k) in at and not trial_problems(at[(s, k)], SPEED)
                       for s in ("zerolayer", "baseline"))]  # fmt: skip
        assert len(good) >= MIN_TRIALS and len(inputs.pairs) == len(good)


def test_the_console_prints_each_verdict_and_why_it_is_undecided() -> None:
    """The run's end prints the claims as claims.json holds them, each undecided one with why."""
    decided = claims.evaluate(run_of(trials("zerolayer", [600.0]) + trials("baseline", [700.0])))
    lines = claims_lines(decided)
    overhead = next(i for i, line in enumerate(lines) if "layer_overhead" in line)
    assert "undecided" in lines[overhead]
    assert "why: a_latency: too few valid trials: 1 of the 3 needed" in lines[overhead + 1]
    assert len([line for line in lines if line.startswith("  ") and "why:" not in line]) == len(
        claims.CLAIMS
    )
