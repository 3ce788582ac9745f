"""Profile A at smoke scale through native, k6 and locust against the same two TLS replicas:
the three complete every request and send each to the same replica (the SDK's ring).

Whether their median E2E latencies agree is a timing judgement of three runs one after another
on the host, so it lives in benchmarks/test_loader_agreement_bench.py (``nox -s benchmarks``).
"""

from __future__ import annotations

from pathlib import Path

from harness.loaders import LOADERS, needs_tls
from harness.loaders.k6 import K6Loader
from harness.loaders.native import NativeLoader
from harness.profile import load_profile
from harness.stacks import StackName, StackSpec, stand_up
from harness.workload import build_schedule


def test_three_loaders_complete_profile_a_on_the_same_replicas(tmp_path: Path) -> None:
    profile = load_profile("a", "smoke")
    sched = build_schedule(profile)
    loaders = {
        "native": NativeLoader(progress=None, client_options={"health_interval_s": 0}),
        # A VU per iteration: on a loaded host k6 drops an iteration when every VU is busy.
        "k6": K6Loader(vus=len(sched)),
        "locust": LOADERS["locust"],
    }
    tls = any(needs_tls(name, StackName.ZEROLAYER) for name in loaders)
    spec = StackSpec(StackName.ZEROLAYER, engine="sim", replicas=2, tls=tls)
    with stand_up(spec, tmp_path / "stack") as stack:
        results = {
            name: loader.run(sched, stack, profile, tmp_path / f"{name}.jsonl", tmp_path / name)
            for name, loader in loaders.items()
        }
    for result in results.values():
        assert result.summary["completed"] == len(sched), (result.loader, result.summary)
    spreads = {name: r.extra["per_replica"] for name, r in results.items()}
    assert len(spreads["native"]) == 2 and all(s == spreads["native"] for s in spreads.values())
