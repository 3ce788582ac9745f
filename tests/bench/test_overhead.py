"""``zl-bench overhead``: its schedule, its arithmetic (added latency, CPU per request and per
token, host load, the verdict), its tables and files, and a short in-process run end to end."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.cli import main as cli_main
from bench.overhead import add_arguments, run_command
from bench.overhead.cli import resolve
from bench.overhead.measure import balanced_order, closed_loop_rate, schedule, server_cpu
from bench.overhead.model import ENGINES, HostLoad, Level, Role, ServerCpu, Workload, added
from bench.overhead.render import rows, table, verdict, warnings
from bench.overhead.summary import judge, summarize
from bench.overhead.targets import TARGET_KINDS, choose_targets
from bench.report.verdicts import Status
from harness.errors import UsageError
from harness.telemetry.process import ProcessCpu

IDLE = HostLoad(busy=0.3, load1=0.5, cores=2)


def _level(
    target: str,
    in_flight: int = 1,
    e2el: tuple[float | None, float | None] = (10.0, 20.0),
    ttft: tuple[float | None, float | None] = (2.0, 4.0),
    tokens: tuple[int, ...] = (32,) * 10,
    cpu: ServerCpu | None = None,
    host: HostLoad = IDLE,
    repeat: int = 0,
    tpot: tuple[float | None, float | None] = (0.25, 0.5),
) -> Level:
    return Level(
        target=target,
        in_flight=in_flight,
        rate=5.0,
        completed=len(tokens),
        errors=0,
        ttft_p50_ms=ttft[0],
        ttft_p99_ms=ttft[1],
        e2el_p50_ms=e2el[0],
        e2el_p99_ms=e2el[1],
        lag_p99_ms=0.1,
        tokens=tokens,
        client_cpu_us=300.0,
        server_cpu=cpu,
        host=host,
        role=TARGET_KINDS[target].role if target in TARGET_KINDS else Role.OTHER,
        repeat=repeat,
        tpot_p50_ms=tpot[0],
        tpot_p99_ms=tpot[1],
    )


def test_schedule_is_evenly_spaced_or_in_bursts() -> None:
    even = schedule(Workload(), 4, rate=100.0, duration_s=1.0, burst=False)
    assert len(even) == 100 and even[1].offset_s == pytest.approx(0.01)
    burst = schedule(Workload(), 4, rate=100.0, duration_s=1.0, burst=True)
    assert len(burst) == 100 and {r.offset_s for r in burst[:4]} == {0.0}
    assert burst[4].offset_s == pytest.approx(0.04)


def test_table_shows_missing_figures_as_dashes_not_zero() -> None:
    floor = _level("inproc")
    empty = Level("zerolayer", 1, 5.0, 0, 10, None, None, None, None, None, (), 400.0,
                  ServerCpu(0.01, 0.01), IDLE, {"refused": 10}, role=Role.OURS)  # fmt: skip
    text = table([floor, empty], max_tokens=32)
    latency = next(line for line in text.splitlines() if line.startswith("zerolayer "))
    assert latency.split()[2:] == ["1/1"] + ["-"] * 6 and "0.000" not in latency
    assert "errors {'refused': 10}" in text


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
maybe = st.none() | finite


@settings(deadline=None)  # a loaded shared machine must not fail a test of arithmetic
@given(level=st.tuples(maybe, maybe, maybe, maybe), floor=st.tuples(maybe, maybe, maybe, maybe))
def test_added_is_the_difference_and_missing_when_either_is(
    level: tuple[float | None, ...], floor: tuple[float | None, ...]
) -> None:
    a = _level("zerolayer", ttft=(level[0], level[1]), e2el=(level[2], level[3]))
    b = _level("inproc", ttft=(floor[0], floor[1]), e2el=(floor[2], floor[3]))
    plus = added(a, b)
    got = (plus["ttft_p50_ms"], plus["ttft_p99_ms"], plus["e2el_p50_ms"], plus["e2el_p99_ms"])
    for value, x, y in zip(got, level, floor, strict=True):
        if x is None or y is None:
            assert value is None
        else:
            assert value is not None and value + y == pytest.approx(x, abs=1e-6)
    assert added(a, None)["e2el_p50_ms"] is None


def test_rows_subtract_the_inproc_level_of_the_same_in_flight_and_repeat() -> None:
    levels = [
        _level("inproc", 1, e2el=(10.0, 20.0)),
        _level("inproc", 16, e2el=(40.0, 90.0)),
        _level("inproc", 1, e2el=(12.0, 20.0), repeat=1),
        _level("zerolayer", 1, e2el=(11.5, 24.0)),
        _level("zerolayer", 16, e2el=(43.0, 100.0)),
        _level("zerolayer", 1, e2el=(12.5, 24.0), repeat=1),
        _level("vllm-serve", 4, e2el=(50.0, 60.0)),  # no inproc at 4: nothing to subtract
    ]
    by = {(r["target"], r["in_flight"], r["repeat"]): r for r in rows(levels, 32)}
    assert by["zerolayer", 1, 1]["added_e2el_p50_ms"] == pytest.approx(1.5)
    assert by["zerolayer", 1, 2]["added_e2el_p50_ms"] == pytest.approx(0.5)
    assert by["zerolayer", 16, 1]["added_e2el_p99_ms"] == pytest.approx(10.0)
    assert by["inproc", 16, 1]["added_e2el_p50_ms"] == 0.0
    assert by["vllm-serve", 4, 1]["added_e2el_p50_ms"] is None


def test_cpu_per_request_and_per_token_divide_by_what_completed_and_streamed() -> None:
    lv = _level("zerolayer", tokens=(32,) * 10, cpu=ServerCpu(total_s=0.64, layer_s=0.16))
    assert lv.server_us_per_request == pytest.approx(64_000)
    assert lv.server_us_per_token == pytest.approx(2_000)
    assert lv.layer_us_per_token == pytest.approx(500)
    nothing = _level("zerolayer", tokens=(), cpu=ServerCpu(0.5, 0.5))
    assert nothing.server_us_per_request is None and nothing.server_us_per_token is None
    assert _level("inproc").server_us_per_token is None, "no server processes: no figure"


def _reading(**by_pid: tuple[str, float]) -> dict[int, ProcessCpu]:
    return {int(pid[1:]): ProcessCpu(*v) for pid, v in by_pid.items()}


def test_server_cpu_counts_new_processes_whole_and_splits_off_the_engine() -> None:
    before = _reading(p1=("zl-replica", 10.0), p2=("VLLM::EngineCore", 50.0), p3=("gone", 7.0))
    after = _reading(p1=("zl-replica", 10.5), p2=("VLLM::EngineCore", 52.0),
                     p4=("VLLM::Worker", 1.0))  # fmt: skip
    spent = server_cpu(before, after)
    assert spent.total_s == pytest.approx(3.5) and spent.layer_s == pytest.approx(0.5)


readings = st.dictionaries(
    st.integers(1, 50),
    st.builds(
        ProcessCpu, st.sampled_from(["python", "VLLM::Worker", "ray::Proxy"]), st.floats(0, 1e4)
    ),
)


@settings(deadline=None)
@given(before=readings, after=readings)
def test_server_cpu_is_never_negative_and_the_layer_is_part_of_it(
    before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]
) -> None:
    spent = server_cpu(before, after)
    assert 0.0 <= spent.layer_s <= spent.total_s + 1e-9


def test_closed_loop_rate_and_host_saturation() -> None:
    assert closed_loop_rate(10, 0, 2_000_000_000) == pytest.approx(5.0)
    assert closed_loop_rate(0, 0, 1) == 0.0 and closed_loop_rate(3, 5, 5) == 0.0
    assert HostLoad(0.95, 0.5, 2).saturated and not HostLoad(0.2, 2.0, 2).saturated
    assert HostLoad(0.5, 1.0, 2, busiest=0.95).saturated, "one pegged core of two"
    assert not HostLoad(0.5, 1.0, 2, busiest=0.7).saturated


def test_under_a_cpu_layout_the_loaders_and_layers_wait_for_a_core_tells_saturation() -> None:
    spinning = HostLoad(1.0, 3.0, 2, busiest=1.0, rest_busiest=1.0, wait_share=0.05)
    assert not spinning.saturated, "cores full of yielding spinners, no one kept waiting"
    starved = HostLoad(0.8, 1.0, 2, busiest=0.95, rest_busiest=0.95, wait_share=0.4)
    assert starved.saturated and "waited for a core 40 %" in starved.problems(None)[0]


def test_a_level_on_a_host_whose_speed_moved_is_no_valid_measurement() -> None:
    host = HostLoad(0.3, 0.5, 2, busiest=0.4, speed=700.0)
    assert host.problems(1000.0) == ["host speed moved -30% from the run's median probe"]
    assert host.problems(800.0) == [] and host.problems(None) == []


def test_warnings_name_short_streams_and_count_the_levels_left_out() -> None:
    short = _level("vllm-serve", tokens=(32, 30, 32))
    busy = _level("zerolayer", host=HostLoad(0.97, 3.0, 2))
    lagged = replace(_level("baseline"), invalid_reasons=("loader lagged: p99 2 ms > 1 ms",))
    lines = warnings([short, busy, lagged, _level("inproc")], max_tokens=32)
    assert len(lines) == 2
    assert (
        "vllm-serve at 1 in flight, repeat 1: 1 of 3 requests" in lines[0] and "30-32" in lines[0]
    )
    assert lines[1].startswith("NOTE: 2 of 4 levels were no valid measurement")
    assert rows([lagged], 32)[0]["invalid_reasons"] == ["loader lagged: p99 2 ms > 1 ms"]
    (saturated,) = rows([busy], 32)[0]["invalid_reasons"]
    assert saturated.startswith("host saturated (CPU 97 %")


def test_targets_take_turns_in_a_balanced_order_with_the_floor_first() -> None:
    kinds = [TARGET_KINDS[n] for n in ("zerolayer", "inproc", "vllm-serve")]
    names = [[k.name for k in balanced_order(kinds, r)] for r in range(3)]
    assert names[0] == ["inproc", "zerolayer", "vllm-serve"] == names[2]
    assert names[1] == ["vllm-serve", "zerolayer", "inproc"]


def _repeats(
    ours: list[tuple[float, float]], peer: list[tuple[float, float]], cpu: tuple[float, float]
) -> list[Level]:
    """Three levels per repeat: the floor, ours and vLLM's server, E2EL p50/p99 as given."""
    levels = []
    for r, (a, b) in enumerate(zip(ours, peer, strict=True)):
        levels += [
            _level("inproc", e2el=(10.0, 20.0), repeat=r),
            _level("zerolayer", e2el=a, cpu=ServerCpu(1.0, cpu[0]), repeat=r),
            _level("vllm-serve", e2el=b, cpu=ServerCpu(1.0, cpu[1]), repeat=r),
        ]
    return levels


