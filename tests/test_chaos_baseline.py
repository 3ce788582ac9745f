"""Real Chaos Toolkit experiments on the Ray Serve baseline: one Ray stand-up for the module
(smoke scale, about 80 s including the stand-up)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos_checks import EXPERIMENTS, SCALE, run_and_check

from chaos import runner
from chaos.stacks import baseline_stack

STACK = "baseline"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-baseline")


@pytest.fixture(scope="module")
def target_file(out_dir: Path) -> Iterator[Path]:
    with baseline_stack(
        out_dir / "stack", None, runner.REPLICAS, runner.ENGINE, runner.engine_options(SCALE)
    ) as path:
        yield path


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_loses_nothing_and_rolls_back(
    target_file: Path, out_dir: Path, name: str
) -> None:
    row = run_and_check(target_file, out_dir, STACK, name)
    if name == "kill-orchestrator":
        assert row.fault == "kill" and row.bad > 0, "losing the orchestrator went unnoticed"
        assert row.blast_radius_replicas == 1.0
    if name == "kill-engine-replica":
        assert row.fault == "kill" and row.blast_radius_replicas == 0.5
