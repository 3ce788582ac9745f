"""``zl-bench sweep``: its rules (grid, stop, held) and real sweeps on the stacks."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench import sweep
from harness import schema
from harness.capacity import Capacity
from harness.profile import load_profile
from harness.schema import SummaryRow

SWEEP = [sys.executable, "-m", "bench.cli", "sweep", "--quiet"]
SWEEP_LIMIT_S = 900
"""A hang guard for one sweep command (each takes 1-2 minutes on a quiet 2-core host), within the
timeout each such test is given below."""


def row(rate: float, **fields: object) -> SummaryRow:
    out = SummaryRow("zerolayer", "a_latency", "native", offered_rate=rate)
    for key, value in fields.items():
        setattr(out, key, value)
    return out


def test_the_default_grid_runs_from_below_the_profiles_rate_to_past_capacity() -> None:
    a = load_profile("a", "laptop")
    capacity = Capacity("sim", 2, 200.0, 25600.0, 256, 580.0, a.rate, a.rate / 200.0, ())
    rates = sweep.default_rates(a, capacity)
    assert rates[0] == pytest.approx(min(0.1 * 200.0, a.rate / 2), rel=0.01)
    assert rates[-1] == pytest.approx(1.5 * 200.0, rel=0.01)
    steps = [b / a for a, b in itertools.pairwise(rates)]
    assert all(1.2 < s <= sweep.GRID_STEP * 1.01 for s in steps)
    unknown = Capacity.unknown("vllm", 1, a.rate, "no model")
    rates = sweep.default_rates(a, unknown)
    assert rates[0] == pytest.approx(a.rate / 2) and rates[-1] == pytest.approx(8 * a.rate)
    # a span wider than MAX_POINTS steps of GRID_STEP keeps MAX_POINTS rates, spaced wider
    wide = sweep.default_rates(replace(a, rate=0.01), capacity)
    assert len(wide) == sweep.MAX_POINTS and wide[-1] == pytest.approx(300.0, rel=0.01)


def test_a_stack_stops_past_saturation_or_when_its_loader_lags() -> None:
    assert sweep.stop_reason([row(4), row(4)]) == ""
    lagged = row(8, loader_limited=True, invalid_reasons=["loader lagged: p99 2 ms"])
    assert "loader could not keep up at 8" in sweep.stop_reason([lagged, lagged, row(8)])
    assert sweep.stop_reason([lagged, row(8)]) == ""  # half is not most
    full = row(16, saturated=True, saturation_reasons=["queue growing"])
    assert "past saturation at 16 req/s: queue growing" in sweep.stop_reason([full])


def test_a_stack_stops_once_its_goodput_has_collapsed_under_the_slos() -> None:
    rising = [row(r, slo_met=True, request_goodput=r) for r in (2, 4, 8)]
    assert sweep.collapsed(rising) == ""
    one_miss = [*rising, row(16, slo_met=False, request_goodput=3.0)]
    assert sweep.collapsed(one_miss) == ""
    two = [*one_miss, row(24, slo_met=False, request_goodput=3.0)]
    assert "past its peak at 24 req/s" in sweep.collapsed(two)
    holding = [*one_miss, row(24, slo_met=False, request_goodput=6.0)]
    assert sweep.collapsed(holding) == ""


def test_the_rates_run_on_a_saturated_host_are_named() -> None:
    points = [row(4), row(4), row(8, host_saturated=True), row(8, host_saturated=True), row(8)]
    assert sweep.host_saturated_rates(points) == [8]
    assert sweep.host_saturated_rates([row(4, host_saturated=True), row(4)]) == []


def test_a_rate_holds_when_most_repeats_met_the_slos_unsaturated_and_measured() -> None:
    assert sweep.meets([row(4, slo_met=True), row(4, slo_met=True), row(4, slo_met=False)])
    assert not sweep.meets([row(4, slo_met=True), row(4, slo_met=False)])
    assert not sweep.meets([row(4, slo_met=True, saturated=True)])
    assert not sweep.meets([row(4, slo_met=True, loader_limited=True)])


def _run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if (p / schema.RUN_META).exists()]
    return run


@pytest.mark.timeout(SWEEP_LIMIT_S + 60)
def test_a_loader_pushed_past_its_own_capacity_marks_its_points_invalid(tmp_path: Path) -> None:
    """The null engine answers at once, so the loader is what limits: 200,000 req/s (5 us per
    request, under what one Python process spends sending one over h2 on any machine: 20,000 req/s
    was kept to on a faster CI host) is beyond it. That point is the loader's, flagged so, and the
    sweep stops."""
    proc = subprocess.run(
        [
            *SWEEP,
            *("--scale", "smoke", "--stacks", "zerolayer", "--engine", "null", "--replicas", "1"),
            *("--rates", "200000", "--point-duration-s", "0.02", "--repeats", "1"),
            *("--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=SWEEP_LIMIT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = schema.read_sweep(_run_dir(tmp_path))
    assert section is not None
    (point,) = section.points
    assert point.loader_limited and not point.valid
    assert any("loader lagged" in r for r in point.invalid_reasons)
    assert "loader could not keep up" in section.stacks["zerolayer"]["stopped"]
    assert "INVALID (loader lagged)" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(SWEEP_LIMIT_S + 60)
def test_a_smoke_sweep_runs_every_rate_and_repeat_on_both_stacks(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*SWEEP, "--scale", "smoke", "--rates", "2,4", "--repeats", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=SWEEP_LIMIT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = _run_dir(tmp_path)
    assert schema.read_run_meta(run).complete
    section = schema.read_sweep(run)
    assert section is not None and section.repeats == 2 and section.mode == "grid"
    assert schema.read_summary(run) == []
    for stack in ("zerolayer", "baseline"):
        points = section.stack_points(stack)
        done = {(p.repeat, round(p.offered_rate)) for p in points}
        stopped = section.stacks[stack]["stopped"]
        assert done == {(k, r) for k in (0, 1) for r in (2, 4)} or stopped, (stack, done)
        for p in points:
            records = schema.read_requests(run / p.records_file)
            assert len(records) == p.num_requests > 0
            assert p.host_cpu_pct is not None and 0 <= p.host_cpu_pct <= 100
            assert p.slos_ms == {"ttft": 500, "e2el": 2000}
        assert set(section.stacks[stack]["headline"]) == {
            "max_goodput",
            "knee",
            "highest_within_slos",
        }
    # same seeded schedule on both stacks at each rate and repeat (records are written in the
    # order requests end, so the sets are compared), the stacks in a balanced order
    zl, base = section.stack_points("zerolayer"), section.stack_points("baseline")
    for a, b in zip(zl, base, strict=False):
        ids_a = sorted(r.request_id for r in schema.read_requests(run / a.records_file))
        ids_b = sorted(r.request_id for r in schema.read_requests(run / b.records_file))
        assert (a.offered_rate, a.repeat) == (b.offered_rate, b.repeat) and ids_a == ids_b
    order = [p.stack for p in section.points]
    assert order[:4] == ["zerolayer", "baseline", "baseline", "zerolayer"], order
    assert "max goodput" in proc.stdout and (run / schema.REPORT).exists()


@pytest.mark.timeout(SWEEP_LIMIT_S + 60)
def test_an_adaptive_sweep_brackets_the_highest_rate_within_the_slos(tmp_path: Path) -> None:
    """Bisection on the sim engine with one replica allowed 2 sequences (about 3 req/s of A):
    the bracket it reports holds one rate that met the SLOs and one that did not."""
    proc = subprocess.run(
        [
            *SWEEP,
            *("--scale", "smoke", "--stacks", "zerolayer", "--replicas", "1", "--adaptive"),
            *("--engine-option", "max_num_seqs=2", "--rates", "1,16", "--resolution", "0.3"),
            *("--point-duration-s", "3", "--repeats", "1", "--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=SWEEP_LIMIT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = schema.read_sweep(_run_dir(tmp_path))
    assert section is not None and section.mode == "adaptive" and section.resolution == 0.3
    stopped = section.stacks["zerolayer"]["stopped"]
    assert stopped.startswith("bisection:"), stopped
    held = {p.offered_rate: sweep.meets([p]) for p in section.points}
    low, high = (float(x) for x in re.findall(r"([\d.]+) req/s met the SLOs, ([\d.]+)", stopped)[0])
    assert held[low] and not held[high] and high / low <= 1.3 * 1.01