def _status(levels: list[Level], name: str, role: Role = Role.PEER) -> Status:
    (found,) = [j for j in judge(levels, over_reference=False)
                if j.criterion.name == name and j.versus.role is role]  # fmt: skip
    return found.status


def test_the_verdict_pairs_repeats_and_holds_only_a_whole_interval_below_zero() -> None:
    better = _repeats([(11.0, 22.0), (11.2, 22.5), (10.9, 21.0)],
                      [(13.0, 25.0), (13.5, 26.0), (12.8, 24.0)], (0.096, 0.192))  # fmt: skip
    assert _status(better, "e2el_p50_ms") is Status.HELD
    assert _status(better, "layer_us_per_token") is Status.HELD
    worse = _repeats([(14.0, 26.0)] * 3, [(13.0, 25.0)] * 3, (0.3, 0.2))
    assert _status(worse, "e2el_p99_ms") is Status.NOT_HELD
    spans = _repeats([(11.0, 22.0), (14.0, 22.0), (12.0, 22.0)], [(12.5, 25.0)] * 3, (0.1, 0.2))
    assert _status(spans, "e2el_p50_ms") is Status.UNDECIDED
    (line,) = [v for v in verdict(worse) if "vllm-serve" in v]
    assert line.startswith("verdict: zerolayer against vllm-serve, vLLM's own server")
    assert (
        "e2el p99 no larger than at 1 in flight: +1.000 [+1.000, +1.000] ms (n=3) not held" in line
    )


