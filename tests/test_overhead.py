"""``zl-bench overhead``: its schedule, its table, and a short in-process run end to end."""

from __future__ import annotations

import argparse

import pytest

from bench.overhead import Level, Workload, add_arguments, run_command, schedule, table
from harness.errors import UsageError


def test_schedule_is_evenly_spaced_or_in_bursts() -> None:
    even = schedule(Workload(), 4, rate=100.0, duration_s=1.0, burst=False)
    assert len(even) == 100 and even[1].offset_s == pytest.approx(0.01)
    burst = schedule(Workload(), 4, rate=100.0, duration_s=1.0, burst=True)
    assert len(burst) == 100 and {r.offset_s for r in burst[:4]} == {0.0}
    assert burst[4].offset_s == pytest.approx(0.04)


def test_table_shows_missing_figures_as_dashes_not_zero() -> None:
    floor = Level("inproc", 1, 10, 0, 0.2, 0.5, 0.1, 300.0, None)
    empty = Level("zerolayer", 1, 0, 10, None, None, None, 400.0, 10.0, {"refused": 10})
    text = table([floor, empty])
    row = next(line for line in text.splitlines() if line.startswith("zerolayer "))
    assert row.split()[4:9] == ["-"] * 5 and "0.000" not in row
    assert "errors {'refused': 10}" in text


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_short_in_process_run_prints_its_row(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--targets", "inproc", "--duration", "0.2", "--warmup", "0.05",
                 "--levels", "1", "--rate", "100", "--rss-streams", "0")  # fmt: skip
    assert run_command(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    row = next(r for r in rows if r and r[0] == "inproc")
    assert row[1] == "1" and row[2] == "20" and row[3] == "0"


def test_unknown_targets_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown targets"):
        run_command(_args("--targets", "nope"))
    with pytest.raises(UsageError, match="NAME=module:function"):
        run_command(_args("--targets", "", "--target", "broken"))
