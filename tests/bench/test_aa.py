"""``zl-bench aa``: the false-alarm rate of ``compare``, from pairs of runs of one configuration."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import aa
from bench.report.compare import Verdict
from tests.support.simrun import Spec, make_run

PROFILE = {"a_latency": Spec(count=40, rate=80.0, max_tokens=16)}


def _pair(verdict: Verdict) -> aa.Pair:
    return aa.Pair("a", "b", verdict)


@given(st.lists(st.sampled_from(list(Verdict)), max_size=30))
def test_the_rate_counts_alarms_over_comparable_pairs_only(verdicts: list[Verdict]) -> None:
    result = aa.AaResult(0.1, 0.95, [_pair(v) for v in verdicts])
    rate, low, high = result.rate()
    comparable = [v for v in verdicts if v is not Verdict.INCOMPARABLE]
    if not comparable:
        assert rate is None and "no comparable pair" in result.line()
        return
    alarms = comparable.count(Verdict.REGRESSION)
    assert rate == alarms / len(comparable)
    assert low is not None and high is not None and low <= rate <= high
    assert f"false alarms {alarms} of {len(comparable)}" in result.line()


def test_two_runs_of_one_configuration_are_judged_by_compare(tmp_path: Path) -> None:
    """The in-process double of a run, twice with one configuration, once with a starved
    engine: the first pair is no alarm, the second a regression (what a real change is)."""
    stacks: dict[str, int | None] = {"zerolayer": None}
    runs = {
        name: make_run(
            tmp_path / name, max_num_seqs=seqs, profiles=PROFILE, stacks=stacks, repeats=4
        )
        for name, seqs in (("a", 64), ("b", 64), ("starved", 1))
    }
    same = aa._judge(runs["a"], runs["b"], 0.10, 0.95)
    changed = aa._judge(runs["a"], runs["starved"], 0.10, 0.95)
    assert same.verdict is Verdict.NO_REGRESSION and not same.flagged
    assert changed.verdict is Verdict.REGRESSION
    assert "zerolayer/a_latency median_e2el_ms" in changed.flagged


@pytest.mark.slow
def test_the_command_runs_its_pairs_and_writes_aa_json(tmp_path: Path) -> None:
    """One real pair: two smoke runs of profile A on the zero-layer stack (3 trials each)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cli", "aa", "--pairs", "1", "--scale", "smoke",
         "--stacks", "zerolayer", "--replicas", "1", "--quiet", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (root,) = tmp_path.glob("aa-*")
    data = orjson.loads((root / aa.AA_FILE).read_bytes())
    (pair,) = data["pairs"]
    assert pair["verdict"] in [int(v) for v in Verdict]
    assert Path(pair["a"]).is_dir() and Path(pair["b"]).is_dir() and pair["a"] != pair["b"]
    assert data["summary"] in proc.stdout


def test_a_run_stopped_by_a_signal_stops_the_check_with_its_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or SIGTERM) during one of the check's runs stops that run cleanly (it returns
    130 or 143): the check must stop there too, keep the pairs it judged, and exit with the
    run's status, not go on to the next run."""
    calls: list[str] = []

    def stopped_run(config: aa.RunConfig) -> int:
        calls.append(config.out)
        (Path(config.out) / "r").mkdir(parents=True)
        (Path(config.out) / "r" / aa.schema.RUN_META).write_text("{}")
        return 130

    monkeypatch.setattr(aa.bench_run, "run", stopped_run)
    parser = argparse.ArgumentParser()
    aa.add_arguments(parser)
    args = parser.parse_args(["--pairs", "3", "--stacks", "zerolayer", "--out", str(tmp_path)])
    assert aa.run_command(args) == 130
    assert len(calls) == 1, calls
