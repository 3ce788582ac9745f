"""``zl-bench compare`` on real runs: regressions flagged, exit codes a CI gate can tell apart
(0 none, 1 regression, 2 error or incomparable), and runs that are not like for like refused."""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.cli import main as cli_main
from bench.report import claims, compare, compare_common, compare_sweep, load_run
from harness import schema
from tests.support.simrun import Spec, fail_everything, make_run

# 64 tokens a request: a median E2EL of about 75 ms, so the scheduling lag of a saturated host
# (CI saw 36 ms at p99 with 16 tokens and a 21 ms median) stays under the validity bar (100 % of
# the median E2EL) and the A/A pair is judged rather than refused as incomparable.
HEAVY = {"a_latency": Spec(count=40, rate=80.0, max_tokens=64)}
TRIALS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Two runs of one configuration (an A/A pair) and one with a starved engine, each of
    ``TRIALS`` trials."""
    root = tmp_path_factory.mktemp("compare")
    stacks: dict[str, int | None] = {"zerolayer": None}
    good, again, starved = (
        make_run(root / name, max_num_seqs=seqs, profiles=HEAVY, stacks=stacks, repeats=TRIALS)
        for name, seqs in (("good", 64), ("again", 64), ("starved", 1))
    )
    return good, again, starved


def _copy(run: Path, dest: Path, **meta: object) -> Path:
    shutil.copytree(run, dest)
    data = orjson.loads((dest / schema.RUN_META).read_bytes())
    (dest / schema.RUN_META).write_bytes(orjson.dumps(data | meta))
    return dest


def _edit_rows(run: Path, edit: Callable[[schema.SummaryRow], None], trials: int = 1) -> None:
    """``edit`` applied to the first ``trials`` rows of a run's summary."""
    rows = schema.read_summary(run)
    for row in rows[:trials]:
        edit(row)
    schema.write_summary(run, rows)


