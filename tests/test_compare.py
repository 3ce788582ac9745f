"""``zl-bench compare`` on two real runs, one with a starved engine: the regression is flagged."""

from __future__ import annotations

from pathlib import Path

import pytest
from simrun import Spec, make_run

from bench.cli import main as cli_main
from bench.report import compare, load_run

HEAVY = {"a_latency": Spec(count=20, rate=80.0, max_tokens=16)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("compare")
    stacks = {"zerolayer": None}
    good = make_run(root / "good", max_num_seqs=64, profiles=HEAVY, stacks=stacks)
    starved = make_run(root / "starved", max_num_seqs=1, profiles=HEAVY, stacks=stacks)
    return good, starved


def test_starved_engine_is_flagged_and_exit_is_nonzero(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    good, starved = runs
    assert cli_main(["compare", str(good), str(starved), "--bootstrap", "300"]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.endswith("REGRESSION")]
    assert any("median_e2el_ms" in line for line in flagged)
    assert any("request_throughput" in line for line in flagged), "it fell behind the load"
    assert all("median_itl_ms" not in line for line in flagged), "a batch of one steps faster"
    rows, _ = compare.compare_runs(load_run(good), load_run(starved), n_boot=300)
    e2el = next(r for r in rows if r.metric == "median_e2el_ms")
    assert e2el.regression and 0 < e2el.ci_low <= e2el.diff <= e2el.ci_high


def test_the_same_run_and_an_improvement_are_not_flagged(runs: tuple[Path, Path]) -> None:
    good, starved = runs
    rows, notes = compare.compare_runs(load_run(good), load_run(good), n_boot=200)
    assert rows and not notes
    assert not any(r.regression for r in rows)
    assert all(r.diff == 0 and r.ci_low <= 0 <= r.ci_high for r in rows)
    assert compare.main(starved, good, n_boot=200) == 0


def test_stacks_in_only_one_run_are_noted(runs: tuple[Path, Path], tmp_path: Path) -> None:
    good, _ = runs
    other = make_run(
        tmp_path / "other",
        profiles={"d_fault": Spec(count=6, rate=40.0)},
        stacks={"zerolayer": None},
    )
    rows, notes = compare.compare_runs(load_run(good), load_run(other), n_boot=50)
    assert not rows
    assert sorted(notes) == [
        "zerolayer/a_latency: only in run A, not compared",
        "zerolayer/d_fault: only in run B, not compared",
    ]
    assert compare.main(good, other, n_boot=50) == 2
