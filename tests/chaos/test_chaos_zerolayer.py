"""Real Chaos Toolkit experiments on the zero-layer stack (smoke scale, about a minute)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.actions import alive
from chaos.recovery import Recovery, load_problems, method_actions
from chaos.targets import read_target
from harness.profile import Profile
from harness.schema import read_jsonl, read_requests, requests_file
from harness.stacks import Stack, StackName
from tests.support.chaos_checks import EXPERIMENTS, run_and_check, stack_under_chaos
from tests.support.waiting import STACK_IN_A_FIXTURE

pytestmark = STACK_IN_A_FIXTURE

STACK = "zerolayer"
Setup = tuple[Stack, Path, Profile]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-zerolayer")


@pytest.fixture(scope="module")
def setup(out_dir: Path) -> Iterator[Setup]:
    with stack_under_chaos(StackName.ZEROLAYER, out_dir / "stack") as running:
        yield running
        target_file = running[1]
    assert not any(alive(s.pid) for s in read_target(target_file).replicas)


@pytest.mark.parametrize("name", [e for e in EXPERIMENTS if e != "pause-engine-replica"])
def test_experiment_loses_nothing_and_rolls_back(setup: Setup, out_dir: Path, name: str) -> None:
    stack, target_file, profile = setup
    before = read_target(target_file)
    row = run_and_check(target_file, out_dir, stack, profile, name)
    if not row.absent and row.hypothesis_before is not True:  # a flagged host: no fault ran
        return
    after = read_target(target_file)
    if name == "kill-orchestrator":
        assert row.fault == "absent" and "no orchestrator" in row.note
        assert row.bad == 0 and row.blast_radius_replicas == 0.0
    if name == "kill-engine-replica":
        assert row.fault == "kill"
        _check_the_kill_ends_exactly_the_streams_under_way(out_dir, row.fault_start_ns)
        pairs = zip(before.replicas, after.replicas, strict=True)
        changed = [(b.pid, a.pid) for b, a in pairs if b.pid != a.pid]
        assert len(changed) == 1, "the rollback restarts exactly the killed replica"
        assert changed[0][1] in stack.pids()["replica"], "the stack adopts the restarted replica"
        assert row.sdk_reroute_s is not None
    if name == "kv-pressure-one-replica":
        _check_the_pressure_is_refused_on_its_headers(out_dir, row)


def _check_the_pressure_is_refused_on_its_headers(out_dir: Path, row: Recovery) -> None:
    """The replica filled by the pressure refuses the rest at once: each refusal stamped by its
    client after its send, and the replica's KV watch saw its cache cross the threshold first.

    On a host that did not carry its load, the replica's loop can fall behind the ramp: the later
    requests wait in its queue, whose reservations its watermark does not count yet, and it may
    refuse none before the pressure ends. Such a trial decides nothing about refusal speed (as
    profile D's claim holds it) and is held only to what holds on any host."""
    got = row.refusal
    assert got is not None
    records = read_requests(out_dir / "chaos" / f"refusals-{STACK}-kv-pressure-one-replica.jsonl")
    assert len(records) == got.requests
    refused = [r for r in records if r.refused_ns]
    assert all(r.sent_ns < r.refused_ns and r.first_token_ns == 0 for r in refused)
    assert all(us > 0 for us in got.latencies_us) and len(got.latencies_us) == got.refused
    if load_problems(row, load_lag=False):
        return
    assert refused and got.refused > 0 and not got.censored, got
    assert got.crossing_ns and got.watched.startswith("kv-watch-zl-"), got
    assert got.notice_ms is not None and got.p99_ms is not None and got.admitted_after is not None


def _check_the_kill_ends_exactly_the_streams_under_way(out_dir: Path, kill_ns: int) -> None:
    """On the killed replica, a request that had its first token when the kill came ends in an
    error (by design: never retried mid-stream) unless its whole answer had already left the
    replica: the client reads the last frames a little after the signal (its loop's own delay, a
    few ms on a loaded host), and such a stream completed there, with no retry and nothing lost.
    The replica was serving when it was killed. Whether a stream is under way at that instant is
    the schedule's luck, so the test checks the rule for each request rather than a count."""
    chaos_dir = out_dir / "chaos"
    journal = json.loads((chaos_dir / f"{STACK}-kill-engine-replica.journal.json").read_text())
    (killed_url,) = method_actions(journal)[0]["output"]["urls"]
    records = read_requests(chaos_dir / requests_file(STACK, "d_fault-kill-engine-replica"))
    before = [r for r in records if r.replica == killed_url and r.sent_ns < kill_ns]
    assert before, f"no request went to {killed_url} before the kill"
    under_way = [r for r in before if 0 < r.first_token_ns <= kill_ns < r.end_ns]
    ended = [(r.request_id, r.outcome, r.retries, r.replica) for r in under_way]
    assert all(r.outcome == "error" or (r.outcome == "completed" and r.retries == 0)
               for r in under_way), ended  # fmt: skip
    assert all(r.replica == killed_url for r in under_way), ended


def test_sdk_routes_around_a_paused_replica(setup: Setup, out_dir: Path) -> None:
    """After the SDK marks the paused replica down, no new request goes to it until it is up,
    while it holds another replica up (with none up it routes to all: ``_held_up``).

    A trial whose steady state did not hold on a flagged host ran no fault (``run_and_check``
    checked its rollbacks and health), and one whose host did not carry its load may end before
    the SDK saw the pause or sent a request while it was down: such a trial decides nothing, as
    profile D's claims hold it. The routing rule holds on every trial in which the SDK saw it.
    """
    stack, target_file, profile = setup
    row = run_and_check(target_file, out_dir, stack, profile, "pause-engine-replica")
    if row.hypothesis_before is not True:  # a flagged host: no fault ran
        return
    carried = not load_problems(row)
    if row.sdk_reroute_s is None:
        assert not carried, "the SDK never marked the paused replica down"
        return
    chaos_dir = out_dir / "chaos"
    health = read_jsonl(chaos_dir / f"sdk-health-{STACK}-pause-engine-replica.jsonl")
    down = row.fault_start_ns + round(row.sdk_reroute_s * 1e9)
    faulted = {h["url"] for h in health if not h["up"] and abs(h["t_ns"] - down) < 1000}
    assert faulted and faulted <= set(read_target(target_file).load_urls)
    ups = [h["t_ns"] for h in health if h["up"] and h["url"] in faulted and h["t_ns"] > down]
    back_up = min(ups) if ups else row.fault_end_ns
    records = read_requests(chaos_dir / requests_file(STACK, "d_fault-pause-engine-replica"))
    routed = [r for r in records if down < r.sent_ns < back_up]
    assert routed or not carried, "no request was sent while the replica was down"
    chosen = [r for r in routed if _held_up(health, r.sent_ns)]
    assert not [r.request_id for r in chosen if r.replica in faulted]


def _held_up(health: list[dict[str, Any]], t_ns: int) -> set[str]:
    """The replicas the SDK held up at ``t_ns`` (its last verdict on each before then). With
    none up it routes to every one (panic routing, ``ZeroLayerClient._candidates``): a loaded
    host's slow health answers can mark the other replica down too, and a request sent then
    was not routed around anything."""
    last: dict[str, bool] = {}
    for h in sorted(health, key=lambda h: h["t_ns"]):
        if h["t_ns"] > t_ns:
            break
        last[h["url"]] = h["up"]
    return {url for url, up in last.items() if up}
