"""Profile A at smoke scale through native, k6 and locust against the same two TLS replicas:
the three send each request to the same replica (the SDK's ring), and their median E2E
latencies agree within 15 % (a ratio within one run, not a timing threshold)."""

from __future__ import annotations

from pathlib import Path

from harness.loaders import LOADERS, needs_tls
from harness.loaders.native import NativeLoader
from harness.profile import load_profile
from harness.stacks import StackName, StackSpec, stand_up
from harness.workload import build_schedule


def test_three_loaders_agree_on_profile_a(tmp_path: Path) -> None:
    profile = load_profile("a", "smoke")
    sched = build_schedule(profile)
    loaders = {
        "native": NativeLoader(progress=None, client_options={"health_interval_s": 0}),
        "k6": LOADERS["k6"],
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
    medians = {name: r.summary["median_e2el_ms"] for name, r in results.items()}
    print("median E2EL ms:", {k: round(v, 1) for k, v in medians.items()})
    low, high = min(medians.values()), max(medians.values())
    assert high <= 1.15 * low, medians
