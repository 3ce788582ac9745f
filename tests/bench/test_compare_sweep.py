"""``zl-bench compare`` on two sweeps: headline figures judged with their intervals over repeats,
points listed at the offered rates both sweeps ran, and a sweep never compared with a plain run.

The run directories are built by hand from a simple saturating stack: latency flat below its
capacity and climbing past it, goodput following the offered rate up to capacity and falling past
it, three repeats with a little spread each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.cli import main as cli_main
from bench.report import compare, compare_sweep, load_run
from bench.report.compare_sweep import Flag, Span
from harness import curves, schema
from harness.metrics import Slo

PROFILE = "a_latency"
SLOS = (Slo("ttft", 99, 500.0), Slo("e2el", 99, 4000.0))
RATES = (4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 40.0, 48.0)
BOUND_MS = 50.0


@dataclass(frozen=True)
class Sweep:
    """What a hand-built sweep ran: capacities per stack, where the loader lagged, the SLOs."""

    capacity: dict[str, float] = field(
        default_factory=lambda: {"zerolayer": 40.0, "baseline": 16.0}
    )
    rates: tuple[float, ...] = RATES
    repeats: int = 3
    loader_limited: frozenset[tuple[str, float]] = frozenset({("zerolayer", 48.0)})
    slos: tuple[Slo, ...] = SLOS
    max_num_seqs: int = 64


def _point(
    stack: str, rate: float, repeat: int, capacity: float, limited: bool
) -> schema.SummaryRow:
    """One point of a stack that serves ``capacity`` req/s; the baseline adds a layer's cost."""
    load = rate / capacity
    jitter = 1.0 + 0.01 * (repeat - 1)
    past = max(0.0, load - 1.0)
    layer = 5.0 + 20.0 * load if stack == "baseline" else 0.0
    stats: dict[str, float | None] = {
        "median_ttft_ms": (50.0 + 100.0 * load + 1500.0 * past) * jitter + layer,
        "p99_ttft_ms": (100.0 + 300.0 * load + 3000.0 * past) * jitter + layer,
        "median_e2el_ms": (1000.0 + 100.0 * load + 8000.0 * past) * jitter + layer,
        "p99_e2el_ms": (1500.0 + 1500.0 * load + 12000.0 * past) * jitter + layer,
    }
    served = min(rate, capacity) * jitter
    row = schema.SummaryRow(
        stack=stack,
        profile=PROFILE,
        loader="native",
        request_throughput=served,
        offered_rate=rate,
        repeat=repeat,
        stats=stats,
        loader_limited=limited,
        slos_ms={s.name: s.bound_ms for s in SLOS},
    )
    row.slo_met = (curves.slo_load(row, SLOS) or 0.0) <= 1.0
    row.request_goodput = served if row.slo_met else served * max(0.0, 2.0 - load)
    row.saturated = load > 1.0
    return row


def _section(spec: Sweep) -> schema.SweepSection:
    points = [
        _point(stack, rate, k, cap, (stack, rate) in spec.loader_limited)
        for stack, cap in spec.capacity.items()
        for rate in spec.rates
        for k in range(spec.repeats)
    ]
    for i, p in enumerate(points):
        p.point = i
        p.records_file = schema.point_file(p.stack, PROFILE, p.offered_rate, p.repeat)
    stacks = {
        stack: {
            "stopped": "",
            "headline": schema.to_data(
                curves.headline([p for p in points if p.stack == stack], spec.slos)
            ),
        }
        for stack in spec.capacity
    }
    return schema.SweepSection(
        profile=PROFILE,
        scale="smoke",
        mode="grid",
        slos=schema.to_data(list(spec.slos)),
        rates=list(spec.rates),
        repeats=spec.repeats,
        added_latency_bound_ms=BOUND_MS,
        capacity_rps=spec.capacity.get("zerolayer"),
        points=points,
        stacks=stacks,
        added_latency=schema.to_data(curves.added_latency(points, BOUND_MS)),
    )


def _meta(path: Path, max_num_seqs: int) -> None:
    path.mkdir(parents=True)
    meta = schema.RunMeta(
        run_id=path.name,
        scale="smoke",
        config={"seed": 1, "loader": "native"},
        engine="sim",
        engine_options={"max_num_seqs": max_num_seqs},
        end=schema.RunEnd.COMPLETE,
        profiles={PROFILE: {"seed": 7}},
    )
    schema.write_run_meta(path, meta)


def sweep_run(path: Path, spec: Sweep | None = None) -> Path:
    """A sweep run's directory: run.json and summary.json with rows empty and a sweep section."""
    spec = spec or Sweep()
    _meta(path, spec.max_num_seqs)
    schema.write_summary(path, [], _section(spec))
    return path


def plain_run(path: Path) -> Path:
    """A plain run's directory: one summary row, no sweep."""
    _meta(path, 64)
    schema.write_summary(path, [_point("zerolayer", 8.0, 0, 40.0, False)])
    return path


