"""Real Chaos Toolkit experiments on the Ray Serve baseline: one Ray stand-up for the module
(smoke scale, about 80 s including the stand-up)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.recovery import trial_problems
from harness.profile import Profile
from harness.stacks import Stack, StackName
from tests.support.chaos_checks import EXPERIMENTS, run_and_check, stack_under_chaos
from tests.support.waiting import STACK_IN_A_FIXTURE

pytestmark = STACK_IN_A_FIXTURE

Setup = tuple[Stack, Path, Profile]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-baseline")


@pytest.fixture(scope="module")
def setup(out_dir: Path) -> Iterator[Setup]:
    with stack_under_chaos(StackName.BASELINE, out_dir / "stack") as running:
        yield running


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_loses_nothing_and_rolls_back(setup: Setup, out_dir: Path, name: str) -> None:
    stack, target_file, profile = setup
    row = run_and_check(target_file, out_dir, stack, profile, name)
    if not row.absent and row.hypothesis_before is not True:  # a flagged host: no fault ran
        return
    if name == "kill-orchestrator":
        assert row.fault == "kill" and row.bad > 0, "losing the orchestrator went unnoticed"
        assert row.blast_radius_replicas == 1.0
    if name == "kill-engine-replica":
        assert row.fault == "kill" and row.blast_radius_replicas == 0.5
    if name == "kv-pressure-one-replica":
        # The orchestrator refuses as it does: its engine fills (the watch sees it) and the
        # pressure's requests wait in it; a notice without a refusal is only a lower bound.
        got = row.refusal
        assert got is not None
        if not got.crossing_ns and trial_problems(row):
            # A host too busy to carry the load hands Serve's engine too few requests at once
            # to fill it: the trial says so, and its flags keep it from deciding anything.
            assert got.note, got
            return
        assert got.crossing_ns and got.watched.startswith("kv-watch-"), (got, trial_problems(row))
        assert got.censored == (got.refused == 0) and got.admitted_after is not None
