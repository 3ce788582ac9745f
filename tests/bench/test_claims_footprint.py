"""The footprint claims (layer CPU, layer memory, per-node CPU and memory) from process telemetry.

Each run here is built by hand: per repeat, a zero-layer and a baseline trial of profile A with
their phase windows and psutil rows for every process of each stack, so each verdict (held, not
held, and each undecided reason) follows from figures the test chose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.report import claims
from bench.report.claims import footprint
from bench.report.data import RunData
from harness.runner.trials import trial_phase
from harness.schema import Machine, RunMeta
from harness.telemetry.usage import phase_windows, stack_usage
from tests.bench.test_claims import SPEED, row

GB = 1e9
WINDOW_S = 10.0


@dataclasses.dataclass(frozen=True)
class Trial:
    """One repeat's figures: the baseline's layer and engine CPU seconds and memory (GB), the
    zero-layer replicas' CPU seconds and memory."""

    layer_cpu: float = 4.0
    engine_cpu: float = 6.0
    layer_gb: float = 1.0
    engine_gb: float = 1.0
    zl_cpu: float = 1.0
    zl_gb: float = 0.3


def _process(
    stack: str, name: str, role: str, window: tuple[int, int], cpu: float, gb: float
) -> list[dict[str, Any]]:
    return [
        {"source": "process", "stack": stack, "name": name, "role": role, "t_ns": t,
         "cpu_s": 100.0 + (cpu if t == window[1] else 0.0), "rss_bytes": gb * GB}
        for t in window
    ]  # fmt: skip


def usage_run(trials: Sequence[Trial], **fields: Any) -> RunData:
    """A plain run of profile A: one zero-layer and one baseline trial per repeat."""
    summaries, phases, telemetry = [], [], []
    for k, trial in enumerate(trials):
        for s, stack in enumerate(("zerolayer", "baseline")):
            start = int((k * 2 + s) * 20 * 1e9)
            window = (start, start + int(WINDOW_S * 1e9))
            name = trial_phase(stack, "a_latency", k)
            phases += [{"kind": "phase", "name": name, "event": e, "t_ns": t}
                       for e, t in zip(("start", "end"), window, strict=True)]  # fmt: skip
            summaries.append(row(stack, 600.0, repeat=k, **fields))
            if stack == "zerolayer":
                telemetry += _process(stack, "zl-0", "replica", window, trial.zl_cpu, trial.zl_gb)
                continue
            for role, share in (("proxy", 0.25), ("orchestrator", 0.5), ("ray", 0.25)):
                telemetry += _process(stack, f"b-{role}", role, window,
                                      share * trial.layer_cpu, share * trial.layer_gb)  # fmt: skip
            telemetry += _process(stack, "b-engine", "engine", window, trial.engine_cpu,
                                  trial.engine_gb)  # fmt: skip
            telemetry += _process("", "loader", "loader", window, 50.0, 5.0)
    meta = RunMeta("t", machine=Machine(cpus=2, cpu_speed_start=SPEED))
    return RunData(Path("/nonexistent"), meta, {}, summaries, telemetry, phases, [])


def verdicts(run: RunData) -> dict[str, claims.ClaimResult]:
    return {c.key: c for c in (footprint.layer_cpu_share(run), footprint.layer_memory_share(run),
                               footprint.node_footprint(run))}  # fmt: skip


def test_usage_counts_every_process_of_the_stack_and_never_the_loader() -> None:
    run = usage_run([Trial(layer_cpu=4.0, engine_cpu=6.0, layer_gb=1.0, engine_gb=3.0)])
    window = phase_windows(run.phases)[trial_phase("baseline", "a_latency", 0)]
    usage = stack_usage(run.telemetry, "baseline", window, cores=2)
    assert usage is not None
    assert usage.cpu_s == pytest.approx(10.0) and usage.layer_cpu_s == pytest.approx(4.0)
    assert usage.cpu_pct == pytest.approx(50.0), "10 CPU seconds over 10 s of two cores"
    assert usage.layer_cpu_share == pytest.approx(0.4)
    assert usage.rss_bytes == pytest.approx(4 * GB) and usage.layer_rss_share == pytest.approx(0.25)
    assert usage.processes == 4 and usage.layer_processes == 3


