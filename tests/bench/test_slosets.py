"""A run judged against a named SLO set (seed 000's five): each objective per trial, an interval
over valid trials, met / missed / undecided / needs a GPU; the report's --slo-set."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.cli import main as cli_main
from bench.report import claims, slosets
from bench.report.data import RunData
from bench.report.verdicts import Status
from harness.runner.trials import trial_phase
from harness.schema import Machine, RunMeta
from harness.slosets import SEED000, Figure, slo_set
from tests.bench.test_claims import SPEED, row
from tests.support.simrun import Spec, make_run


@dataclasses.dataclass(frozen=True)
class Trial:
    p99_ttft: float = 120.0
    failed: int = 0
    kv_waste: float = 0.05
    gpu_util: float | None = None
    nvlink: tuple[int, int] | None = None  # the counters at the trial's start and end


def slo_run(trials: Sequence[Trial], **fields: Any) -> RunData:
    """The zero-layer stack's trials of profile A, with engine (and maybe NVML) telemetry."""
    summaries, phases, telemetry = [], [], []
    for k, trial in enumerate(trials):
        window = (k * 20 * 10**9, (k * 20 + 10) * 10**9)
        name = trial_phase("zerolayer", "a_latency", k)
        phases += [
            {"kind": "phase", "name": name, "event": e, "t_ns": t}
            for e, t in zip(("start", "end"), window, strict=True)
        ]
        base = row("zerolayer", 600.0, repeat=k, failed=trial.failed, **fields)
        summaries.append(
            dataclasses.replace(base, stats={**base.stats, "p99_ttft_ms": trial.p99_ttft})
        )
        for t in window:
            telemetry.append({"source": "engine", "stack": "zerolayer", "t_ns": t,
                              "kv_blocks_used": 10, "kv_waste": trial.kv_waste})  # fmt: skip
            if trial.gpu_util is not None or trial.nvlink is not None:
                nvlink = None if trial.nvlink is None else trial.nvlink[t == window[1]]
                gpu = {"gpu_util_pct": trial.gpu_util, "nvlink_errors": nvlink}
                telemetry.append({"source": "nvml", "name": "gpu0", "t_ns": t, **gpu})
    meta = RunMeta("t", machine=Machine(cpus=2, cpu_speed_start=SPEED))
    return RunData(Path("/nonexistent"), meta, {}, summaries, telemetry, phases, [])


def objectives(run: RunData) -> dict[Figure, slosets.ObjectiveResult]:
    got = slosets.judge(run, SEED000, "zerolayer", "a_latency")
    return {o.figure: r for o, r in zip(SEED000.objectives, got.objectives, strict=True)}


def test_a_stack_within_every_bound_meets_the_set_and_the_gpu_ones_need_a_gpu() -> None:
    run = slo_run([Trial(p99_ttft=100.0 + 10 * k) for k in range(3)])
    got = objectives(run)
    assert got[Figure.P99_TTFT_MS].status is Status.HELD
    assert got[Figure.P99_TTFT_MS].figure.per_repeat == (100.0, 110.0, 120.0)
    assert got[Figure.ERROR_PCT].status is Status.HELD
    assert got[Figure.KV_WASTE_PCT].status is Status.HELD
    assert got[Figure.KV_WASTE_PCT].figure.value == pytest.approx(5.0)
    for gpu in (Figure.GPU_UTIL_PCT, Figure.NVLINK_ERRORS):
        assert got[gpu].status is Status.NOT_MEASURED and got[gpu].reason == slosets.NEEDS_GPU
    assert slosets.judge(run, SEED000, "zerolayer", "a_latency").status is Status.HELD


