"""Shared checks for the real Chaos Toolkit runs in test_chaos_zerolayer and test_chaos_baseline."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

from chaos import pressure, probes, runner
from chaos.actions import wait_ready
from chaos.recovery import Recovery, load_problems, trial_problems
from harness.profile import Profile, load_profile
from harness.schema import RequestRecord, read_jsonl, read_requests, requests_file
from harness.stacks import Credentials, Stack, StackName, StackSpec, stand_up

EXPERIMENTS = [p.stem for p in runner.experiment_paths()]
SCALE = "smoke"
# A KV cache small enough that the KV-pressure experiment fills it in seconds.
ENGINE_OPTIONS = {"num_kv_blocks": 2048}
DEADLINE_CAP_MS = 120_000
"""The most a request of the load may wait, however slow the stand-up: twelve times the smoke
profile's own deadline. Uncapped (four times a stand-up of minutes, under load) an experiment's
last requests held a delayed replica's load for nine minutes, past the test's 900 s guard; a
request still unanswered at the cap is lost, which a host that carried the load never shows."""


def allowing(profile: Profile, standup_s: float) -> Profile:
    """Profile D with its recovery timeout grown as a run grows it (``chaos.runner.for_host``)
    and its load deadline grown alike, up to :data:`DEADLINE_CAP_MS`, so that no request is cut
    off before the stack can answer it on a machine slow to stand the stack up.

    The waits themselves end when the stack is whole again (``wait_ready`` polls health); only
    their caps derive from the measured stand-up.
    """
    sc = runner.for_host(runner.chaos_settings(profile), standup_s)
    allowance_ms = int(runner.RECOVERY_PER_STAND_UP * standup_s * 1000)
    chaos = dataclasses.replace(
        sc, deadline_ms=min(DEADLINE_CAP_MS, max(sc.deadline_ms, allowance_ms))
    )
    return dataclasses.replace(profile, chaos=chaos)


@contextlib.contextmanager
def stack_under_chaos(
    name: StackName, workdir: Path, credentials: Credentials | None = None
) -> Iterator[tuple[Stack, Path, Profile]]:
    """Stand the stack up (timed; with ``credentials``, authenticating tenants), put the fault
    proxy in front; yield it, its target file and the profile whose allowances follow from the
    stand-up time."""
    start = time.monotonic()
    spec = StackSpec(name, "sim", ENGINE_OPTIONS, replicas=2, credentials=credentials)
    with stand_up(spec, workdir) as stack:
        profile = allowing(load_profile("d_fault", SCALE), time.monotonic() - start)
        chaos_dir = workdir / "chaos"
        chaos_dir.mkdir(parents=True, exist_ok=True)
        with runner.fault_target(stack, chaos_dir) as target_file:
            yield stack, target_file, profile


def _unsteady_on_a_busy_host(row: Recovery, journal: dict, conf: dict) -> Recovery:
    """A steady state that did not hold before the fault is the stack's on a host that carried
    the load, and fails here; on a host too busy to carry it (the row flags the host or the
    load) the fault was not run, the trial decides nothing, and only the rollbacks and the
    stack's health are checked."""
    assert load_problems(row), ("the steady state did not hold on a host the row calls fine",
                             journal["steady_states"]["before"])  # fmt: skip
    assert row.hypothesis_before is not True and trial_problems(row)
    assert all(r["status"] == "succeeded" for r in journal["rollbacks"]), journal["rollbacks"]
    assert probes.all_alive(probes.replicas(conf)), probes.replicas(conf)
    return row


def _loses_nothing_where_the_host_carried_the_load(
    row: Recovery, journal: dict, records: list[RequestRecord]
) -> None:
    """No request lost, on a host that carried the load (no ``load_problems``). On one that did
    not, a stream under way on the faulted replica may pass its deadline, and such a trial decides
    nothing (as profile D's claims and the README smoke test hold it): its losses are only
    counted alike by the row, the load's own journal entry and the records."""
    lost = [r.request_id for r in records if r.outcome == "lost"]
    assert row.lost == len(lost) == journal["zl_load"]["lost"], (row.lost, journal["zl_load"])
    assert not lost or load_problems(row), ("requests lost on a host the row calls fine", lost)
    assert all(r.outcome in ("completed", "error", "lost") for r in records)


def run_and_check(
    target_file: Path, out_dir: Path, stack: Stack, profile: Profile, name: str
) -> Recovery:
    """Run one experiment for real; check the journal, the rollbacks, liveness and no loss."""
    chaos_dir = out_dir / "chaos"
    chaos_dir.mkdir(parents=True, exist_ok=True)
    path = runner.EXPERIMENT_DIR / f"{name}.json"
    prompt = pressure.kv_prompt(stack.spec, runner.chaos_settings(profile))
    row = runner.run_one(path, stack.name, profile, target_file, chaos_dir, prompt)
    runner.adopt_restarted(stack, target_file)
    conf = {"target_file": str(target_file)}
    if row.absent:  # nothing to act on: not run, and said so
        assert not (chaos_dir / f"{stack.name}-{name}.journal.json").exists()
        assert probes.all_alive(probes.replicas(conf)), probes.replicas(conf)
        return row

    journal = json.loads((chaos_dir / f"{stack.name}-{name}.journal.json").read_text())
    before = journal["steady_states"]["before"]
    assert before is not None, "hypothesis not evaluated"
    if not before["steady_state_met"]:
        return _unsteady_on_a_busy_host(row, journal, conf)
    assert len(before["probes"]) == 2, "hypothesis not evaluated"
    assert all("tolerance_met" in p for p in before["probes"])
    assert journal["rollbacks"], "rollbacks did not run"
    assert all(r["status"] == "succeeded" for r in journal["rollbacks"]), journal["rollbacks"]
    assert row.rollbacks_ok
    # Whole again within the recovery allowance, then every replica alive: on a busy host Serve
    # may replace a replica that missed its health checks just after the rollbacks ended.
    wait_ready(runner.chaos_settings(profile).recover_timeout_s, conf)
    assert probes.all_alive(probes.replicas(conf)), probes.replicas(conf)

    records = read_requests(chaos_dir / requests_file(stack.name, f"d_fault-{name}"))
    assert records and row.requests == len(records)
    _loses_nothing_where_the_host_carried_the_load(row, journal, records)
    assert all(r.error_code for r in records if r.outcome == "error")
    assert row.completed + row.failed + row.lost == row.requests
    assert row.engine_replicas == stack.spec.replicas
    telemetry = read_jsonl(chaos_dir / f"telemetry-{stack.name}-{name}.jsonl")
    engines = {r["name"] for r in telemetry if r.get("source") == "engine" and r.get("up")}
    assert len(engines) == stack.spec.replicas, f"engine telemetry of {engines} only"
    line = next(x for x in runner.table([row]).splitlines() if name in x)
    assert line.split()[6] == str(row.lost)  # the lost column
    assert row.host_speed and row.host_cpu_pct is not None, "the trial's host was measured"
    assert row.faulted.requests > 0 and row.steady.requests + row.faulted.requests <= row.requests
    return row
