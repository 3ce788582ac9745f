"""Shared checks for the real Chaos Toolkit runs in test_chaos_zerolayer and test_chaos_baseline."""

from __future__ import annotations

import json
from pathlib import Path

from chaos import probes, runner
from chaos.actions import wait_ready
from chaos.recovery import Recovery
from harness.schema import read_requests, requests_file

EXPERIMENTS = [p.stem for p in runner.experiment_paths()]
SCALE = "smoke"


def run_and_check(target_file: Path, out_dir: Path, stack: str, name: str) -> Recovery:
    """Run one experiment for real; check the journal, the rollbacks, liveness and no loss."""
    chaos_dir = out_dir / "chaos"
    chaos_dir.mkdir(parents=True, exist_ok=True)
    path = runner.EXPERIMENT_DIR / f"{name}.json"
    row = runner.run_one(path, stack, SCALE, target_file, chaos_dir)
    conf = {"target_file": str(target_file)}

    journal = json.loads((chaos_dir / f"{stack}-{name}.journal.json").read_text())
    before = journal["steady_states"]["before"]
    assert before is not None and len(before["probes"]) == 2, "hypothesis not evaluated"
    assert all("tolerance_met" in p for p in before["probes"])
    assert journal["rollbacks"], "rollbacks did not run"
    assert all(r["status"] == "succeeded" for r in journal["rollbacks"]), journal["rollbacks"]
    assert row.rollbacks_ok
    assert probes.all_alive(probes.replicas(conf)), probes.replicas(conf)
    wait_ready(runner.SCALES[SCALE].recover_timeout_s, conf)

    records = read_requests(chaos_dir / requests_file(stack, f"d_fault-{name}"))
    assert records and row.requests == len(records)
    assert row.lost == 0, [r.request_id for r in records if r.outcome == "lost"]
    assert all(r.outcome in ("completed", "error") for r in records)
    assert all(r.error_code for r in records if r.outcome == "error")
    assert row.completed + row.failed == row.requests
    assert journal["zl_load"]["lost"] == 0
    line = next(x for x in runner.table([row]).splitlines() if name in x)
    assert line.split()[5] == "0"  # the lost column
    return row
