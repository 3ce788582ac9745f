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
from bench.overhead.measure import closed_loop_rate, schedule, server_cpu
from bench.overhead.model import ENGINES, HostLoad, Level, Role, ServerCpu, Workload, added
from bench.overhead.render import rows, table, verdict, warnings
from bench.overhead.targets import TARGET_KINDS, choose_targets
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
    latency, cost = (
        next(line for line in part.splitlines() if line.startswith("zerolayer "))
        for part in text.split("\n\n")
    )
    assert latency.split()[5:] == ["-"] * 9 and "0.000" not in latency
    assert cost.split()[2] == "-" and cost.split()[5:8] == ["-"] * 3
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
    got = (plus.ttft_p50_ms, plus.ttft_p99_ms, plus.e2el_p50_ms, plus.e2el_p99_ms)
    for value, x, y in zip(got, level, floor, strict=True):
        if x is None or y is None:
            assert value is None
        else:
            assert value is not None and value + y == pytest.approx(x, abs=1e-6)
    assert added(a, None).e2el_p50_ms is None


def test_rows_subtract_the_inproc_level_of_the_same_in_flight() -> None:
    levels = [
        _level("inproc", 1, e2el=(10.0, 20.0)),
        _level("inproc", 16, e2el=(40.0, 90.0)),
        _level("zerolayer", 1, e2el=(11.5, 24.0)),
        _level("zerolayer", 16, e2el=(43.0, 100.0)),
        _level("vllm-serve", 4, e2el=(50.0, 60.0)),  # no inproc at 4: nothing to subtract
    ]
    by = {(r["target"], r["in_flight"]): r for r in rows(levels, 32)}
    assert by["zerolayer", 1]["added_e2el_p50_ms"] == pytest.approx(1.5)
    assert by["zerolayer", 16]["added_e2el_p99_ms"] == pytest.approx(10.0)
    assert by["inproc", 16]["added_e2el_p50_ms"] == 0.0
    assert by["vllm-serve", 4]["added_e2el_p50_ms"] is None


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
    assert HostLoad(0.95, 0.5, 2).saturated and HostLoad(0.2, 2.0, 2).saturated
    assert not HostLoad(0.5, 1.0, 2).saturated


def test_warnings_name_short_streams_invalid_and_saturated_levels() -> None:
    short = _level("vllm-serve", tokens=(32, 30, 32))
    busy = _level("zerolayer", host=HostLoad(0.97, 3.0, 2))
    lagged = replace(_level("baseline"), invalid_reasons=("loader lagged: p99 2 ms > 1 ms",))
    lines = warnings([short, busy, lagged, _level("inproc")], max_tokens=32)
    assert len(lines) == 3
    assert "vllm-serve at 1 in flight: 1 of 3 requests" in lines[0] and "30-32" in lines[0]
    assert "saturated during zerolayer" in lines[1]
    assert "baseline at 1 in flight is no valid latency measurement: loader lagged" in lines[2]
    assert rows([lagged], 32)[0]["invalid_reasons"] == ["loader lagged: p99 2 ms > 1 ms"]


def _pair(
    ours: tuple[float, float], peer: tuple[float, float], cpu: tuple[float, float]
) -> list[Level]:
    return [
        _level("inproc", e2el=(10.0, 20.0)),
        _level("zerolayer", e2el=ours, cpu=ServerCpu(1.0, cpu[0])),
        _level("vllm-serve", e2el=peer, cpu=ServerCpu(1.0, cpu[1])),
    ]