def test_a_bound_surely_crossed_is_missed_and_decides_the_set() -> None:
    slow = slo_run([Trial(p99_ttft=400.0 + k) for k in range(3)])
    assert objectives(slow)[Figure.P99_TTFT_MS].status is Status.NOT_HELD
    assert slosets.judge(slow, SEED000, "zerolayer", "a_latency").status is Status.NOT_HELD
    failing = objectives(slo_run([Trial(failed=10 + k) for k in range(3)]))
    assert failing[Figure.ERROR_PCT].status is Status.NOT_HELD, "5 % of 200 requests failed"
    fragmented = objectives(slo_run([Trial(kv_waste=0.3 + 0.01 * k) for k in range(3)]))
    assert fragmented[Figure.KV_WASTE_PCT].status is Status.NOT_HELD


def test_on_a_gpu_host_utilisation_and_nvlink_are_judged() -> None:
    busy = objectives(slo_run([Trial(gpu_util=80.0 + k, nvlink=(5, 5)) for k in range(3)]))
    assert busy[Figure.GPU_UTIL_PCT].status is Status.HELD
    assert busy[Figure.NVLINK_ERRORS].status is Status.HELD, "the counters did not rise"
    lossy = objectives(slo_run([Trial(gpu_util=30.0 + k, nvlink=(5, 9)) for k in range(3)]))
    assert lossy[Figure.GPU_UTIL_PCT].status is Status.NOT_HELD
    assert lossy[Figure.NVLINK_ERRORS].status is Status.NOT_HELD
    assert lossy[Figure.NVLINK_ERRORS].figure.value == 4.0


def test_each_undecided_reason() -> None:
    two = objectives(slo_run([Trial(), Trial()]))[Figure.P99_TTFT_MS]
    assert two.status is Status.UNDECIDED and "too few valid trials: 2 of the 3" in two.reason
    hot = objectives(slo_run([Trial()] * 3, host_saturated=True))[Figure.P99_TTFT_MS]
    assert hot.status is Status.UNDECIDED and "host saturated" in hot.reason
    near = objectives(slo_run([Trial(p99_ttft=t) for t in (150.0, 200.0, 250.0)]))
    assert near[Figure.P99_TTFT_MS].status is Status.UNDECIDED
    assert near[Figure.P99_TTFT_MS].reason == claims.SPANS


def test_a_trial_whose_host_speed_moved_says_so() -> None:
    # The run's first probe (as it started) is the reference; the first trial's own probe is
    # not: the reason must be judged against the same reference as the trial's validity.
    run = slo_run([Trial()] * 3)
    run.summaries[0] = dataclasses.replace(run.summaries[0], host_speed=0.7 * SPEED)
    got = objectives(run)[Figure.P99_TTFT_MS]
    assert got.status is Status.UNDECIDED
    assert "trial 0: host speed moved -30% from the run's first probe" in got.reason


def test_the_seed_claim_is_the_zero_layer_stack_against_seed000() -> None:
    held = claims.seed_slos(slo_run([Trial(p99_ttft=100.0 + k) for k in range(3)]))
    assert held.status is Status.HELD and held.trials == 3
    assert "GPU utilisation > 75 %: - (not measured)" in held.measured
    assert claims.seed_slos(slo_run([Trial(p99_ttft=900.0 + k) for k in range(3)])).status is (
        Status.NOT_HELD
    )


def test_an_unknown_set_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="no SLO set 'seed999'; the sets are: seed000"):
        slo_set("seed999")


def test_the_report_judges_a_saved_run_against_a_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = make_run(tmp_path / "run", profiles={"a_latency": Spec(count=12, rate=40.0)})
    assert cli_main(["report", str(run_dir), "--slo-set", "seed000"]) == 0
    written = orjson.loads((run_dir / "slo-seed000.json").read_bytes())
    assert {(r["stack"], r["profile"]) for r in written} == {
        ("zerolayer", "a_latency"),
        ("baseline", "a_latency"),
    }
    assert [o["text"] for o in written[0]["objectives"]] == [o.text for o in SEED000.objectives]
    assert "SLO set seed000" in (run_dir / "report.html").read_text()
    with pytest.raises(SystemExit) as bad:
        cli_main(["report", str(run_dir), "--slo-set", "seed999"])
    assert bad.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