def test_an_invalid_level_never_enters_the_verdict_or_the_figures() -> None:
    levels = _repeats([(11.0, 22.0)] * 3, [(13.0, 25.0)] * 3, (0.1, 0.2))
    saturated = HostLoad(0.99, 3.0, 2)
    levels[1] = replace(levels[1], e2el_p50_ms=500.0, host=saturated)  # ours, repeat 1
    assert _status(levels, "e2el_p50_ms") is Status.UNDECIDED  # two valid pairs are too few
    (ours,) = [sm for sm in summarize(levels) if sm.target == "zerolayer"]
    assert ours.valid == 2 and ours.repeats == 3
    assert ours.figures["e2el_p50_ms"].value == pytest.approx(11.0), "500 ms left out"
    assert "too few valid trials: 2 of the 3 needed" in " ".join(verdict(levels))


def test_the_tpot_ratio_to_the_floor_is_judged_at_one_in_flight_over_a_real_engine_only() -> None:
    levels = []
    for r in range(3):
        levels += [_level("inproc", tpot=(2.0, 3.0), repeat=r),
                   _level("zerolayer", tpot=(2.04, 3.5), repeat=r)]  # fmt: skip
    assert _status(levels, "tpot_p50_ms", Role.FLOOR) is Status.HELD
    assert not [j for j in judge(levels, over_reference=True) if j.versus.role is Role.FLOOR]
    slow = [replace(lv, tpot_p50_ms=2.2) if lv.target == "zerolayer" else lv for lv in levels]
    assert _status(slow, "tpot_p50_ms", Role.FLOOR) is Status.NOT_HELD


