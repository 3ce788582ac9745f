"""The elasticity claims (profile G) give held, not held, or undecided with each of its reasons,
from trials built by hand: summary rows as a run writes them and the figures of
``elasticity.json``. Each rule can fail: the not-held cases below are the held ones with a
figure on the wrong side of its threshold."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.report import claims
from bench.report.claims.elasticity import (
    ELASTIC_PROFILE,
    RESOLVING_SESSIONS,
    judge_first_request,
    judge_sessions_kept,
)
from bench.report.data import RunData
from chaos import elastic_runner
from chaos.elasticity import ElasticityRow, SessionMoves
from harness.schema import Machine, RunMeta, SummaryRow

SPEED = 1_000_000.0
FAST = 16.0  # req/s: one request in three for the joining replica every 188 ms on average
SLOW = 4.0  # 750 ms: the load cannot resolve a 217 ms delay


def summary(stack: str, repeat: int, rate: float = FAST, **fields: object) -> SummaryRow:
    row = SummaryRow(
        stack=stack,
        profile=ELASTIC_PROFILE,
        loader="native",
        num_requests=200,
        completed=200,
        valid=True,
        host_cpu_pct=50.0,
        host_busiest_cpu_pct=60.0,
        host_speed=SPEED,
        offered_rate=rate,
        repeat=repeat,
        stats={"median_e2el_ms": 600.0, "p95_e2el_ms": 700.0, "p99_e2el_ms": 800.0,
               "std_e2el_ms": 50.0},
    )  # fmt: skip
    for key, value in fields.items():
        setattr(row, key, value)
    return row


def figures(
    stack: str, repeat: int, first_ms: float | None = 200.0, needless: int = 0, seen: int = 4000,
    **fields: object,
) -> ElasticityRow:  # fmt: skip
    """A trial's figures: ``seen`` sessions on each side of each change, a third of them moved
    by the change (to the joining replica, off the leaving one), ``needless`` more moved."""
    moved = seen // 3
    moves = SessionMoves(seen, seen - moved - needless, moved, needless)
    row = ElasticityRow(stack, repeat, "completed", True, 2, time_to_first_request_ms=first_ms,
                        join_moves=moves, leave_moves=SessionMoves(**vars(moves)))  # fmt: skip
    for key, value in fields.items():
        setattr(row, key, value)
    return row


def trials(
    zl_ms: Sequence[float | None], base_ms: Sequence[float | None], rate: float = FAST
) -> tuple[list[SummaryRow], list[ElasticityRow]]:
    rows = [summary(s, k, rate) for s in ("zerolayer", "baseline") for k in range(len(zl_ms))]
    figs = [figures("zerolayer", k, v) for k, v in enumerate(zl_ms)]
    figs += [figures("baseline", k, v) for k, v in enumerate(base_ms)]
    return rows, figs


def first(rows: Sequence[SummaryRow], figs: Sequence[ElasticityRow]) -> claims.ClaimResult:
    return judge_first_request(rows, figs, SPEED)


def kept(rows: Sequence[SummaryRow], figs: Sequence[ElasticityRow]) -> claims.ClaimResult:
    return judge_sessions_kept(rows, figs, SPEED)


def test_first_request_held_states_its_rule_load_figures_and_rows() -> None:
    got = first(*trials([200.0, 220.0, 210.0], [3100.0, 3300.0, 3200.0]))
    assert got.status is claims.HELD, got.reason
    assert got.trials == 3 and not got.reason
    assert got.figures["zerolayer_ms"].value == 210.0
    assert got.figures["ratio"].low is not None and got.figures["ratio"].low >= 7.37
    assert "at 16 req/s" in got.measured
    assert "rows used: zerolayer r0, baseline r0, zerolayer r1" in got.measured
    assert "at most 434 ms" in got.rule and "7.4x" in got.rule and "valid trials" in got.rule
    assert got.bands["zerolayer_ms"].high == 434.0 and got.bands["ratio"].low > 7.3


def test_first_request_not_held_when_the_orchestrator_is_as_fast() -> None:
    got = first(*trials([200.0, 220.0, 210.0], [400.0, 430.0, 420.0]))
    assert got.status is claims.NOT_HELD
    assert got.figures["ratio"].high is not None and got.figures["ratio"].high < 7.37


def test_first_request_not_held_when_the_new_replica_waits_long() -> None:
    got = first(*trials([900.0, 950.0, 1000.0], [9000.0, 9500.0, 10000.0]))
    assert got.status is claims.NOT_HELD
    assert got.figures["zerolayer_ms"].low is not None and got.figures["zerolayer_ms"].low > 434


def test_first_request_interval_across_the_bound_is_undecided() -> None:
    got = first(*trials([300.0, 600.0, 350.0], [9000.0, 9500.0, 10000.0]))
    assert got.status is claims.UNDECIDED and got.reason == claims.SPANS


def test_first_request_with_too_few_valid_trials_is_undecided_and_names_them() -> None:
    rows, figs = trials([200.0, 220.0, 210.0], [3100.0, 3300.0, 3200.0])
    rows[5] = summary("baseline", 2, saturated=True, saturation_reasons=["falling behind"])
    figs[1] = figures("zerolayer", 1, status="failed")
    got = first(rows, figs)
    assert got.status is claims.UNDECIDED and got.trials == 1
    assert "too few valid trials: 1 of the 3 needed" in got.reason
    assert "zerolayer trial 1: the experiment ended failed" in got.reason
    assert "baseline trial 2: saturated: falling behind" in got.reason


def test_first_request_never_taken_is_named() -> None:
    rows, figs = trials([200.0, 220.0, None], [3100.0, 3300.0, 3200.0])
    figs[2].note = "the joining replica took no request before the leave began"
    got = first(rows, figs)
    assert got.status is claims.UNDECIDED
    assert "zerolayer trial 2: the joining replica took no request" in got.reason


def test_first_request_at_a_load_that_cannot_resolve_it_decides_only_held() -> None:
    slow = first(*trials([900.0, 950.0, 1000.0], [3100.0, 3300.0, 3200.0], rate=SLOW))
    assert slow.status is claims.UNDECIDED
    assert "cannot resolve" in slow.reason and "every 750 ms" in slow.reason
    held = first(*trials([200.0, 220.0, 210.0], [3100.0, 3300.0, 3200.0], rate=SLOW))
    assert held.status is claims.HELD  # arrivals only lengthen it: a held verdict stands


def test_first_request_without_profile_g_is_not_measured() -> None:
    rows, figs = trials([200.0, 220.0, 210.0], [3100.0, 3300.0, 3200.0])
    assert first([r for r in rows if r.stack == "zerolayer"], figs).status is claims.NOT_MEASURED
    assert first([], []).status is claims.NOT_MEASURED


def kept_trials(
    needless: Sequence[int], seen: int = 4000, base_needless: int = 900
) -> tuple[list[SummaryRow], list[ElasticityRow]]:
    rows = [summary(s, k) for s in ("zerolayer", "baseline") for k in range(len(needless))]
    figs = [figures("zerolayer", k, needless=n, seen=seen) for k, n in enumerate(needless)]
    figs += [figures("baseline", k, needless=base_needless, seen=seen) for k in range(3)]
    return rows, figs


def test_sessions_kept_held_over_enough_sessions_shows_the_baseline_beside() -> None:
    got = kept(*kept_trials([0, 0, 0]))
    assert got.status is claims.HELD, got.reason
    assert got.figures["zerolayer_needless_pct"].value == 0.0
    assert got.figures["baseline_needless_pct"].value > 10.0  # pow2-like: shown, not judged
    assert "0 of 16002 sessions" in got.measured and "rows used: zerolayer r0" in got.measured
    assert "at most 0.02 %" in got.rule and str(RESOLVING_SESSIONS) in got.rule


def test_sessions_kept_not_held_when_sessions_move_needlessly() -> None:
    got = kept(*kept_trials([5, 6, 5]))
    assert got.status is claims.NOT_HELD
    small = kept(*kept_trials([1, 1, 1], seen=12))  # a move shows at any resolution
    assert small.status is claims.NOT_HELD


def test_sessions_kept_over_too_few_sessions_cannot_hold() -> None:
    got = kept(*kept_trials([0, 0, 0], seen=12))
    assert got.status is claims.UNDECIDED
    assert "48 sessions that did not have to move cannot resolve 0.02 %" in got.reason


def test_sessions_kept_interval_across_the_bound_is_undecided() -> None:
    got = kept(*kept_trials([0, 0, 5], seen=12_000))
    assert got.status is claims.UNDECIDED and got.reason == claims.SPANS


def test_sessions_kept_with_too_few_valid_trials_is_undecided() -> None:
    rows, figs = kept_trials([0, 0, 0])
    rows[0] = summary("zerolayer", 0, host_cpu_pct=None)
    figs[1] = figures("zerolayer", 1, rollbacks_ok=False)
    figs[2] = figures("zerolayer", 2, seen=0)
    got = kept(rows, figs)
    assert got.status is claims.UNDECIDED and "0 of the 3 needed" in got.reason
    assert "zerolayer trial 0: the host's CPU was not measured" in got.reason
    assert "zerolayer trial 1: a rollback failed" in got.reason
    assert "zerolayer trial 2: the figure was not measured" in got.reason


def test_sessions_kept_without_zero_layer_trials_is_not_measured() -> None:
    assert kept([], []).status is claims.NOT_MEASURED


def test_both_claims_are_registered_read_elasticity_json_and_only_they_use_g(
    tmp_path: Path,
) -> None:
    rows, figs = trials([200.0, 220.0, 210.0], [3100.0, 3300.0, 3200.0])
    elastic_runner.append(tmp_path, figs)
    meta = RunMeta("t", machine=Machine(cpu_speed_start=SPEED))
    run = RunData(tmp_path, meta, {}, rows, [], [], [], [], None)
    decided = {c.key: c for c in claims.evaluate(run)}
    assert decided["first_request"].status is claims.HELD
    assert decided["sessions_kept"].status is claims.HELD
    assert elastic_runner.read(tmp_path) == figs
    # a replica joining is no steady state: no latency or layer-CPU claim is judged on it
    for key in ("layer_overhead", "tail_latency", "layer_cpu"):
        assert decided[key].status is claims.NOT_MEASURED, decided[key]
