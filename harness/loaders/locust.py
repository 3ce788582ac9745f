"""The locust loader: locust as a library, headless, in its own process.

Locust monkey-patches the standard library with gevent when imported, which would break the
asyncio code of the caller, so ``run_locust`` starts a child Python that patches first (before
anything imports ``ssl``) and then calls ``main``, the only place that imports locust. Inside,
an ``Environment`` with a local runner runs ``users`` users over HTTP/1.1 keep-alive
(``requests``, streaming). Users take the schedule's requests in order and each sleeps until its
request's intended send time, so arrivals follow the same schedule as the native loader while
enough users are free (a late one shows as scheduling lag). Each request becomes one
RequestRecord, written as it ends; locust's own statistics are saved next to them and returned
in ``extra['locust_stats']``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.loaders.base import DEFAULT_GRACE_S, LoadResult, make_result, new_record, write_plan
from harness.schema import JsonlWriter, RequestRecord, read_requests
from harness.workload import PlannedRequest
from zerolayer.wire import contract

SPAWN_RATE = 100
_CHILD = (
    "from gevent import monkey; monkey.patch_all()\n"
    "import sys\n"
    "from harness.loaders.locust import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def start_delay_s(users: int) -> float:
    """Time from the child's start to the first send: every user spawned, plus a margin."""
    return 0.5 + users / SPAWN_RATE