def test_h2c_is_judged_against_the_same_replica_over_http1_and_the_echo_only_reported() -> None:
    levels = []
    for r in range(3):
        levels += [_level("zerolayer", e2el=(1.0, 2.0), repeat=r),
                   _level("zerolayer-h1", e2el=(1.2, 2.5), repeat=r),
                   _level("h2-echo", e2el=(0.8, 1.5), repeat=r)]  # fmt: skip
    assert _status(levels, "e2el_p50_ms", Role.HTTP1) is Status.HELD
    lines = verdict(levels, over_reference=True)
    assert any(v.startswith("verdict: zerolayer against zerolayer-h1") for v in lines)
    (echo,) = [v for v in lines if "h2-echo" in v]
    assert (
        echo.startswith("what zerolayer against h2-echo")
        and "e2el p50 at 1 in flight +0.200" in echo
    )


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_engines_are_the_reference_engine_and_vllm_and_the_targets_have_roles() -> None:
    assert ENGINES == ("null", "vllm")
    roles = {name: kind.role for name, kind in TARGET_KINDS.items()}
    assert roles["inproc"] is Role.FLOOR and roles["zerolayer"] is Role.OURS
    assert roles["vllm-serve"] is Role.PEER and roles["baseline"] is Role.OTHER
    assert roles["zerolayer-h1"] is Role.HTTP1 and roles["h2-echo"] is Role.ECHO
    assert [n for n, kind in TARGET_KINDS.items() if kind.needs_vllm] == ["vllm-serve"]
    assert [n for n, kind in TARGET_KINDS.items() if kind.needs_reference] == ["h2-echo"]


def test_the_floor_is_found_by_role_not_by_name() -> None:
    renamed = replace(_level("inproc", e2el=(10.0, 20.0)), target="engine-alone")
    (_, ours) = rows([renamed, _level("zerolayer", e2el=(11.5, 24.0))], 32)
    assert ours["added_e2el_p50_ms"] == pytest.approx(1.5)
    plugin = replace(renamed, role=Role.OTHER)
    assert rows([plugin, _level("zerolayer")], 32)[1]["added_e2el_p50_ms"] is None
    (_, summary) = summarize([renamed, _level("zerolayer", e2el=(11.5, 24.0))])
    assert summary.added["e2el_p50_ms"].value == pytest.approx(1.5)


