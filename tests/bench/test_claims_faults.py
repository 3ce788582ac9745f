"""The chaos claims (``bench.report.claims.faults``) from profile D's rows, built by hand: held,
not held, and every reason they stay undecided; each rule shown able to fail.

The rows are what ``chaos.runner`` writes to ``chaos/recovery.json``: one per experiment, stack
and trial, with its errors and retries in the fault's window against the steady state, and for
KV pressure its refusal figures. Figures are realistic for this machine: the zero-layer replica
refuses in about 2 ms, the baseline refuses nothing before the pressure ends (3 s later).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.report import claims
from bench.report.claims import faults
from bench.report.data import RunData, append_recovery
from chaos.recovery import KILL_ORCHESTRATOR, KILL_REPLICA, KV_PRESSURE, Recovery, absent_row
from chaos.refusal import RefusalTrial
from chaos.windows import WindowCounts
from harness.schema import Machine, RunMeta

SPEED = 1_000_000.0
HELD, NOT_HELD, UNDECIDED, NOT_MEASURED = (
    claims.HELD,
    claims.NOT_HELD,
    claims.UNDECIDED,
    claims.NOT_MEASURED,
)


def chaos_row(stack: str, experiment: str, trial: int, **fields: object) -> Recovery:
    """A valid run of ``experiment`` on ``stack``: ran to its end, steady before the fault,
    rolled back, nothing lost, the host at half its CPU and at the run's speed."""
    row = absent_row(stack, experiment, "x", trial)
    defaults = {"status": "completed", "fault": "kill", "hypothesis_before": True,
                "hypothesis_after": True, "note": "", "host_cpu_pct": 55.0,
                "host_busiest_cpu_pct": 70.0, "host_speed": SPEED}  # fmt: skip
    for key, value in {**defaults, **fields}.items():
        setattr(row, key, value)
    return row


def pressure(
    p99_ms: float | None, notice_ms: float, *, censored: bool = False, crossed: bool = True
) -> RefusalTrial:
    """A KV-pressure trial: refusals with that p99 (none when None), the notice time."""
    refused = p99_ms is not None
    return RefusalTrial(
        requests=24,
        refused=5 if refused else 0,
        latencies_us=[int(1000 * p99_ms)] * 5 if refused and p99_ms else [],
        p50_ms=p99_ms,
        p99_ms=p99_ms,
        crossing_ns=1 if crossed else 0,
        first_refusal_ns=0 if censored else 2,
        notice_ms=notice_ms if crossed else None,
        censored=censored,
        admitted_after=0 if refused else 12,
        gap_ms=20.0,
        send_lag_p99_ms=2.0,
        note="" if crossed else "the replica never became full for the pressure (peak 60 %)",
    )


def kv_rows(
    zl: Sequence[RefusalTrial], base: Sequence[RefusalTrial], **fields: object
) -> list[Recovery]:
    return [
        chaos_row(stack, KV_PRESSURE, k, refusal=trial, fault="kv_pressure", **fields)
        for stack, trials in (("zerolayer", zl), ("baseline", base))
        for k, trial in enumerate(trials)
    ]


ZL_FAST = pressure(1.8, 9.0)
BASE_NEVER = pressure(None, 3000.0, censored=True)


def run_of(tmp_path: Path, rows: Sequence[Recovery]) -> RunData:
    if rows:
        append_recovery(tmp_path, list(rows))
    meta = RunMeta("t", machine=Machine(cpu_speed_start=SPEED))
    meta.profiles["d_fault"] = {"rate": 3.0}
    return RunData(tmp_path, meta, {}, [], [], [], [], [])


def judge(tmp_path: Path, rows: Sequence[Recovery], key: str) -> claims.ClaimResult:
    return next(c for c in claims.evaluate(run_of(tmp_path, rows)) if c.key == key)


# -- refusal speed ------------------------------------------------------------------------------


def test_refusal_held_when_the_zero_layer_refuses_at_once_and_the_baseline_never(
    tmp_path: Path,
) -> None:
    got = judge(tmp_path, kv_rows([ZL_FAST] * 3, [BASE_NEVER] * 3), "refusal_speed")
    assert got.status == HELD and got.trials == 3, got.reason
    assert got.figures["zl_p99_ms"].value == pytest.approx(1.8)
    assert got.figures["notice_ratio"].value == pytest.approx(3000.0 / 9.0)
    assert got.bands == {"zl_p99_ms": claims.Band(0.0, 6.4), "notice_ratio": claims.Band(18.75)}
    for part in (
        "zero-layer: refusal p50 1.800",
        "baseline: refusal p50 refused none",
        "3 req/s",
        "trials [0, 1, 2]",
        "kv-pressure-one-replica",
        "a lower bound",
    ):
        assert part in got.measured, part  # fmt: skip
    assert "6.4 ms" in got.rule and "18.75x" in got.rule