def run_locust(
    schedule: Sequence[PlannedRequest],
    *,
    url: str,
    stack: str,
    profile: str,
    workdir: str | Path,
    records_path: str | Path,
    users: int = 32,
    grace_s: float = DEFAULT_GRACE_S,
    lag_fraction: float | None = None,
    ca_cert: str | Path | None = None,
) -> LoadResult:
    """Run the schedule through locust against ``url`` (HTTP/1.1) and summarise it.

    ``ca_cert`` is the certificate to trust for an https URL (the run's self-signed one).
    """
    workdir = Path(workdir)
    paths = write_plan(schedule, workdir, grace_s)
    records_path = Path(records_path)
    records_path.unlink(missing_ok=True)
    stats_path = workdir / "locust-stats.json"
    config = {
        "url": url.rstrip("/"),
        "plan": str(paths["plan"]),
        "fillers": str(paths["fillers"]),
        "records": str(records_path),
        "stats": str(stats_path),
        "stack": stack,
        "profile": profile,
        "users": users,
        "verify": str(ca_cert) if ca_cert is not None else True,
    }
    config_path = workdir / "locust-config.json"
    config_path.write_text(json.dumps(config))
    span = schedule[len(schedule) - 1].offset_s if len(schedule) else 0.0
    longest = max((r.deadline_ms for r in schedule), default=0) / 1000.0 + grace_s
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(config_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=start_delay_s(users) + span + longest + 60.0,
        check=False,
    )
    (workdir / "locust.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"locust run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    by_id = {r.request_id: r for r in read_requests(records_path)} if records_path.exists() else {}
    records = []
    for req in schedule:
        rec = by_id.get(req.request_id)
        if rec is None:  # never started before the run's bound: the loader could not keep up
            rec = new_record(req, stack, profile, "locust", 0)
            rec.outcome, rec.error_code = "error", "not_sent"
        records.append(rec)
    unsent = sum(1 for r in records if r.error_code == "not_sent")
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    kwargs: dict[str, Any] = {} if lag_fraction is None else {"lag_fraction": lag_fraction}
    result = make_result(
        "locust",
        stack,
        profile,
        records_path,
        records,
        extra_reasons=[f"locust never sent {unsent} requests"] if unsent else [],
        extra={"locust_stats": stats, "users": users},
        **kwargs,
    )
    result.summary["locust_median_response_time_ms"] = stats.get("median_response_time", 0.0)
    return result


def _sse(rec: RequestRecord, line: bytes, now_ns: int) -> None:
    """Account one SSE line: a content chunk, the usage, or an in-stream error."""
    if not line.startswith(b"data: {"):
        return
    event = json.loads(line[6:])
    if "error" in event:
        rec.outcome = "error"
        rec.error_code = str(event["error"].get("code", "stream_error"))
        return
    choices = event.get("choices") or [{}]
    if choices[0].get("text"):
        if not rec.first_token_ns:
            rec.first_token_ns = now_ns
        rec.chunk_ns.append(now_ns)
    usage = event.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens", 0))


def main(argv: Sequence[str] | None = None) -> int:
    """The locust process: run the plan headless and write records and stats."""
    import itertools
    import time

    import gevent
    import requests
    from locust import HttpUser, constant, events, task
    from locust.env import Environment
    from locust.exception import StopUser

    args = argparse.ArgumentParser(prog="harness.loaders.locust", description="the locust child")
    args.add_argument("config")
    cfg = json.loads(Path(args.parse_args(argv).config).read_text())
    plan = json.loads(Path(cfg["plan"]).read_text())
    fillers = json.loads(Path(cfg["fillers"]).read_text())
    writer = JsonlWriter(cfg["records"])
    cursor = itertools.count()
    ended = itertools.count(1)
    wall0, perf0 = time.time_ns(), time.perf_counter_ns()
    start_ns = perf0 + int(start_delay_s(cfg["users"]) * 1e9)
    state: dict[str, Any] = {}

    def wall(perf_ns: int) -> int:
        return wall0 + (perf_ns - perf0)

    class PlanUser(HttpUser):
        host = cfg["url"]
        wait_time = constant(0)

        def on_start(self) -> None:
            self.client.verify = cfg["verify"]

        @task
        def send(self) -> None:
            i = next(cursor)
            if i >= len(plan):
                raise StopUser()
            p = plan[i]
            target = start_ns + int(p["offset_s"] * 1e9)
            delay = (target - time.perf_counter_ns()) / 1e9
            if delay > 0:
                gevent.sleep(delay)
            req = PlannedRequest(
                index=p["i"], request_id=p["id"], offset_s=p["offset_s"],
                request_class=p["request_class"], prompt_bytes=p["prompt_bytes"],
                max_tokens=p["max_tokens"], seed=p["seed"], session=p["session"],
                tenant=p["tenant"], priority=p["priority"], deadline_ms=p["deadline_ms"],
            )  # fmt: skip
            rec = new_record(req, cfg["stack"], cfg["profile"], "locust", wall(target))
            rec.dispatch_ns = wall(time.perf_counter_ns())
            prompt = (p["id"] + ":" + fillers[p["filler"]])[: p["prompt_bytes"]]
            body = {"prompt": prompt, "max_tokens": p["max_tokens"], "stream": True,
                    "seed": p["seed"]}  # fmt: skip
            headers = dict(
                contract.build_headers(
                    session=p["session"], tenant=p["tenant"], priority=p["priority"],
                    deadline_ms=p["deadline_ms"], prompt_tokens=p["prompt_tokens"],
                    max_tokens=p["max_tokens"],
                )
            )  # fmt: skip
            rec.sent_ns = wall(time.perf_counter_ns())
            try:
                with self.client.post(
                    "/v1/completions", json=body, headers=headers, stream=True,
                    timeout=p["timeout_ms"] / 1000.0, name="/v1/completions", catch_response=True,
                ) as resp:  # fmt: skip
                    rec.http_status = resp.status_code
                    failure = getattr(resp, "error", None)  # locust's stand-in for a raise
                    if isinstance(failure, requests.RequestException):
                        raise failure
                    if resp.status_code != 200:
                        rec.outcome = "error"
                        rec.error_code = resp.headers.get(contract.ERROR, "")
                        resp.failure(rec.error_code or f"http {resp.status_code}")
                    else:
                        rec.outcome = "completed"
                        for line in resp.iter_lines():
                            _sse(rec, line, wall(time.perf_counter_ns()))
                        resp.success()
            except requests.Timeout:
                rec.outcome = "lost"
            except Exception as exc:  # every request must end as exactly one record
                rec.outcome, rec.error_code = "error", f"client_{type(exc).__name__}"
            finally:
                rec.end_ns = wall(time.perf_counter_ns())
                if rec.outcome == "error" and not rec.error_code:
                    rec.error_code = f"http_{rec.http_status}"
                writer.write(rec)
                if next(ended) == len(plan):
                    gevent.spawn(state["runner"].quit)

    env = Environment(user_classes=[PlanUser], events=events)
    runner = env.create_local_runner()
    state["runner"] = runner
    span = plan[-1]["offset_s"] if plan else 0.0
    longest = max((p["timeout_ms"] for p in plan), default=0) / 1000.0
    runner.start(cfg["users"], spawn_rate=SPAWN_RATE)
    gevent.spawn_later(start_delay_s(cfg["users"]) + span + longest + 5.0, runner.quit)
    runner.greenlet.join()
    writer.close()
    total = env.stats.total
    Path(cfg["stats"]).write_text(
        json.dumps(
            {
                "num_requests": total.num_requests,
                "num_failures": total.num_failures,
                "median_response_time": total.median_response_time,
                "avg_response_time": total.avg_response_time,
                "p99_response_time": total.get_response_time_percentile(0.99),
                "total_rps": total.total_rps,
            }
        )
    )
    return 0
