"""The locust process of ``harness.loaders.locust``: the plan run headless, records and stats.

Started by ``run_locust`` in a child Python that has already gevent-patched the standard library;
this is the only module that imports locust. Users take the plan's requests in order; each sleeps
until its request's intended send time, so arrivals follow the schedule while enough users are
free (a late one shows as scheduling lag), and posts it to the replica the plan names.

In locust's own distributed mode (``--loader-workers``) the config's ``mode`` is ``master`` (on
the driver's host: it waits for its workers, sends them one start time, spawns the users across
them, keeps the stats, and quits once every worker says its plan is done) or ``worker`` (on a
cluster node: its shard of the plan, its own records file, the master's start time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import requests
from locust import HttpUser, constant, events, task
from locust.clients import HttpSession
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import Runner

from harness.loaders.base import new_record
from harness.loaders.locust import SPAWN_RATE, start_delay_s
from harness.loaders.locust_workers import DONE, MASTER, START, WORKER
from harness.schema import JsonlWriter, RequestRecord
from harness.workload import PlannedRequest
from serving.wire import contract

PATH = "/v1/completions"
CONNECT_TIMEOUT_S = 120.0


@dataclass
class _Run:
    """The plan and what the users share: the next request to take, the clock, the writer."""

    cfg: dict[str, Any]
    plan: list[dict[str, Any]]
    fillers: list[str]
    writer: JsonlWriter
    cursor: Iterator[int] = field(default_factory=itertools.count)
    ended: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    wall0: int = field(default_factory=time.time_ns)
    perf0: int = field(default_factory=time.perf_counter_ns)
    runner: Runner | None = None
    start_wall_ns: int | None = None  # the master's start time (distributed mode)

    @property
    def start_ns(self) -> int:
        if self.start_wall_ns is not None:
            return self.perf0 + (self.start_wall_ns - self.wall0)
        return self.perf0 + int(start_delay_s(self.cfg["users"]) * 1e9)

    def all_ended(self) -> None:
        """Every request of the plan has ended: quit (alone), or tell the master (a worker)."""
        if self.runner is None:
            return
        if self.cfg.get("mode") == WORKER:  # its stats first, as locust's own quit sends them
            self.runner._send_stats()  # type: ignore[attr-defined]
            self.runner.send_message(DONE, {"requests": len(self.plan)})
        else:
            gevent.spawn(self.runner.quit)

    def wall(self, perf_ns: int) -> int:
        return self.wall0 + (perf_ns - self.perf0)

    def now(self) -> int:
        return self.wall(time.perf_counter_ns())


def planned_request(p: dict[str, Any]) -> PlannedRequest:
    """A plan entry back as the PlannedRequest it was written from."""
    return PlannedRequest(
        index=p["i"], request_id=p["id"], offset_s=p["offset_s"],
        request_class=p["request_class"], prompt_bytes=p["prompt_bytes"],
        max_tokens=p["max_tokens"], seed=p["seed"], session=p["session"], tenant=p["tenant"],
        priority=p["priority"], deadline_ms=p["deadline_ms"], turn=p.get("turn", 0),
        text=p.get("prompt", ""), tokens=p["prompt_tokens"] if "prompt" in p else 0,
    )  # fmt: skip


def _sse(rec: RequestRecord, line: bytes, now_ns: int) -> None:
    """Account one SSE line: a content chunk, the usage, or an in-stream error."""
    if not line.startswith(b"data: {"):
        return
    event = json.loads(line[6:])
    if "error" in event:
        rec.outcome = "error"
        rec.error_code = str(event["error"].get("code", "stream_error"))
        return
    if event.get("choices"):  # a chunk, text or not, as the SDK and vLLM's bench count it
        if not rec.first_token_ns:
            rec.first_token_ns = now_ns
        rec.chunk_ns.append(now_ns)
    usage = event.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens", 0))


def _post(client: HttpSession, p: dict[str, Any], rec: RequestRecord, run: _Run) -> None:
    """Send one planned request to its replica and read its SSE stream into ``rec``."""
    prompt = p.get("prompt") or (p["id"] + ":" + run.fillers[p["filler"]])[: p["prompt_bytes"]]
    body = {"prompt": prompt, "max_tokens": p["max_tokens"], "stream": True, "seed": p["seed"]}
    body.update(run.cfg.get("extra_body", {}))
    headers = dict(
        contract.build_headers(
            session=p["session"], tenant=p["tenant"], priority=p["priority"],
            deadline_ms=p["deadline_ms"], prompt_tokens=p["prompt_tokens"],
            max_tokens=p["max_tokens"],
        )
    )  # fmt: skip
    auth = run.cfg.get("auth_headers", {}).get(p["tenant"])
    if auth:
        headers["authorization"] = auth
    rec.sent_ns = run.now()
    with client.post(
        p["url"] + PATH, json=body, headers=headers, stream=True, name=PATH,
        timeout=p["timeout_ms"] / 1000.0, catch_response=True,
    ) as resp:  # fmt: skip
        rec.http_status = resp.status_code
        failure = getattr(resp, "error", None)  # locust's stand-in for a raise
        if isinstance(failure, requests.RequestException):
            raise failure
        if resp.status_code != 200:
            rec.outcome = "error"
            rec.error_code = resp.headers.get(contract.ERROR, "")
            resp.failure(rec.error_code or f"http {resp.status_code}")
            return
        rec.outcome = "completed"
        for line in resp.iter_lines():
            _sse(rec, line, run.now())
        resp.success()


def _send_next(client: HttpSession, run: _Run) -> None:
    """Take the plan's next request, wait for its time, send it, and record how it ended."""
    i = next(run.cursor)
    if i >= len(run.plan):
        raise StopUser()
    p = run.plan[i]
    target = run.start_ns + int(p["offset_s"] * 1e9)
    delay = (target - time.perf_counter_ns()) / 1e9
    if delay > 0:
        gevent.sleep(delay)
    cfg = run.cfg
    rec = new_record(planned_request(p), cfg["stack"], cfg["profile"], "locust", run.wall(target))
    rec.dispatch_ns, rec.replica = run.now(), p["url"]
    try:
        _post(client, p, rec, run)
    except requests.Timeout:
        rec.outcome = "lost"
    except Exception as exc:  # every request must end as exactly one record
        rec.outcome, rec.error_code = "error", f"client_{type(exc).__name__}"
    finally:
        rec.end_ns = run.now()
        if rec.outcome == "error" and not rec.error_code:
            rec.error_code = f"http_{rec.http_status}"
        run.writer.write(rec)
        if next(run.ended) == len(run.plan):
            run.all_ended()


