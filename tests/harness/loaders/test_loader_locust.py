"""The locust loader: headless locust in a child process, its records and stats parsed back."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from harness.loaders import LOADERS
from harness.loaders.base import replica_routes
from harness.loaders.locust import LocustLoader
from harness.schema import read_requests
from harness.stacks import StackName, StackSpec, stand_up
from harness.workload import build_schedule
from tests.support.loader_checks import assert_spread, profile_at, served


def test_locust_streams_the_schedule_to_every_replica(tmp_path: Path) -> None:
    """Two replicas: HTTP/1.1 streams, each request where the SDK's ring sends its session, the
    replicas' own /metrics agreeing with the plan, send times from the schedule."""
    profile = profile_at(rate=100.0, duration_s=2.0, max_tokens=6)
    sched = build_schedule(profile)
    with stand_up(StackSpec(StackName.ZEROLAYER, engine="sim", replicas=2), tmp_path) as stack:
        loader = LOADERS["locust"]
        assert loader.name == "locust"
        result = loader.run(sched, stack, profile, tmp_path / "req.jsonl", tmp_path / "locust")
        counts = served(stack)
        planned = Counter(replica_routes(sched, stack))
    s = result.summary
    assert s["completed"] == len(sched) == 200
    assert result.protocol == "http/1.1" and not result.ttft_is_first_byte
    assert result.extra["arrival_requested"] == "constant" and result.extra["users"] == 16
    assert counts == planned == result.extra["per_replica"]
    assert_spread(counts, replicas=2)
    saved = read_requests(tmp_path / "req.jsonl")
    assert sorted(r.request_id for r in saved) == sorted(r.request_id for r in sched)
    for rec in saved:
        assert rec.loader == "locust" and rec.output_tokens == 6
        assert rec.intended_start_ns <= rec.dispatch_ns <= rec.sent_ns < rec.first_token_ns
        assert 1 <= len(rec.chunk_ns) <= 6 and rec.chunk_ns[-1] <= rec.end_ns
    stats = result.extra["locust_stats"]
    assert stats["num_requests"] == 200 and stats["num_failures"] == 0
    by_index = {r.request_id: r for r in saved}
    first = by_index[sched[0].request_id].intended_start_ns
    for req in sched:  # the schedule's send times, not locust's own pacing
        offset_ns = by_index[req.request_id].intended_start_ns - first
        assert abs(offset_ns - req.offset_s * 1e9) < 1000


def test_locust_records_refusals_with_their_code(tmp_path: Path) -> None:
    profile = profile_at(rate=20.0, duration_s=0.5, max_tokens=4, prompt_bytes=4000)
    sched = build_schedule(profile)
    spec = StackSpec(StackName.ZEROLAYER, engine="sim", engine_options={"max_model_len": 256})
    with stand_up(spec, tmp_path / "stack") as stack:
        result = LocustLoader(users=4).run(sched, stack, profile, tmp_path / "req.jsonl", tmp_path)
    assert result.summary["errors"] == len(sched) == 10
    assert result.summary["errors_by_code"] == {"prompt_too_long": 10}
    assert result.extra["locust_stats"]["num_failures"] == 10


def test_locust_master_and_workers_send_each_shard_once_from_one_start(tmp_path: Path) -> None:
    """Locust's own distributed mode as a cluster runs it (the workers here, as the cluster's
    actors start them: ``test_cluster_run`` places them): a master with two workers, each with
    its shard by session, one start time; every request once, locust's stats at the master."""
    import json
    import subprocess
    import sys

    from harness.loaders.base import write_plan
    from harness.loaders.locust_workers import CHILD, MASTER, WORKER, LocustWorker, child_env
    from harness.loaders.sharded import shards
    from serving.ports import free_port

    sched = build_schedule(profile_at(rate=50.0, duration_s=1.0, max_tokens=4))
    with stand_up(StackSpec(StackName.ZEROLAYER, engine="null", replicas=1), tmp_path) as stack:
        route = dict(zip([r.request_id for r in sched], replica_routes(sched, stack), strict=True))
        shared = {"host": stack.urls[0], "stack": "zerolayer", "profile": "a", "users": 8,
                  "verify": True, "extra_body": {}, "auth_headers": {}, "bound_s": 60.0,
                  "master_host": "127.0.0.1", "master_port": free_port()}  # fmt: skip
        workers = [LocustWorker(), LocustWorker()]
        for i, (worker, part) in enumerate(zip(workers, shards(sched, 2), strict=True)):
            paths = write_plan(part, [route[r.request_id] for r in part], tmp_path / f"w{i}", 5.0)
            worker.start({p.name: p.read_bytes() for p in paths.values()},
                         {**shared, "mode": WORKER})  # fmt: skip
        master = tmp_path / "master.json"
        stats_path = str(tmp_path / "stats.json")
        master_cfg = {**shared, "mode": MASTER, "bind_host": "127.0.0.1", "workers": 2}
        master.write_text(json.dumps({**master_cfg, "stats": stats_path}))
        proc = subprocess.run([sys.executable, "-c", CHILD, str(master)], env=child_env(),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        ends = [worker.finish(30.0) for worker in workers]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(code == 0 for _, code, _ in ends), [tail for _, _, tail in ends]
    ids = [json.loads(line)["request_id"] for data, _, _ in ends for line in data.splitlines()]
    assert sorted(ids) == sorted(r.request_id for r in sched)
    assert all(data for data, _, _ in ends), "both workers sent their shard"
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["num_requests"] == len(sched) and stats["num_failures"] == 0