STARVED = Sweep(capacity={"zerolayer": 20.0, "baseline": 16.0}, max_num_seqs=8)


def _flagged(out: str) -> list[str]:
    return [line for line in out.splitlines() if "REGRESSION" in line]


def test_lower_max_goodput_in_b_is_flagged_and_exit_is_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = sweep_run(tmp_path / "a")
    b = sweep_run(tmp_path / "b", STARVED)
    assert cli_main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    flagged = _flagged(out)
    assert any(line.startswith("zerolayer") and "max_goodput" in line for line in flagged)
    assert any(line.startswith("zerolayer") and " knee " in line for line in flagged)
    assert not any(line.startswith("baseline") for line in flagged), "its capacity is the same"
    assert "differs: engine option max_num_seqs: A 64, B 8" in out
    assert "3 regression(s) flagged" in out
    result = compare.compare_runs(load_run(a), load_run(b))
    assert result.verdict is compare.Verdict.REGRESSION and result.sweep is not None
    row = next(h for h in result.sweep.headline if (h.stack, h.figure) == ("zerolayer", "knee"))
    assert row.a is not None and row.a.value is None and row.a.low == 40.0, (
        "A's knee lies past the highest valid rate (48 was loader-limited)"
    )


def test_a_higher_max_goodput_in_b_is_not_flagged(tmp_path: Path) -> None:
    a = sweep_run(tmp_path / "a", STARVED)
    b = sweep_run(tmp_path / "b")
    assert compare.main(a, b) == 0


def test_equal_sweeps_exit_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = sweep_run(tmp_path / "a")
    b = sweep_run(tmp_path / "b")
    assert cli_main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "no regression flagged" in out and not _flagged(out)
    result = compare.compare_runs(load_run(a), load_run(b))
    assert result.sweep is not None
    assert {h.flag for h in result.sweep.headline} == {Flag.SAME}
    assert all(p.diff == 0 for p in result.sweep.points if not p.invalid)


@pytest.mark.parametrize("sweep_first", [True, False])
def test_a_sweep_against_a_plain_run_is_incomparable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sweep_first: bool
) -> None:
    sweep, plain = sweep_run(tmp_path / "sweep"), plain_run(tmp_path / "plain")
    a, b = (sweep, plain) if sweep_first else (plain, sweep)
    for extra in ([], ["--force"]):
        assert cli_main(["compare", str(a), str(b), *extra]) == 2
        lines = capsys.readouterr().out.splitlines()
        kinds = ("a sweep of a_latency", "a plain run")
        first, second = kinds if sweep_first else kinds[::-1]
        assert lines == [f"incomparable: A is {first}, B is {second}: compare a sweep with a sweep"]


def test_sweeps_sharing_no_rate_compare_headline_figures_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = sweep_run(tmp_path / "a")
    shifted = tuple(round(r * 1.1, 3) for r in RATES)
    b = sweep_run(
        tmp_path / "b",
        Sweep(rates=shifted, loader_limited=frozenset({("zerolayer", shifted[-1])})),
    )
    assert cli_main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "the sweeps share no offered rate" in out and "headline figures compared only" in out
    assert "points at the offered rates" not in out
    result = compare.compare_runs(load_run(a), load_run(b))
    assert result.sweep is not None and not result.sweep.points
    assert result.sweep.measured and "differs: rates" in out


def test_loader_limited_points_are_listed_as_invalid_not_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = sweep_run(tmp_path / "a")
    b = sweep_run(
        tmp_path / "b", Sweep(loader_limited=frozenset({("zerolayer", 48.0), ("baseline", 4.0)}))
    )
    compare.main(a, b)
    out = capsys.readouterr().out
    rows = [line.split(maxsplit=3) for line in out.splitlines()]
    invalid = "invalid, not compared: loader-limited in"
    everyone = "repeat 0, 1, 2"
    assert ["zerolayer", "48", "-", f"{invalid} A ({everyone}) and B ({everyone})"] in rows
    assert ["baseline", "4", "-", f"{invalid} B ({everyone})"] in rows
    assert "note: run B baseline: loader-limited at 4 req/s; left out of its figures" in out
    result = compare.compare_runs(load_run(a), load_run(b))
    assert result.sweep is not None
    at_eight = [p for p in result.sweep.points if p.stack == "baseline" and p.rate == 8.0]
    assert [p.metric for p in at_eight] == [m.key for m in compare_sweep.POINT_METRICS]