def test_a_layer_inside_the_claimed_band_is_held_and_outside_it_is_not() -> None:
    held = verdicts(usage_run([Trial(layer_cpu=4.0 + 0.1 * k) for k in range(3)]))
    assert held["layer_cpu"].status == claims.HELD, held["layer_cpu"].measured
    assert held["layer_memory"].status == claims.HELD, "1 GB of 2: 50 %"
    assert held["layer_cpu"].trials == 3 and "(a_latency)" in held["layer_cpu"].measured
    light = verdicts(usage_run([Trial(layer_cpu=0.5 + 0.05 * k, layer_gb=0.1) for k in range(3)]))
    assert light["layer_cpu"].status == claims.NOT_HELD, "about 8 %: under 19 %"
    assert light["layer_memory"].status == claims.NOT_HELD, "about 9 %: under 20.5 %"
    heavy = verdicts(usage_run([Trial(layer_cpu=60.0 + k, engine_cpu=1.0) for k in range(3)]))
    assert heavy["layer_cpu"].status == claims.NOT_HELD, "about 98 %: over 76 %, not 'up to 38'"


def test_each_undecided_reason_of_the_layer_claims() -> None:
    two = verdicts(usage_run([Trial(), Trial()]))["layer_cpu"]
    assert two.status == claims.UNDECIDED and "too few valid trials: 2 of the 3" in two.reason
    lagged = verdicts(usage_run([Trial()] * 3, loader_limited=True))["layer_cpu"]
    assert lagged.status == claims.UNDECIDED
    assert "baseline a_latency trial 0: the loader could not keep to its schedule" in lagged.reason
    hot = verdicts(usage_run([Trial()] * 3, host_saturated=True))["layer_cpu"]
    assert hot.status == claims.UNDECIDED and "host saturated" in hot.reason
    spans = verdicts(usage_run([Trial(layer_cpu=c) for c in (1.0, 2.5, 4.0)]))["layer_cpu"]
    assert spans.status == claims.UNDECIDED and spans.reason == claims.SPANS
    bare = dataclasses.replace(usage_run([Trial()] * 3), telemetry=[])
    assert {c.status for c in verdicts(bare).values()} == {claims.NOT_MEASURED}


def test_the_node_footprint_claim_compares_whole_stacks_per_paired_trial() -> None:
    """Seed 002: 68 % vs 12 % CPU (5.7x) and 12.4 vs 3.1 GB (4x) per node; held at half each."""
    heavy = [
        Trial(layer_cpu=4.0, engine_cpu=6.0 + 0.2 * k, zl_cpu=2.0, zl_gb=0.4) for k in range(3)
    ]
    node = verdicts(usage_run(heavy))["node_footprint"]
    assert node.status == claims.HELD, node.measured  # CPU 5x, memory 5x
    assert node.figures["cpu_ratio"].value == pytest.approx(5.1, rel=0.01)
    assert node.figures["base_memory_gb"].value == pytest.approx(2.0)
    assert "baseline vs zero-layer" in node.measured and "3 paired trials" in node.measured
    alike = [Trial(zl_cpu=10.0 - 0.1 * k, zl_gb=2.0) for k in range(3)]
    assert verdicts(usage_run(alike))["node_footprint"].status == claims.NOT_HELD
    few = verdicts(usage_run(heavy[:2]))["node_footprint"]
    assert few.status == claims.UNDECIDED and "too few valid trials" in few.reason


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.1, 50.0), min_size=3, max_size=6), st.floats(0.1, 50.0))
def test_the_layer_share_is_what_the_processes_spent(layers: list[float], engine: float) -> None:
    """Whatever the figures, the claim's per-trial points are layer / (layer + engine)."""
    got = verdicts(usage_run([Trial(layer_cpu=c, engine_cpu=engine) for c in layers]))
    points = got["layer_cpu"].figures["share_pct"].per_repeat
    assert points == pytest.approx([100 * c / (c + engine) for c in layers])