def _user_class(run: _Run) -> type[HttpUser]:
    """The locust user for this plan: no think time, one planned request per task."""

    class PlanUser(HttpUser):
        host = run.cfg["host"]
        wait_time = constant(0)

        def on_start(self) -> None:
            self.client.verify = run.cfg["verify"]

        @task
        def send(self) -> None:
            _send_next(self.client, run)

    return PlanUser


def _write_stats(env: Environment, path: Path) -> None:
    total = env.stats.total
    stats = {
        "num_requests": total.num_requests,
        "num_failures": total.num_failures,
        "median_response_time": total.median_response_time,
        "avg_response_time": total.avg_response_time,
        "p99_response_time": total.get_response_time_percentile(0.99),
        "total_rps": total.total_rps,
    }
    path.write_text(json.dumps(stats))


def _bound_s(cfg: dict[str, Any], plan: Sequence[dict[str, Any]]) -> float:
    """The run's wall-clock bound: spawn, the plan's span, its longest request, a margin."""
    span = plan[-1]["offset_s"] if plan else 0.0
    longest = max((p["timeout_ms"] for p in plan), default=0) / 1000.0
    return float(cfg.get("bound_s") or start_delay_s(cfg["users"]) + span + longest + 5.0)


def _master(cfg: dict[str, Any]) -> int:
    """The master of a distributed run: its workers connected, one start time sent to them,
    the users spawned across them, done when every worker has finished its shard."""
    env = Environment(user_classes=[_placeholder_user()], events=events)
    runner = env.create_master_runner(cfg["bind_host"], int(cfg["master_port"]))
    done = itertools.count(1)

    def on_done(msg: Any, **_: Any) -> None:
        if next(done) == cfg["workers"]:
            gevent.spawn(runner.quit)

    runner.register_message(DONE, on_done)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while len(runner.clients.ready) < cfg["workers"]:
        if time.monotonic() > deadline:
            runner.quit()
            return 1
        gevent.sleep(0.1)
    start_ns = time.time_ns() + int(start_delay_s(cfg["users"]) * 1e9)
    runner.send_message(START, {"start_wall_ns": start_ns})
    runner.start(cfg["users"], spawn_rate=SPAWN_RATE)
    gevent.spawn_later(_bound_s(cfg, []), runner.quit)
    runner.greenlet.join()
    _write_stats(env, Path(cfg["stats"]))
    return 0


def _placeholder_user() -> type[HttpUser]:
    """The master's user class: the workers' by name (the master never runs one)."""

    class PlanUser(HttpUser):
        host = "http://127.0.0.1"
        wait_time = constant(0)

        @task
        def send(self) -> None:
            raise StopUser()

    return PlanUser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the plan headless, bounded by its span plus its longest request plus a margin: alone
    (``mode`` local), or as a master or a worker of locust's distributed mode."""
    args = argparse.ArgumentParser(prog="harness.loaders.locust_child", description=__doc__)
    args.add_argument("config")
    cfg = json.loads(Path(args.parse_args(argv).config).read_text())
    if cfg.get("mode") == MASTER:
        return _master(cfg)
    plan = json.loads(Path(cfg["plan"]).read_text())
    fillers = json.loads(Path(cfg["fillers"]).read_text())
    with JsonlWriter(cfg["records"]) as writer:
        run = _Run(cfg, plan, fillers, writer)
        env = Environment(user_classes=[_user_class(run)], events=events)
        if cfg.get("mode") == WORKER:
            run.runner = env.create_worker_runner(cfg["master_host"], int(cfg["master_port"]))
            run.runner.register_message(
                START, lambda msg, **_: _started(run, msg.data["start_wall_ns"])
            )
        else:
            run.runner = env.create_local_runner()
            run.runner.start(cfg["users"], spawn_rate=SPAWN_RATE)
            gevent.spawn_later(_bound_s(cfg, plan), run.runner.quit)
        run.runner.greenlet.join()
    if cfg.get("mode") != WORKER:
        _write_stats(env, Path(cfg["stats"]))
    return 0


def _started(run: _Run, start_wall_ns: int) -> None:
    """A worker told the start time: its plan goes from then (an empty shard is done now)."""
    run.start_wall_ns = int(start_wall_ns)
    if not run.plan:
        run.all_ended()