def test_refusal_not_held_when_the_zero_layer_is_slow_or_the_baseline_as_quick(
    tmp_path: Path,
) -> None:
    slow = judge(tmp_path / "a", kv_rows([pressure(12.0, 14.0)] * 3, [BASE_NEVER] * 3),
                 "refusal_speed")  # fmt: skip
    assert slow.status == NOT_HELD and slow.figures["zl_p99_ms"].low > 6.4
    quick = judge(tmp_path / "b", kv_rows([ZL_FAST] * 3, [pressure(2.0, 40.0)] * 3),
                  "refusal_speed")  # fmt: skip
    assert quick.status == NOT_HELD and quick.figures["notice_ratio"].high < 18.75


def test_refusal_the_rule_can_fail_swapping_the_stacks_flips_it(tmp_path: Path) -> None:
    """The same trials with the stacks' figures exchanged: the zero-layer refusing nothing
    (its p99 at least the rest of the pressure) and the baseline at once."""
    swapped = judge(tmp_path, kv_rows([BASE_NEVER] * 3, [ZL_FAST] * 3), "refusal_speed")
    assert swapped.status == NOT_HELD, swapped.reason


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"host_cpu_pct": 97.0}, "host saturated (CPU 97 %"),
        ({"host_speed": 600_000.0}, "host speed moved -40%"),
        ({"hypothesis_before": False}, "the steady state did not hold before the fault"),
        ({"status": "aborted"}, "the experiment ended aborted"),
        ({"rollbacks_ok": False}, "a rollback failed"),
        ({"lost": 3}, "3 requests lost"),
        ({"refusal": pressure(None, 0.0, crossed=False)}, "never became full"),
        ({"refusal": None}, "no refusal figures"),
    ],
)
def test_refusal_undecided_names_each_flagged_trial(
    tmp_path: Path, fields: dict[str, object], reason: str
) -> None:
    rows = kv_rows([ZL_FAST] * 3, [BASE_NEVER] * 3)
    for key, value in fields.items():
        setattr(rows[4], key, value)  # the baseline's trial 1
    got = judge(tmp_path, rows, "refusal_speed")
    assert got.status == UNDECIDED
    assert "too few valid trials: 2 of the 3 needed" in got.reason
    assert "baseline kv-pressure-one-replica trial 1" in got.reason or "baseline trial 1" in (
        got.reason
    )
    assert reason in got.reason


def test_refusal_ignores_the_background_loads_lag_and_flags_its_own(tmp_path: Path) -> None:
    lagged = kv_rows([ZL_FAST] * 3, [BASE_NEVER] * 3, loader_lag="loader lagged: p99 9 ms")
    assert judge(tmp_path / "a", lagged, "refusal_speed").status == HELD
    late = pressure(1.8, 9.0)
    late.send_lag_p99_ms = 35.0
    got = judge(tmp_path / "b", kv_rows([late] * 3, [BASE_NEVER] * 3), "refusal_speed")
    assert got.status == UNDECIDED and "the pressure's sends lagged" in got.reason


def test_refusal_undecided_when_the_interval_spans_the_threshold(tmp_path: Path) -> None:
    base = [pressure(3.0, 90.0), pressure(3.0, 300.0), pressure(3.0, 170.0)]
    got = judge(tmp_path, kv_rows([ZL_FAST] * 3, base), "refusal_speed")
    ratio = got.figures["notice_ratio"]
    assert ratio.low < 18.75 < ratio.high
    assert got.status == UNDECIDED and "notice_ratio: the interval over trials spans" in got.reason


def test_refusal_a_lower_bound_cannot_show_a_ratio_is_low(tmp_path: Path) -> None:
    """A baseline that refused nothing before a short pressure ended: its notice is only known
    to be at least 60 ms, so a ratio under the band does not read not held."""
    short = pressure(None, 60.0, censored=True)
    got = judge(tmp_path, kv_rows([ZL_FAST] * 3, [short] * 3), "refusal_speed")
    assert got.status == UNDECIDED and "only a lower bound" in got.reason


