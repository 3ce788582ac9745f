"""Profile A at smoke scale through native, k6 and locust against one replica: the three median
E2E latencies agree within 15 % (a ratio within one run, not a timing threshold)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import uvloop

from harness.loaders.k6 import run_k6
from harness.loaders.locust import run_locust
from harness.loaders.native import run_native
from harness.loaders.tls import client_context, self_signed
from harness.profile import load_profile
from harness.stacks import ReplicaProcess
from harness.workload import build_schedule


def test_three_loaders_agree_on_profile_a(tmp_path: Path) -> None:
    profile = load_profile("a", "smoke")
    sched = build_schedule(profile)
    cert, key = self_signed(tmp_path / "tls")
    medians = {}
    with ReplicaProcess("sim", tls=(cert, key)) as replica:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            native = runner.run(
                run_native(
                    sched, urls=[replica.url], stack="zerolayer", profile=profile.name,
                    records_path=tmp_path / "native.jsonl", progress=None,
                    client_options={"tls": client_context(cert), "health_interval_s": 0},
                )
            )  # fmt: skip
        k6 = run_k6(
            sched, url=replica.url, stack="zerolayer", profile=profile.name, rate=profile.rate,
            duration_s=profile.duration_s, workdir=tmp_path / "k6",
            records_path=tmp_path / "k6.jsonl", vus=profile.connections,
        )  # fmt: skip
        locust = run_locust(
            sched, url=replica.url, stack="zerolayer", profile=profile.name,
            workdir=tmp_path / "locust", records_path=tmp_path / "locust.jsonl",
            users=profile.connections, ca_cert=cert,
        )  # fmt: skip
    for result in (native, k6, locust):
        assert result.summary["completed"] == len(sched), (result.loader, result.summary)
        medians[result.loader] = result.summary["median_e2el_ms"]
    print("median E2EL ms:", {k: round(v, 1) for k, v in medians.items()})
    low, high = min(medians.values()), max(medians.values())
    assert high <= 1.15 * low, medians
