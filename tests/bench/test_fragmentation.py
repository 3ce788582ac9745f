"""Seed 003's comparison: the fixed-shape configuration against the engine's defaults on one
stack (``zl-bench fragmentation``), and the claim judged on its paired trials."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench import fragmentation as frag
from bench.cli import main as cli_main
from bench.report import claims, load_run
from bench.report.claims.fragmentation import NO_COMPARISON, fragmentation
from bench.report.data import RunData
from bench.report.verdicts import Status
from harness import schema
from harness.profile import load_profile
from harness.runner.config import RunConfig
from harness.runner.trials import trial_phase
from harness.schema import Machine, RunMeta
from harness.variants import ENGINE_DEFAULTS, FIXED_SHAPES, TRUNCATED
from serving.engine.tokenrules import BYTES_RULE
from tests.bench.test_claims import SPEED, row

FIXED, DEFAULT = FIXED_SHAPES.name, ENGINE_DEFAULTS.name


def frag_run(
    pairs: Sequence[tuple[float | None, float | None, float, float]], **fields: object
) -> RunData:
    """Per repeat: (fixed waste, default waste, fixed P95 spread, default P95 spread), with the
    engine samples of each trial's window and its row."""
    summaries, phases, telemetry = [], [], []
    for k, (fixed_waste, default_waste, fixed_spread, default_spread) in enumerate(pairs):
        for s, (name, waste, spread) in enumerate(
            ((FIXED, fixed_waste, fixed_spread), (DEFAULT, default_waste, default_spread))
        ):
            start = (k * 2 + s) * 20 * 10**9
            window = (start, start + 10 * 10**9)
            phase = trial_phase(name, "c_mixed", k)
            phases += [
                {"kind": "phase", "name": phase, "event": e, "t_ns": t}
                for e, t in zip(("start", "end"), window, strict=True)
            ]
            base = row(name, 500.0, repeat=k, profile="c_mixed", **fields)  # type: ignore[arg-type]
            stats = {**base.stats, "median_e2el_ms": 500.0, "p95_e2el_ms": 500.0 + spread}
            summaries.append(dataclasses.replace(base, stats=stats))
            kv = {"kv_blocks_used": 8, "kv_waste": None if waste is None else waste / 100}
            telemetry += [
                {"source": "engine", "stack": "zerolayer", "t_ns": t, **kv} for t in window
            ]
    meta = RunMeta("t", machine=Machine(cpus=2, cpu_speed_start=SPEED))
    return RunData(Path("/nonexistent"), meta, {}, summaries, telemetry, phases, [])


def test_the_seeds_figures_hold_and_paged_kv_that_removes_them_does_not() -> None:
    seed = fragmentation(frag_run([(4.0, 31.0 + k, 100.0, 380.0 + k) for k in range(3)]))
    assert seed.status is Status.HELD, seed.measured
    assert seed.figures["waste_ratio"].value == pytest.approx(7.75 + 0.25, rel=0.01)
    assert "allocator split needs a GPU" in seed.measured and seed.trials == 3
    paged = fragmentation(frag_run([(1.1, 1.0 + 0.01 * k, 300.0, 301.0 + k) for k in range(3)]))
    assert paged.status is Status.NOT_HELD, "paged KV leaves nothing to cut: a finding"
    tail_only = fragmentation(frag_run([(4.0, 31.0 + k, 300.0, 300.0 + k) for k in range(3)]))
    assert tail_only.status is Status.NOT_HELD, "both parts must hold"


def test_each_undecided_reason_and_what_is_not_measured() -> None:
    two = fragmentation(frag_run([(4.0, 31.0, 100.0, 380.0)] * 2))
    assert two.status is Status.UNDECIDED and "too few valid trials: 2 of the 3" in two.reason
    hot = fragmentation(frag_run([(4.0, 31.0, 100.0, 380.0)] * 3, host_saturated=True))
    assert hot.status is Status.UNDECIDED and "host saturated" in hot.reason
    near = fragmentation(frag_run([(4.0, w, 100.0, 380.0) for w in (8.0, 16.0, 24.0)]))
    assert near.status is Status.UNDECIDED and near.reason == claims.SPANS
    vllm = fragmentation(frag_run([(None, None, 100.0, 380.0 + k) for k in range(3)]))
    assert vllm.status is Status.NOT_MEASURED and "does not count" in vllm.reason
    plain = fragmentation(dataclasses.replace(frag_run([]), summaries=[row("zerolayer", 600.0)]))
    assert plain.status is Status.NOT_MEASURED and plain.reason == NO_COMPARISON


def test_the_fixed_shapes_truncate_what_does_not_fit_and_mark_it() -> None:
    profile = load_profile("c_mixed", "laptop")
    fixed = FIXED_SHAPES.profile(profile, BYTES_RULE, {})
    sizes = {c.name: c.prompt_tokens + c.max_tokens for c in fixed.classes}
    assert sizes.keys() == {"small", "medium", "large" + TRUNCATED}
    assert max(sizes.values()) <= 4096
    assert ENGINE_DEFAULTS.profile(profile, BYTES_RULE, {}) == profile
    assert FIXED_SHAPES.options({"max_num_seqs": 8}) == {
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "enable_prefix_caching": False,
    }


def test_the_command_runs_paired_interleaved_trials_of_both_configurations(tmp_path: Path) -> None:
    assert cli_main(["fragmentation", "--scale", "smoke", "--repeats", "2", "--quiet",
                     "--out", str(tmp_path)]) == 0  # fmt: skip
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / schema.RUN_META).exists()]
    run = load_run(run_dir)
    order = [(r.repeat, r.stack) for r in run.summaries]
    assert order == [(0, FIXED), (0, DEFAULT), (1, DEFAULT), (1, FIXED)], "A B, then B A"
    assert set(run.stacks) == {FIXED, DEFAULT}, "each trial's records under its configuration"
    meta = run.meta.other["fragmentation"]
    assert meta[FIXED]["engine_options"]["max_model_len"] == 4096
    assert meta[FIXED]["engine_options"]["enable_prefix_caching"] is False
    result = next(c for c in claims.read(run_dir).claims if c.key == "fragmentation")
    assert result.status is not Status.NOT_MEASURED, result.reason
    assert "KV tail waste" in result.measured


@pytest.mark.parametrize(("engine", "placed"), [("vllm", True), ("sim", False)])
def test_the_command_places_vllms_engines_as_run_does(
    engine: str, placed: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``fragmentation --engine vllm`` printed ``cpu layout: none``: its vLLM engine computed
    on every core beside the loader. It takes the same automatic split as ``zl-bench run``."""
    seen: list[RunConfig] = []
    monkeypatch.setattr(frag, "fit_engine_to_model", lambda config: config)
    monkeypatch.setattr(frag, "run", lambda config: seen.append(config) or 0)
    parser = argparse.ArgumentParser()
    frag.add_arguments(parser)
    options = ["--engine-option", "model=/m"] if engine == "vllm" else []
    args = parser.parse_args(
        ["--engine", engine, *options, "--replicas", "1", "--out", str(tmp_path)]
    )
    assert frag.run_command(args) == 0
    (config,) = seen
    assert (config.cpu_layout is not None) is placed
    if placed:
        assert config.cpu_layout is not None and len(config.cpu_layout.engines) == 1