def test_refusal_with_one_or_no_trial_is_undecided_or_not_measured(tmp_path: Path) -> None:
    one = judge(tmp_path / "a", kv_rows([ZL_FAST], [BASE_NEVER]), "refusal_speed")
    assert one.status == UNDECIDED and "1 of the 3 needed" in one.reason
    assert judge(tmp_path / "b", [], "refusal_speed").status == NOT_MEASURED


# -- fault errors -------------------------------------------------------------------------------


def windows(steady: tuple[int, int], fault: tuple[int, int], retried: tuple[int, int] = (0, 0)):
    return {
        "steady": WindowCounts(requests=steady[0], errors=steady[1]),
        "faulted": WindowCounts(
            requests=fault[0], errors=fault[1], retried=retried[0], retries=retried[0],
            retried_ok=retried[1],
        ),
    }  # fmt: skip


def kill_rows(
    base_fault: Sequence[int], zl_fault: Sequence[int], **fields: object
) -> list[Recovery]:
    """Each trial: the baseline's orchestrator killed, ``base_fault[k]`` of 60 requests in its
    fault window failing; the zero-layer's replica killed, ``zl_fault[k]`` of 60; steady 0/20.
    The zero-layer's kill-orchestrator row (nothing to act on) sits beside them."""
    rows = []
    for k, (b, z) in enumerate(zip(base_fault, zl_fault, strict=True)):
        rows.append(chaos_row("baseline", KILL_ORCHESTRATOR, k, **windows((20, 0), (60, b)),
                              **fields))  # fmt: skip
        rows.append(chaos_row("zerolayer", KILL_REPLICA, k, **windows((20, 0), (60, z)), **fields))
        rows.append(absent_row("zerolayer", KILL_ORCHESTRATOR, "orchestrator", k))
    return rows


def test_fault_errors_held_when_the_baselines_errors_rise_far_more(tmp_path: Path) -> None:
    got = judge(tmp_path, kill_rows([30, 33, 27], [3, 4, 3]), "fault_errors")
    assert got.status == HELD, got.reason
    assert got.figures["error_rise_ratio"].low >= 2.1
    assert "judged on kill-orchestrator (baseline) against kill-engine-replica" in got.measured
    assert "0.0 [0.0, 0.0] % (n=3) steady -> 50.0" in got.measured


def test_fault_errors_not_held_when_both_rise_alike_and_the_rule_can_fail(tmp_path: Path) -> None:
    alike = judge(tmp_path / "a", kill_rows([6, 7, 6], [6, 6, 7]), "fault_errors")
    assert alike.status == NOT_HELD and alike.figures["error_rise_ratio"].high < 2.1
    swapped = judge(tmp_path / "b", kill_rows([3, 4, 3], [30, 33, 27]), "fault_errors")
    assert swapped.status == NOT_HELD


def test_fault_errors_a_rise_below_one_request_is_not_told_from_none(tmp_path: Path) -> None:
    """No error on either stack: each rise is one request's share, the ratio 1: not held."""
    got = judge(tmp_path, kill_rows([0, 0, 0], [0, 0, 0]), "fault_errors")
    assert got.status == NOT_HELD and got.figures["error_rise_ratio"].value == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"loader_lag": "loader lagged: p99 scheduling lag 9.000 ms"}, "loader lagged"),
        ({"host_busiest_cpu_pct": 99.0}, "busiest core 99 %"),
        ({"steady": WindowCounts()}, "no request ran wholly before the fault"),
        ({"hypothesis_before": None}, "the steady state did not hold"),
    ],
)
def test_fault_errors_undecided_names_each_flagged_trial(
    tmp_path: Path, fields: dict[str, object], reason: str
) -> None:
    rows = kill_rows([30, 33, 27], [3, 4, 3])
    for key, value in fields.items():
        setattr(rows[0], key, value)  # the baseline's trial 0
    got = judge(tmp_path, rows, "fault_errors")
    assert got.status == UNDECIDED and "2 of the 3 needed" in got.reason and reason in got.reason