def test_verdict_compares_added_latency_and_layer_cpu_per_token() -> None:
    better = verdict(_pair((11.0, 22.0), (13.0, 25.0), (0.096, 0.192)))
    assert better is not None and better.startswith("verdict: zerolayer adds less latency and less")
    assert "+1.00 ms vs +3.00 ms" in better and "300 us vs 600 us" in better
    worse = verdict(_pair((14.0, 26.0), (13.0, 25.0), (0.3, 0.2)))
    assert worse is not None and "adds more latency and more layer CPU per token than" in worse
    mixed = verdict(_pair((11.0, 26.0), (13.0, 25.0), (0.1, 0.2)))
    assert mixed is not None and "adds mixed latency and less" in mixed
    missing = [_level("inproc"), _level("zerolayer", cpu=None), _level("vllm-serve", cpu=None)]
    assert "cannot be compared" in (verdict(missing) or "")
    assert verdict([_level("inproc"), _level("zerolayer")]) is None


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_engines_are_the_reference_engine_and_vllm_and_the_targets_have_roles() -> None:
    assert ENGINES == ("null", "vllm")
    roles = {name: kind.role for name, kind in TARGET_KINDS.items()}
    assert roles["inproc"] is Role.FLOOR and roles["zerolayer"] is Role.OURS
    assert roles["vllm-serve"] is Role.PEER and roles["baseline"] is Role.OTHER
    assert [n for n, kind in TARGET_KINDS.items() if kind.needs_vllm] == ["vllm-serve"]


def test_the_floor_is_found_by_role_not_by_name() -> None:
    renamed = replace(_level("inproc", e2el=(10.0, 20.0)), target="engine-alone")
    (_, ours) = rows([renamed, _level("zerolayer", e2el=(11.5, 24.0))], 32)
    assert ours["added_e2el_p50_ms"] == pytest.approx(1.5)
    plugin = replace(renamed, role=Role.OTHER)
    assert rows([plugin, _level("zerolayer")], 32)[1]["added_e2el_p50_ms"] is None


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
    assert null.levels == (1, 64) and null.workload.max_tokens == 128 and null.rss_streams == 1000
    assert null.targets == "inproc,zerolayer"
    given_ = resolve(_args("--levels", "2", "--max-tokens", "8", "--targets", "inproc"))
    assert given_.levels == (2,) and given_.workload.max_tokens == 8
    assert not null.burst and resolve(_args("--burst")).burst


def test_a_short_in_process_run_prints_its_rows_and_writes_its_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = _args("--targets", "inproc", "--duration", "0.2", "--warmup", "0.05",
                 "--levels", "1", "--rate", "100", "--rss-streams", "0",
                 "--out", str(tmp_path))  # fmt: skip
    assert run_command(args) == 0
    rows_ = [line.split() for line in capsys.readouterr().out.splitlines()]
    latency, cost = [r for r in rows_ if r and r[0] == "inproc"]
    assert latency[1] == "1" and latency[3] == "20" and latency[4] == "0"
    assert cost[2] == "128" and cost[3] == "0", "the null engine streams max_tokens"
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert doc["rows"][0]["completed"] == 20 and doc["rows"][0]["tokens_total"] == 20 * 128
    assert doc["verdict"] is None and doc["rates"] == {"1": 100.0}
    assert "| inproc | 1 |" in (tmp_path / "overhead.md").read_text()


def test_unknown_targets_and_bad_engine_use_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown targets"):
        run_command(_args("--targets", "nope"))
    with pytest.raises(UsageError, match="NAME=module:function"):
        run_command(_args("--targets", "", "--target", "broken"))
    with pytest.raises(UsageError, match="needs --engine vllm"):
        run_command(_args("--targets", "inproc,vllm-serve"))
    with pytest.raises(UsageError, match="takes no options"):
        run_command(_args("--engine-option", "max_num_seqs=4"))
    with pytest.raises(UsageError, match=r"vLLM installed|needs --engine-option model=DIR"):
        run_command(_args("--engine", "vllm"))
    with pytest.raises(UsageError, match=r"vLLM installed|not a directory"):
        run_command(_args("--engine", "vllm", "--engine-option", f"model={tmp_path / 'absent'}"))


def test_the_command_line_reports_a_mistake_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["overhead", "--engine", "vllm", "--targets", "inproc"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("zl-bench: error: ")
    assert len(err.strip().splitlines()) == 1
