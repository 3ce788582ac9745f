"""Profile A at smoke scale through native, k6 and locust against the same two TLS replicas:
the three complete every request and send each to the same replica (the SDK's ring).

Whether their median E2E latencies agree is a timing judgement of three runs one after another
on the host, so it lives in benchmarks/test_loader_agreement_bench.py (``nox -s benchmarks``).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.loader_checks import three_loaders_on_profile_a


def test_three_loaders_complete_profile_a_on_the_same_replicas(tmp_path: Path) -> None:
    requests, results = three_loaders_on_profile_a(tmp_path)
    for result in results.values():
        assert result.summary["completed"] == requests, (result.loader, result.summary)
    spreads = {name: r.extra["per_replica"] for name, r in results.items()}
    assert len(spreads["native"]) == 2 and all(s == spreads["native"] for s in spreads.values())