def test_different_slos_are_refused_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = sweep_run(tmp_path / "a")
    b = sweep_run(tmp_path / "b", Sweep(slos=(Slo("ttft", 99, 250.0), SLOS[1])))
    assert cli_main(["compare", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert "incomparable: SLOs differ: A TTFT p99 <= 500 ms" in out and "--force" in out
    assert cli_main(["compare", str(a), str(b), "--force"]) in (0, 1)
    assert "headline figures" in capsys.readouterr().out


def test_the_json_form_carries_the_sweep(tmp_path: Path) -> None:
    a = sweep_run(tmp_path / "a")
    b = sweep_run(tmp_path / "b", STARVED)
    out_json = tmp_path / "verdict.json"
    assert compare.main(a, b, json_path=out_json) == 1
    verdict = orjson.loads(out_json.read_bytes())
    assert verdict["exit_status"] == 1 and verdict["regressions"] == 3
    assert verdict["differences"] == [
        "engine option max_num_seqs: A 64, B 8",
        "capacity preflight (req/s): A 40.0, B 20.0",
    ]
    flagged = {
        (h["stack"], h["figure"]) for h in verdict["sweep"]["headline"] if h["flag"] == "regression"
    }
    assert flagged == {
        ("zerolayer", "max_goodput"),
        ("zerolayer", "knee"),
        ("zerolayer", "highest_within_slos"),
    }
    assert verdict["sweep"]["shared_rates"] == list(RATES)


def test_the_added_latency_rate_is_compared_but_does_not_gate(tmp_path: Path) -> None:
    a = sweep_run(tmp_path / "a")
    b = sweep_run(tmp_path / "b", Sweep(capacity={"zerolayer": 40.0, "baseline": 8.0}))
    result = compare.compare_runs(load_run(a), load_run(b))
    assert result.sweep is not None
    added = next(h for h in result.sweep.headline if h.figure == compare_sweep.ADDED_LATENCY_RATE)
    assert added.flag is Flag.SHIFTED and added.why.startswith("B ")
    baseline = {h.figure: h.flag for h in result.sweep.headline if h.stack == "baseline"}
    assert baseline["max_goodput"] is Flag.REGRESSION


def _span(value: float, half: float, n: int) -> Span:
    return Span(value - half, value + half, value, n, f"{value:g}")


def test_overlapping_intervals_are_not_a_regression() -> None:
    a = _span(40.0, 2.0, 3)
    assert compare_sweep.judge(a, _span(35.0, 6.0, 3), 0.10)[0] is Flag.SAME, "intervals overlap"
    assert compare_sweep.judge(a, _span(30.0, 1.0, 3), 0.10)[0] is Flag.REGRESSION
    assert compare_sweep.judge(a, _span(37.0, 0.5, 3), 0.10)[0] is Flag.SAME, (
        "apart but within 10 %"
    )
    one = _span(40.0, 0.0, 1)
    assert compare_sweep.judge(one, _span(35.0, 0.0, 1), 0.10)[0] is Flag.REGRESSION
    assert compare_sweep.judge(one, _span(37.0, 0.0, 1), 0.10)[0] is Flag.SAME
    assert compare_sweep.judge(one, None, 0.10) == (Flag.UNMEASURED, "not measured in B")


spans = st.builds(
    _span,
    st.floats(0.0, 1e4, allow_nan=False),
    st.floats(0.0, 1e3, allow_nan=False),
    st.integers(1, 5),
)


@given(spans, spans, st.floats(0.0, 1.0))
def test_judge_never_flags_both_ways(a: Span, b: Span, threshold: float) -> None:
    assert compare_sweep.judge(a, a, threshold)[0] is Flag.SAME
    flags = {compare_sweep.judge(a, b, threshold)[0], compare_sweep.judge(b, a, threshold)[0]}
    assert flags != {Flag.REGRESSION}, "one side lies below the other, not both"


@given(spans, spans, st.floats(0.0, 1e3, allow_nan=False), st.floats(0.0, 1.0))
def test_raising_b_never_makes_a_regression(
    a: Span, b: Span, rise: float, threshold: float
) -> None:
    raised = Span(b.low + rise, b.high + rise, (b.value or 0.0) + rise, b.n, b.text)
    if compare_sweep.judge(a, b, threshold)[0] is Flag.SAME:
        assert compare_sweep.judge(a, raised, threshold)[0] is Flag.SAME


def test_headline_figures_missing_from_the_file_are_computed_from_the_points(
    tmp_path: Path,
) -> None:
    a = sweep_run(tmp_path / "a")
    b = sweep_run(tmp_path / "b", STARVED)
    for run in (a, b):
        sweep = schema.read_sweep(run)
        assert sweep is not None
        sweep.stacks = {}
        schema.write_summary(run, [], sweep)
    result = compare.compare_runs(load_run(a), load_run(b))
    assert result.sweep is not None
    assert {(h.stack, h.figure) for h in result.sweep.regressions} == {
        ("zerolayer", "max_goodput"),
        ("zerolayer", "knee"),
        ("zerolayer", "highest_within_slos"),
    }


def test_a_sweep_whose_every_point_lagged_measures_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = sweep_run(tmp_path / "a")
    everything = frozenset((stack, rate) for stack in ("zerolayer", "baseline") for rate in RATES)
    b = sweep_run(tmp_path / "b", Sweep(loader_limited=everything))
    assert compare.main(a, b) == 2
    out = capsys.readouterr().out
    assert "nothing to compare: no headline figure was measured in both sweeps" in out
    assert "not measured in B" in out
