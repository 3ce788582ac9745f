"""The locust loader: headless locust in a child process, its records and stats parsed back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.loaders.locust import run_locust
from harness.profile import load_profile
from harness.schema import read_requests
from harness.stacks import ReplicaProcess
from harness.workload import Schedule, build_schedule


def _schedule(
    rate: float, duration_s: float, max_tokens: int, prompt_bytes: int = 1000
) -> Schedule:
    p = load_profile("a", "smoke")
    classes = tuple(replace(c, max_tokens=max_tokens, prompt_bytes=prompt_bytes) for c in p.classes)
    return build_schedule(replace(p, rate=rate, duration_s=duration_s, classes=classes))


def test_locust_streams_the_schedule_over_http1(tmp_path: Path) -> None:
    sched = _schedule(rate=20.0, duration_s=1.0, max_tokens=6)
    with ReplicaProcess("sim") as replica:
        result = run_locust(
            sched, url=replica.url, stack="zerolayer", profile="a", workdir=tmp_path,
            records_path=tmp_path / "req.jsonl", users=8,
        )  # fmt: skip
    s = result.summary
    assert s["completed"] == len(sched) == 20
    saved = read_requests(tmp_path / "req.jsonl")
    assert sorted(r.request_id for r in saved) == sorted(r.request_id for r in sched)
    for rec in saved:
        assert rec.loader == "locust" and rec.output_tokens == 6
        assert rec.intended_start_ns <= rec.dispatch_ns <= rec.sent_ns < rec.first_token_ns
        assert 1 <= len(rec.chunk_ns) <= 6 and rec.chunk_ns[-1] <= rec.end_ns
    stats = result.extra["locust_stats"]
    assert stats["num_requests"] == 20 and stats["num_failures"] == 0
    by_index = {r.request_id: r for r in saved}
    first = by_index[sched[0].request_id].intended_start_ns
    for req in sched:  # the schedule's send times, not locust's own pacing
        offset_ns = by_index[req.request_id].intended_start_ns - first
        assert abs(offset_ns - req.offset_s * 1e9) < 1000


def test_locust_records_refusals_with_their_code(tmp_path: Path) -> None:
    sched = _schedule(rate=20.0, duration_s=0.5, max_tokens=4, prompt_bytes=4000)
    with ReplicaProcess("sim", extra_args=["--max-model-len", "256"]) as replica:
        result = run_locust(
            sched, url=replica.url, stack="zerolayer", profile="a", workdir=tmp_path,
            records_path=tmp_path / "req.jsonl", users=4,
        )  # fmt: skip
    assert result.summary["errors"] == len(sched) == 10
    assert result.summary["errors_by_code"] == {"prompt_too_long": 10}
    assert result.extra["locust_stats"]["num_failures"] == 10
