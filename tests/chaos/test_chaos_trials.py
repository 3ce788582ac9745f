"""What a chaos trial measures, without a stack: refusal speed from a pressure's records and a KV
watch, errors and retries in a fault's window against the steady state, which runs may decide,
and which experiments each trial runs."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from chaos import recovery, refusal, runner, windows
from chaos.targets import ReplicaSpec, Target, write_target
from harness.schema import RequestRecord, retries_of
from serving.engine.kvwatch import KvSample

MS = 1_000_000
T0 = 1_800_000_000_000_000_000
TOTAL = 1000  # KV blocks of the watched replica
RESERVE = 100  # blocks one pressure request takes (1600 tokens)


def pressed(i: int, *, refused_after_us: int = 0, first_token: bool = False) -> RequestRecord:
    """Pressure request ``i``, sent at ``i`` x 20 ms; refused ``refused_after_us`` later."""
    sent = T0 + i * 20 * MS
    rec = RequestRecord(f"p{i}", "zerolayer", "kv_pressure", "chaos", sent, sent, sent)
    if refused_after_us:
        rec.outcome, rec.error_code = "error", "kv_exhausted"
        rec.refused_ns = rec.end_ns = sent + refused_after_us * 1000
    else:
        rec.outcome, rec.error_code, rec.end_ns = "error", refusal.CUT, T0 + 4000 * MS
    if first_token:
        rec.first_token_ns = sent + 5 * MS
    return rec


def watched(*points: tuple[int, int, int]) -> list[KvSample]:
    """Samples at (ms, committed blocks, admitted)."""
    return [KvSample(T0 + ms * MS, used, 0, TOTAL, 16, 0, n) for ms, used, n in points]


WINDOW = (T0, T0 + 4000 * MS)


def test_a_refusal_right_after_the_crossing_is_measured_to_the_microsecond() -> None:
    records = [pressed(i) for i in range(9)] + [pressed(9, refused_after_us=1_734)]
    samples = watched((100, 700, 8), (160, 890, 9), (175, 895, 9), (300, 895, 9))
    got = refusal.measure(records, {"kv-watch-zl-1.jsonl": samples}, WINDOW, 1600, ramp_s=0.2)
    assert got.refused == 1 and got.latencies_us == [1_734] and got.p99_ms == 1.734
    assert got.crossing_ns == T0 + 160 * MS  # 890 + 100 > 98 % of 1000 (800 was not)
    assert got.first_refusal_ns == T0 + 180 * MS + 1_734_000
    assert got.notice_ms == 21.734 and not got.censored and got.admitted_after == 0
    assert got.watched == "kv-watch-zl-1.jsonl" and got.codes == {"kv_exhausted": 1}
    assert got.gap_ms == 20.0 and got.problems() == []


def test_a_stack_that_never_refuses_is_censored_at_the_end_of_the_pressure() -> None:
    records = [pressed(i) for i in range(12)]
    samples = watched((100, 700, 8), (160, 890, 9), (220, 990, 11), (400, 1200, 12))
    got = refusal.measure(records, {"a": samples}, WINDOW, 1600)
    assert got.refused == 0 and got.p50_ms is None and got.censored
    assert got.notice_ms == 4000 - 160 and got.admitted_after == 3


def test_the_replica_the_pressure_filled_is_the_one_watched() -> None:
    quiet = watched((100, 520, 3))
    full = watched((100, 700, 8), (160, 950, 9))
    got = refusal.measure([pressed(0)], {"other": quiet, "full": full}, WINDOW, 1600)
    assert got.watched == "full" and got.crossing_ns == T0 + 160 * MS


def test_without_a_watch_or_a_full_replica_there_is_no_crossing_and_it_says_why() -> None:
    records = [pressed(0, refused_after_us=900)]
    blind = refusal.measure(records, {}, WINDOW, 1600)
    assert blind.latencies_us == [900] and blind.notice_ms is None
    assert blind.problems() == [blind.note] and "no KV watch" in blind.note
    half = refusal.measure(records, {"a": watched((100, 600, 2))}, WINDOW, 1600)
    assert half.crossing_ns == 0 and "never became full" in half.problems()[0]


def test_sends_that_fall_behind_the_ramp_are_a_problem() -> None:
    records = [pressed(i) for i in range(4)]
    for rec in records:
        rec.sent_ns += 30 * MS
    got = refusal.measure(records, {"a": watched((0, 990, 4))}, WINDOW, 1600, ramp_s=0.08)
    assert any("lagged" in p for p in got.problems())


def test_only_an_error_before_any_output_seen_by_the_client_is_a_refusal() -> None:
    assert refusal.refused(pressed(0, refused_after_us=10))
    assert not refusal.refused(pressed(0))
    assert not refusal.refused(pressed(0, refused_after_us=10, first_token=True))


def background(
    start_ms: int, end_ms: int, outcome: str = "completed", **fields: int
) -> RequestRecord:
    rec = RequestRecord("b", "baseline", "d_fault", "native", T0 + start_ms * MS)
    rec.end_ns = T0 + end_ms * MS if outcome != "lost" else 0
    rec.outcome = outcome  # type: ignore[assignment]
    rec.retries, rec.attempts = fields.get("retries", 0), fields.get("attempts", 0)
    return rec


def test_the_fault_window_is_what_the_fault_could_touch_and_the_steady_state_what_ended() -> None:
    records = [
        background(0, 500),  # steady
        background(600, 1400, attempts=1),  # running when the fault came: touched
        background(1500, 1900, "error"),
        background(1600, 2100, attempts=3),  # the orchestrator retried twice, then completed
        background(1700, 1900, "error", retries=1),  # the SDK retried once, then failed
        background(1800, 0, "lost"),
        background(3500, 3900),  # after the stack was whole again
    ]
    before = windows.steady(records, T0 + 1000 * MS)
    during = windows.faulted(records, T0 + 1000 * MS, T0 + 3000 * MS)
    assert (before.requests, before.errors, before.error_rate) == (1, 0, 0.0)
    assert (during.requests, during.errors, during.retried, during.retries) == (5, 3, 2, 3)
    assert during.retried_ok == 1 and during.retry_success == 0.5
    assert windows.count([], 0, 1).error_rate is None and during.requests == 5


@given(st.integers(0, 3), st.integers(0, 5))
def test_every_retry_counts_once_whoever_made_it(retries: int, attempts: int) -> None:
    rec = background(0, 1, retries=retries, attempts=attempts)
    assert retries_of(rec) == retries + max(0, attempts - 1)


def row(**fields: object) -> recovery.Recovery:
    base = recovery.absent_row("baseline", "kill-orchestrator", "orchestrator")
    values = {
        "status": "completed",
        "fault": "kill",
        "hypothesis_before": True,
        "host_cpu_pct": 50.0,
        "host_busiest_cpu_pct": 60.0,
        "host_speed": 1e6,
        "note": "",
    }
    for key, value in {**values, **fields}.items():
        setattr(base, key, value)
    return base


def test_each_reason_a_run_may_not_decide_is_named() -> None:
    assert recovery.trial_problems(row(), 1e6) == []
    cases = {
        "the experiment ended aborted": row(status="aborted"),
        "the steady state did not hold before the fault": row(hypothesis_before=False),
        "a rollback failed": row(rollbacks_ok=False),
        "2 requests lost": row(lost=2),
        "loader lagged": row(loader_lag="loader lagged: p99 scheduling lag 9 ms"),
        "host saturated (CPU 95 %": row(host_cpu_pct=95.0),
        "host saturated (CPU 50 %, busiest core 97 %)": row(host_busiest_cpu_pct=97.0),
        "the host's CPU was not measured": row(host_cpu_pct=None),
        "host speed moved -40%": row(host_speed=6e5),
        "the host's speed was not probed": row(host_speed=None),
    }
    for reason, flagged in cases.items():
        assert any(reason in p for p in recovery.trial_problems(flagged, 1e6)), reason
    lagged = row(loader_lag="loader lagged")
    assert recovery.trial_problems(lagged, 1e6, load_lag=False) == []
    assert recovery.trial_problems(row(status="failed"), 1e6) == [], "not recovering is a finding"


def test_a_fault_with_nothing_to_act_on_is_a_row_that_says_so() -> None:
    absent = recovery.absent_row("zerolayer", "kill-orchestrator", "orchestrator", trial=2)
    assert absent.absent and absent.status == recovery.NO_SUCH_COMPONENT and absent.trial == 2
    assert "no orchestrator" in absent.note and absent.requests == 0
    assert recovery.trial_problems(absent) == [absent.note]
    line = next(x for x in runner.fault_table([absent]).splitlines() if "kill-" in x)
    assert line.split()[-3:] == ["no", "such", "component"]


def test_the_experiment_that_kills_what_clients_talk_to_is_the_kinds() -> None:
    assert recovery.front_kill("zerolayer") == recovery.KILL_REPLICA
    assert recovery.front_kill("baseline") == recovery.KILL_ORCHESTRATOR


def test_the_first_trial_runs_every_experiment_the_others_those_the_claims_judge() -> None:
    paths = runner.experiment_paths()
    assert runner.for_trial(paths, 0, "zerolayer") == paths
    for stack, kill in (
        ("zerolayer", recovery.KILL_REPLICA),
        ("baseline", recovery.KILL_ORCHESTRATOR),
    ):
        later = {p.stem for p in runner.for_trial(paths, 1, stack)}
        assert later == recovery.judged(stack) == {recovery.KV_PRESSURE, kill}


def test_a_method_on_a_role_the_stack_lacks_is_found_before_it_runs(tmp_path: Path) -> None:
    path = tmp_path / "target.json"
    spec = ReplicaSpec("http://127.0.0.1:1", 1, 1, ["x"])
    target = Target("zerolayer", [spec.url], "h2", pids={"replica": [1]}, replicas=[spec])
    write_target(path, target)
    kill = {"method": [{"provider": {"func": "kill", "arguments": {"role": "orchestrator"}}}]}
    engine = {"method": [{"provider": {"func": "kill", "arguments": {"role": "engine"}}}]}
    assert runner.missing_role(kill, target) == "orchestrator"
    assert runner.missing_role(engine, target) is None  # ``engine`` is the replica here
    assert runner.missing_role({"method": [{"provider": {"arguments": {}}}]}, target) is None
