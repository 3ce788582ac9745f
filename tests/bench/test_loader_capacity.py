"""The loader-capacity command runs end to end (figures themselves are measured, not asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.loader_capacity import add_arguments, run_command
from harness.errors import UsageError


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zl-bench capacity")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_capacity_writes_a_row_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "capacity.json"
    argv = ["--loaders", "native,k6-http1", "--rates", "40", "--seconds", "1", "--repeats", "2",
            "--out", str(out)]  # fmt: skip
    assert run_command(_args(argv)) == 0
    rows = json.loads(out.read_text())
    assert [(r["loader"], r["repeat"]) for r in rows] == [
        ("native", 0), ("native", 1), ("k6-http1", 0), ("k6-http1", 1)
    ]  # fmt: skip
    for row in rows:
        assert row["scheduled"] == 40
        # Every request completes, unless k6 itself fell behind on a busy host and dropped an
        # iteration: then the row names the drop and the rate is never called sustained.
        dropped = any("dropped" in reason for reason in row["invalid_reasons"])
        assert row["completed"] == 40 or (dropped and not row["sustained"]), row
        # A run is only called sustained when it is also valid by the lag rule it applies.
        assert not row["sustained"] or row["p99_lag_ms"] < 2.0
        # Null-engine runs judge lag by the absolute 1 ms rule only (no % of median rule).
        assert row["valid"] == (row["p99_lag_ms"] <= 1.0), row["invalid_reasons"]
        # CPU per request: the replica's always, the loader's own only where it is measured.
        assert row["replica_cpu_us"] > 0
        if row["loader"] == "native":
            assert row["loader_cpu_us"] > 0 and row["protocol"] == "h2"
        else:  # k6-http1: k6 against a plaintext replica speaks HTTP/1.1
            assert row["loader_cpu_us"] is None and row["protocol"] == "http/1.1"
    lines = capsys.readouterr().out.splitlines()
    head = lines.index("loader   rate/s runs best p99 lag ms worst p99 lag ms")
    lag_rows = [line.split() for line in lines[head + 1 : head + 3]]
    assert [r[:3] for r in lag_rows] == [["native", "40", "2"], ["k6-http1", "40", "2"]]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--loaders", "wrk"], "--loaders"),
        (["--loaders", ""], "--loaders"),
        (["--rates", "fast"], "--rates"),
        (["--rates", "100,-5"], "--rates"),
        (["--seconds", "0"], "--seconds"),
        (["--repeats", "0"], "--repeats"),
        (["--max-tokens", "-1"], "--max-tokens"),
    ],
)
def test_mistakes_are_usage_errors_naming_the_flag(argv: list[str], names: str) -> None:
    with pytest.raises(UsageError, match=names):
        run_command(_args(argv))