def test_over_vllm_auth_reruns_only_the_stacks_that_still_check_keys() -> None:
    over_vllm = resolve(_args("--targets", "inproc,zerolayer,baseline,vllm-serve", "--auth"))
    over_vllm = replace(over_vllm, workload=Workload(engine="vllm"))
    names = [kind.name for kind in choose_targets(over_vllm)]
    assert names == ["inproc", "zerolayer", "zerolayer+auth", "baseline", "vllm-serve"]
    over_null = replace(over_vllm, targets="zerolayer,baseline", workload=Workload())
    names = [kind.name for kind in choose_targets(over_null)]
    assert names == ["zerolayer", "zerolayer+auth", "baseline", "baseline+auth"]
    assert {kind.role for kind in choose_targets(over_null)} == {Role.OURS, Role.OTHER}


def test_unset_options_take_the_engines_defaults() -> None:
    null = resolve(_args())
    assert null.levels == (1, 16) and null.workload.max_tokens == 32 and null.rss_streams == 1000
    assert null.targets == "inproc,zerolayer,zerolayer-h1,h2-echo" and null.repeats == 3
    given_ = resolve(_args("--levels", "2", "--max-tokens", "8", "--targets", "inproc"))
    assert given_.levels == (2,) and given_.workload.max_tokens == 8
    assert null.burst and not resolve(_args("--no-burst")).burst
    assert resolve(_args("--repeats", "5")).repeats == 5
    per_request = resolve(_args("--engine-option", "per_token=false"))
    assert per_request.workload.engine_options == {"per_token": False}


def test_a_short_in_process_run_prints_its_rows_and_writes_its_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = _args("--targets", "inproc", "--duration", "0.2", "--warmup", "0.05",
                 "--levels", "1", "--rate", "100", "--rss-streams", "0", "--repeats", "2",
                 "--no-burst", "--out", str(tmp_path))  # fmt: skip
    assert run_command(args) == 0
    out = capsys.readouterr().out
    assert "2 repeats in a balanced order" in out
    levels = [line.split() for line in out.splitlines() if line.startswith("inproc ")]
    assert [lv[2] for lv in levels[-2:]] == ["1", "2"], "every level as measured, by repeat"
    assert levels[-1][4] == "20" and levels[-1][6] == "32", "the null engine streams max_tokens"
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert [r["repeat"] for r in doc["rows"]] == [1, 2]
    assert doc["rows"][0]["completed"] == 20 and doc["rows"][0]["tokens_total"] == 20 * 32
    assert doc["verdict"] == [] and doc["rates"] == {"1": 100.0}
    (summary,) = doc["summary"]
    assert summary["repeats"] == 2 and summary["e2el_p50_ms"]["n"] == summary["valid"]
    assert "| inproc | 1 |" in (tmp_path / "overhead.md").read_text()


def test_unknown_targets_and_bad_engine_use_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown targets"):
        run_command(_args("--targets", "nope"))
    with pytest.raises(UsageError, match="NAME=module:function"):
        run_command(_args("--targets", "", "--target", "broken"))
    with pytest.raises(UsageError, match="needs --engine vllm"):
        run_command(_args("--targets", "inproc,vllm-serve"))
    with pytest.raises(UsageError, match="valid options: per_token, itl_ms"):
        run_command(_args("--engine-option", "max_num_seqs=4"))
    over_vllm = replace(resolve(_args("--targets", "h2-echo")), workload=Workload(engine="vllm"))
    with pytest.raises(UsageError, match="h2-echo stands in for a replica of the null engine"):
        choose_targets(over_vllm)
    with pytest.raises(UsageError, match=r"vLLM installed|needs --engine-option model=DIR"):
        run_command(_args("--engine", "vllm"))
    with pytest.raises(UsageError, match=r"model .*absent does not exist"):
        run_command(_args("--engine", "vllm", "--engine-option", f"model={tmp_path / 'absent'}"))


def test_the_command_line_reports_a_mistake_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["overhead", "--engine", "vllm", "--targets", "inproc"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("zl-bench: error: ")
    assert len(err.strip().splitlines()) == 1