def test_fault_errors_spanning_the_threshold_or_too_few_is_undecided(tmp_path: Path) -> None:
    spans = judge(tmp_path / "a", kill_rows([6, 30, 12], [3, 3, 3]), "fault_errors")
    assert spans.status == UNDECIDED and "spans" in spans.reason
    few = judge(tmp_path / "b", kill_rows([30], [3]), "fault_errors")
    assert few.status == UNDECIDED and "1 of the 3 needed" in few.reason
    assert judge(tmp_path / "c", [], "fault_errors").status == NOT_MEASURED


# -- retry success ------------------------------------------------------------------------------


def retry_rows(zl: Sequence[tuple[int, int]], base: Sequence[tuple[int, int]]) -> list[Recovery]:
    """Each trial's runs; the retried (requests, completed) in the fault window of the kill of
    what each stack's clients talk to, none under KV pressure. The baseline's kill-engine-replica
    (not judged for it: it runs in the first trial only) retried and lost everything: it must
    not count."""
    rows = []
    for k, (z, b) in enumerate(zip(zl, base, strict=True)):
        rows.append(chaos_row("zerolayer", KILL_REPLICA, k, **windows((20, 0), (60, 3), z)))
        rows.append(chaos_row("zerolayer", KV_PRESSURE, k, **windows((20, 0), (60, 0))))
        rows.append(chaos_row("baseline", KILL_ORCHESTRATOR, k, **windows((20, 0), (60, 30), b)))
        rows.append(chaos_row("baseline", KV_PRESSURE, k, **windows((20, 0), (60, 0))))
        rows.append(absent_row("zerolayer", KILL_ORCHESTRATOR, "orchestrator", k))
    rows.append(chaos_row("baseline", KILL_REPLICA, 0, **windows((20, 0), (60, 9), (9, 0))))
    return rows


def test_retry_success_held_when_the_zero_layers_retries_succeed_far_more(
    tmp_path: Path,
) -> None:
    got = judge(tmp_path, retry_rows([(10, 10)] * 3, [(10, 6), (10, 6), (8, 5)]), "retry_success")
    assert got.status == HELD, got.reason
    assert got.bands == {"retry_success_pp": claims.Band(16.35)}
    assert "kill-engine-replica#0 10/10" in got.measured and "0/9" not in got.measured
    assert got.claimed == "94.7 % vs 62 %"


def test_retry_success_not_held_when_alike_and_the_rule_can_fail(tmp_path: Path) -> None:
    alike = judge(tmp_path / "a", retry_rows([(10, 7)] * 3, [(10, 7)] * 3), "retry_success")
    assert alike.status == NOT_HELD
    swapped = judge(tmp_path / "b", retry_rows([(10, 6)] * 3, [(10, 10)] * 3), "retry_success")
    assert swapped.status == NOT_HELD
    assert swapped.figures["retry_success_pp"].value == pytest.approx(-40.0)


def test_retry_success_undecided_without_retries_spanning_or_flagged(tmp_path: Path) -> None:
    none = judge(tmp_path / "a", retry_rows([(10, 10)] * 3, [(0, 0)] * 3), "retry_success")
    assert none.status == UNDECIDED and "no request was retried in the fault windows" in none.reason
    spans = judge(tmp_path / "b", retry_rows([(10, 10)] * 3, [(10, 9), (10, 5), (10, 9)]),
                  "retry_success")  # fmt: skip
    assert spans.status == UNDECIDED and "spans" in spans.reason
    rows = retry_rows([(10, 10)] * 3, [(10, 6)] * 3)
    rows[1].lost = 1  # the zero-layer's kv-pressure run of trial 0
    lost = judge(tmp_path / "c", rows, "retry_success")
    assert lost.status == UNDECIDED and "zerolayer kv-pressure-one-replica trial 0" in lost.reason
    assert judge(tmp_path / "d", [], "retry_success").status == NOT_MEASURED


def test_the_chaos_claims_round_trip_through_claims_json(tmp_path: Path) -> None:
    rows = kv_rows([ZL_FAST] * 3, [BASE_NEVER] * 3) + kill_rows([30, 33, 27], [3, 4, 3])
    got = claims.evaluate(run_of(tmp_path, rows))
    claims.write(tmp_path, got)
    back = claims.read(tmp_path)
    assert back is not None and back.claims == got
    keys = [c.key for c in got]
    assert keys.index("refusal_speed") < keys.index("fault_errors") < keys.index("retry_success")
    assert faults.CHAOS_RULE in next(c for c in got if c.key == "fault_errors").rule