def test_starved_engine_is_flagged_and_exit_is_one(
    runs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    good, _, starved = runs
    assert cli_main(["compare", str(good), str(starved)]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.endswith("REGRESSION")]
    assert any("median_e2el_ms" in line for line in flagged)
    assert any("request_throughput" in line for line in flagged), "it fell behind the load"
    assert all("median_itl_ms" not in line for line in flagged), "a batch of one steps faster"
    assert "Welch interval of B-A over trials" in out
    result = compare.compare_runs(load_run(good), load_run(starved))
    e2el = next(r for r in result.rows if r.metric == "median_e2el_ms")
    assert e2el.diff is not None and e2el.ci_low is not None and e2el.ci_high is not None
    assert e2el.regression and 0 < e2el.ci_low <= e2el.diff <= e2el.ci_high
    assert result.verdict is compare.Verdict.REGRESSION


def test_two_runs_of_one_configuration_are_no_regression(runs: tuple[Path, Path, Path]) -> None:
    """A/A: the same configuration twice; the intervals over trials hold the difference."""
    good, again, _ = runs
    result = compare.compare_runs(load_run(good), load_run(again))
    assert result.rows and not result.incomparable and not result.regressions
    assert compare.main(good, again) == 0


def test_an_improvement_is_not_flagged(runs: tuple[Path, Path, Path]) -> None:
    good, _, starved = runs
    assert compare.main(starved, good) == 0


def test_a_run_against_itself_says_so(
    runs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    good, _, _ = runs
    result = compare.compare_runs(load_run(good), load_run(good))
    assert result.rows and not any(r.regression for r in result.rows)
    assert all(r.diff == 0 for r in result.rows)
    assert any("same run" in note for note in result.notes)
    assert cli_main(["compare", str(good), str(good)]) == 0
    assert "A and B are the same run" in capsys.readouterr().out


def test_a_fall_to_zero_completions_is_a_regression(
    runs: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, _, _ = runs
    down = fail_everything(_copy(good, tmp_path / "down"))
    out_json = tmp_path / "verdict.json"
    code = cli_main(["compare", str(good), str(down), "--json", str(out_json)])
    assert code == 1
    result = compare.compare_runs(load_run(good), load_run(down))
    latency = next(r for r in result.rows if r.metric == "median_e2el_ms")
    assert latency.b is None and not latency.regression, "no latency, not a -100 % latency"
    assert any(r.metric == "completed" and r.regression for r in result.rows)
    verdict = orjson.loads(out_json.read_bytes())
    assert verdict["verdict"] == "regression" and verdict["exit_status"] == 1
    assert "n/a" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("field", "value"),
    [("scale", "laptop"), ("config", {"seed": 99}), ("engine", {"name": "null"})],
)
def test_runs_that_differ_are_refused_unless_forced(
    runs: tuple[Path, Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    field: str,
    value: object,
) -> None:
    good, _, _ = runs
    other = _copy(good, tmp_path / "other", **{field: value})
    assert cli_main(["compare", str(good), str(other)]) == 2
    out = capsys.readouterr().out
    assert "incomparable:" in out and "--force" in out
    assert cli_main(["compare", str(good), str(other), "--force"]) == 0


def test_hosts_of_different_speeds_are_incomparable(
    runs: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, again, _ = runs
    fast = _copy(good, tmp_path / "fast", machine={"cpu_speed_start": 1_000_000})
    slow = _copy(again, tmp_path / "slow", machine={"cpu_speed_start": 600_000})
    _edit_rows(slow, lambda r: setattr(r, "host_speed", 600_000.0), TRIALS)
    assert cli_main(["compare", str(fast), str(slow)]) == 2
    assert "the hosts ran at different speeds" in capsys.readouterr().out


def test_a_flagged_trial_decides_nothing(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """Two flagged trials of four leave B two valid ones: incomparable, naming the trials; a
    host saturated in one core counts the same."""
    good, _, starved = runs
    for name, edit in (
        ("lagged", lambda r: setattr(r, "loader_limited", True)),
        ("busy", lambda r: setattr(r, "host_busiest_cpu_pct", 100.0)),
    ):
        bad = _copy(starved, tmp_path / name)
        _edit_rows(bad, edit, trials=2)
        result = compare.compare_runs(load_run(good), load_run(bad))
        assert result.verdict is compare.Verdict.INCOMPARABLE, name
        assert any("run B has too few valid trials: 2 of the 3 needed (trial 0: " in n
                   for n in result.incomparable), result.incomparable  # fmt: skip
        assert compare.main(good, bad) == 2


def test_stacks_in_only_one_run_are_noted(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    good, _, _ = runs
    other = make_run(
        tmp_path / "other",
        profiles={"d_fault": Spec(count=6, rate=40.0)},
        stacks={"zerolayer": None},
    )
    result = compare.compare_runs(load_run(good), load_run(other))
    assert not result.rows
    assert sorted(n for n in result.notes if "only in run" in n) == [
        "zerolayer/a_latency: only in run A, not compared",
        "zerolayer/d_fault: only in run B, not compared",
    ]
    assert compare.main(good, other) == 2


def test_each_runs_claims_are_read_from_its_claims_json(
    runs: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """compare shows the claims as each run's claims.json decided them, a changed verdict
    marked; a claim is about the stacks, not a change, so it never sets the exit status."""
    good, again, _ = runs
    a, b = _copy(good, tmp_path / "a"), _copy(again, tmp_path / "b")
    held = claims.ClaimResult("layer_overhead", "c", "80-150 ms", "+90 ms", claims.HELD, "r")
    claims.write(a, [held])
    claims.write(b, [dataclasses.replace(held, status=claims.UNDECIDED, measured="+9 ms")])
    assert cli_main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"layer_overhead\s+held\s+undecided\s+CHANGED", out), out
    (b / claims.CLAIMS_FILE).unlink()
    result = compare.compare_runs(load_run(a), load_run(b))
    assert not result.claims
    assert any(f"run B has no {claims.CLAIMS_FILE}" in n for n in result.notes)


@pytest.mark.parametrize(("flag", "value"), [("--confidence", "95"), ("--threshold", "-1")])
def test_bad_settings_are_one_error_line(
    runs: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    good, _, _ = runs
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", str(good), str(good), flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zl-bench: error: ") and err.count("\n") == 1 and flag in err


def test_a_missing_run_is_an_error_not_a_regression(
    runs: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, _, _ = runs
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", str(good), str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "no results directory" in capsys.readouterr().err


def test_the_sweep_names_stay_importable_from_compare() -> None:
    """compare re-exports compare_sweep's public names (the very objects, not copies) and
    compare_sweep never imports compare: one direction, no cycle."""
    swept = [name for name in compare.__all__ if hasattr(compare_sweep, name)]
    assert {"Flag", "Span", "judge", "compare_sweeps", "POINT_METRICS"} <= set(swept)
    assert all(getattr(compare, name) is getattr(compare_sweep, name) for name in swept)
    assert compare.Metric is compare_common.Metric is compare_sweep.Metric
    assert not hasattr(compare_sweep, "compare")


measured = st.floats(-1e6, 1e6, allow_nan=False) | st.none()


@given(measured, measured)
def test_relative_change_is_the_difference_over_a(a: float | None, b: float | None) -> None:
    diff, change = compare_common.difference(a, b), compare_common.relative_change(a, b)
    if a is None or b is None:
        assert diff is None and change is None
        return
    assert diff == b - a
    if a:
        assert change == pytest.approx(diff / abs(a))
    else:
        assert change == (0.0 if b == 0 else math.inf)
