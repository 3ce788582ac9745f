"""Chaos providers without a stack: the network proxy, process faults, SLI and recovery maths."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos import actions, netproxy, probes, recovery
from chaos.controls import (
    HEALTH_WATCH_S,
    StoppableSchedule,
    engine_source,
    until_the_window_holds_an_answer,
    watch_sdk_health,
)
from chaos.pressure import kv_prompt
from chaos.runner import add_arguments, chaos_settings, fault_target, run_command
from chaos.targets import ReplicaSpec, Target, read_target, write_target
from harness.capacity import kv_tokens
from harness.errors import UsageError
from harness.profile import load_profile
from harness.promptfit import target_tokens
from harness.schema import JsonlWriter, RequestRecord, read_jsonl, to_data
from harness.stacks import StackName, StackSpec, stack_kind, stand_up
from harness.workload import make_prompt
from serving.engine.tokenrules import BYTES_RULE
from serving.wire.tokens import BYTES_PER_TOKEN
from tests.support.httpserver import answering_url
from tests.support.models import BpeLikeRule

NS = 1_000_000_000
T0 = 1_800_000_000 * NS


# network proxy


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A loopback echo server in its own thread; yields its port."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(2.0)
        sock.close()


def round_trip(port: int, payload: bytes = b"ping", timeout: float = 3.0) -> tuple[bytes, float]:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        data = b""
        while len(data) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data, time.monotonic() - start


@pytest.fixture
def proxy() -> Iterator[netproxy.NetProxy]:
    with echo_server() as port, netproxy.NetProxy(f"127.0.0.1:{port}") as p:
        yield p


def test_proxy_passes_bytes_through_and_reports_status(proxy: netproxy.NetProxy) -> None:
    payload = bytes(range(256)) * 400
    data, _ = round_trip(proxy.port, payload)
    assert data == payload
    status = netproxy.command(proxy.control, "status")
    assert status["kind"] == "pass" and status["connections"] == 1


def test_proxy_delay_holds_each_direction_then_heals(proxy: netproxy.NetProxy) -> None:
    netproxy.command(proxy.control, "delay 150 both")
    data, both = round_trip(proxy.port)
    assert data == b"ping" and both >= 0.3
    netproxy.command(proxy.control, "delay 150 down")
    _, down = round_trip(proxy.port)
    assert down >= 0.15
    netproxy.command(proxy.control, "heal")
    data, _ = round_trip(proxy.port)
    assert data == b"ping"


def test_proxy_partition_refuse_resets_and_drop_black_holes(proxy: netproxy.NetProxy) -> None:
    netproxy.command(proxy.control, "partition refuse")
    with pytest.raises((ConnectionError, OSError)):
        data, _ = round_trip(proxy.port)
        if not data:
            raise ConnectionResetError("closed without an answer")
    netproxy.command(proxy.control, "partition drop")
    with pytest.raises(TimeoutError):
        round_trip(proxy.port, timeout=0.5)
    netproxy.command(proxy.control, "heal")
    assert round_trip(proxy.port)[0] == b"ping"


@pytest.mark.parametrize("line", ["", "delay", "delay -1", "delay 5 sideways", "partition", "x"])
def test_proxy_rejects_malformed_commands(line: str) -> None:
    with pytest.raises(ValueError):
        netproxy.parse_command(line)


def test_proxy_only_talks_to_loopback() -> None:
    with pytest.raises(ValueError):
        netproxy.NetProxy("192.0.2.1:80")


# process faults, against a stand-in process named in a target file


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    target = Target(
        stack="zerolayer",
        load_urls=["http://127.0.0.1:1"],
        protocol="h2",
        pids={"replica": [proc.pid]},
        replicas=[ReplicaSpec("http://127.0.0.1:1", proc.pid, 1, [])],
        engine_replicas=1,
    )
    path = write_target(tmp_path / "target.json", target)
    try:
        yield path, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()


def test_target_file_round_trips(sleeper: tuple[Path, subprocess.Popen[bytes]]) -> None:
    path, proc = sleeper
    target = read_target(path)
    assert target.replicas[0].pid == proc.pid and target.engine_role == "replica"
    assert target.kind is stack_kind(StackName.ZEROLAYER)
    assert orjson.loads(path.read_bytes())["stack"] == "zerolayer", "the file keeps the name"


def test_a_target_file_maps_its_stack_to_the_kind_on_load(tmp_path: Path) -> None:
    llm = Target("baseline", ["front"], "http1", baseline_app="llm", health_path="/v1/models")
    target = read_target(write_target(tmp_path / "llm.json", llm))
    assert target.kind is stack_kind(StackName.BASELINE, "llm") and target.engine_role == "engine"
    data = to_data(target) | {"stack": "nginx"}
    (tmp_path / "bad.json").write_bytes(orjson.dumps(data))
    with pytest.raises(ValueError, match="unknown stack 'nginx'"):
        read_target(tmp_path / "bad.json")


def test_pause_stops_then_always_resumes(sleeper: tuple[Path, subprocess.Popen[bytes]]) -> None:
    path, proc = sleeper
    conf = {"target_file": str(path)}
    seen: list[str] = []
    watcher = threading.Timer(0.2, lambda: seen.append(psutil.Process(proc.pid).status()))
    watcher.start()
    out = actions.pause("engine", duration_s=0.5, configuration=conf)
    watcher.join()
    assert seen == [psutil.STATUS_STOPPED]
    assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
    assert out["pids"] == [proc.pid] and out["end_ns"] > out["t_ns"]


def test_kill_takes_the_process_and_probes_see_it(
    sleeper: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    path, proc = sleeper
    conf = {"target_file": str(path)}
    assert probes.all_alive(probes.replicas(conf))
    out = actions.kill("engine", configuration=conf)
    proc.wait(5)
    assert out["pids"] == [proc.pid] and proc.returncode == -signal.SIGKILL
    assert not probes.all_alive(probes.replicas(conf))


SLOW_START = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))  # a start slower than the recovery allowance
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _dead_replica(tmp_path: Path, command: list[str], port: int) -> Path:
    """A target file whose one replica has exited and starts again with ``command``."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    url = f"http://127.0.0.1:{port}"
    replica = ReplicaSpec(url, gone.pid, port, command, str(tmp_path / "replica.log"))
    target = Target(stack="zerolayer", load_urls=[url], protocol="h2", replicas=[replica],
                    pids={"replica": [gone.pid]}, engine_replicas=1)  # fmt: skip
    return write_target(tmp_path / "target.json", target)


def test_a_restarted_replica_slower_than_the_allowance_is_waited_for_while_it_starts(
    tmp_path: Path,
) -> None:
    """The rollback's allowance is sized on the stand-up; a start that outlasts it on a host
    grown busier is still a start while its process runs (CI: "rollbacks that did not finish")."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-c", SLOW_START, str(port), "1.0"]
    conf = {"target_file": str(_dead_replica(tmp_path, command, port))}
    out = actions.restart_replicas(timeout_s=0.1, configuration=conf)
    try:
        assert [r["url"] for r in out["restarted"]] == [f"http://127.0.0.1:{port}"]
        assert probes.all_alive(probes.replicas(conf))
    finally:
        for item in out["restarted"]:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(item["pid"]).kill()


def test_a_restarted_replica_that_exits_fails_the_rollback_and_says_so(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "raise SystemExit(3)"]
    conf = {"target_file": str(_dead_replica(tmp_path, command, 1))}
    with pytest.raises(RuntimeError, match=r"did not come back: its process \(pid \d+\) exited"):
        actions.restart_replicas(timeout_s=0.1, configuration=conf)


@pytest.fixture
def healthy_target(tmp_path: Path) -> Iterator[Path]:
    """A target file whose one replica answers ``/health`` (a bare HTTP server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SLOW_START, str(port), "0"])
    url = f"http://127.0.0.1:{port}"
    replica = ReplicaSpec(url, server.pid, port, [], str(tmp_path / "replica.log"))
    target = Target(stack="zerolayer", load_urls=[url], protocol="h2", replicas=[replica],
                    pids={"replica": [server.pid]}, engine_replicas=1)  # fmt: skip
    try:
        yield write_target(tmp_path / "target.json", target)
    finally:
        server.kill()
        server.wait()


def _whole_after(monkeypatch: pytest.MonkeyPatch, polls: int, changing: int) -> list[int]:
    """The stack is whole from the ``polls``-th look on; its controller reports ``changing``
    replicas starting or stopping meanwhile. Returns the looks' count, as it grows."""
    looks = [0]

    def ready(target: Target) -> bool:
        looks[0] += 1
        return looks[0] >= polls

    monkeypatch.setattr(actions, "_ready", ready)
    monkeypatch.setattr(type(stack_kind("zerolayer")), "replicas_changing", lambda _: changing)
    return looks


def test_a_stack_not_whole_past_its_allowance_is_waited_for_while_a_replacement_runs(
    healthy_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests-under-load: Serve replaced a replica that missed its health checks, and the rollback
    gave up at the profile's 60 s while the replacement was starting. Here the allowance is
    spent at once, and the controller reports a replica starting until the stack is whole."""
    looks = _whole_after(monkeypatch, polls=3, changing=1)
    out = actions.wait_ready(timeout_s=0, configuration={"target_file": str(healthy_target)})
    assert out["ready"] is True and looks[0] >= 3


def test_a_stack_not_whole_past_its_allowance_with_nothing_starting_fails_at_once(
    healthy_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks = _whole_after(monkeypatch, polls=1_000, changing=0)
    with pytest.raises(RuntimeError, match="the zerolayer stack is not whole after 0 s"):
        actions.wait_ready(timeout_s=0, configuration={"target_file": str(healthy_target)})
    assert looks[0] <= 3


def test_acting_on_a_missing_component_records_its_absence(
    sleeper: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    path, proc = sleeper
    out = actions.kill("orchestrator", configuration={"target_file": str(path)})
    assert out["fault"] == actions.ABSENT and out["pids"] == []
    assert proc.poll() is None


def test_cpu_stress_is_bounded_and_leaves_nothing() -> None:
    out = actions.cpu_stress(duration_s=0.3, workers=2)
    assert len(out["pids"]) == 2
    assert not any(actions.alive(p) for p in out["pids"])


# SLI and recovery


def record(i: int, start_s: float, ttft_s: float | None, outcome: str = "completed",
           replica: str = "r0", end_s: float | None = None) -> RequestRecord:  # fmt: skip
    intended = T0 + int(start_s * NS)
    first = intended + int(ttft_s * NS) if ttft_s is not None else 0
    end = intended + int((end_s if end_s is not None else (ttft_s or 0) + 0.1) * NS)
    return RequestRecord(
        request_id=f"r{i}", stack="zerolayer", profile="d_fault", loader="native",
        intended_start_ns=intended, sent_ns=intended, first_token_ns=first, end_ns=end,
        outcome=outcome, error_code="" if outcome == "completed" else "engine_down",  # type: ignore[arg-type]
        replica=replica,
    )  # fmt: skip


def test_judge_knows_a_late_request_at_its_slo_not_at_its_end() -> None:
    late = probes.judge(record(0, 0.0, 5.0), slo_ttft_ms=1000)
    assert not late.good and late.known_ns == T0 + NS
    good = probes.judge(record(1, 0.0, 0.2), slo_ttft_ms=1000)
    assert good.good and good.known_ns == T0 + int(0.3 * NS)
    failed = probes.judge(record(2, 0.0, None, "error", end_s=0.05), slo_ttft_ms=1000)
    assert not failed.good and failed.known_ns == T0 + int(0.05 * NS)


def test_the_live_sli_sees_a_late_answer_when_it_ends_and_reads_it_bad(tmp_path: Path) -> None:
    """A stack slower than the SLO plus the window: its late answers are known bad at their
    deadline (the recovery figures), but live they show when they end, as a bad SLI, never as
    an empty window."""
    conf = {"requests_path": str(tmp_path / "requests.jsonl"), "sli_window_s": 60.0}
    now_s = (time.time_ns() - T0) / NS
    with JsonlWriter(conf["requests_path"]) as out:  # sent 200 s ago, first token after 199 s
        out.write(record(0, now_s - 200.0, 199.0))
    late = probes.judge(record(0, now_s - 200.0, 199.0), slo_ttft_ms=1000)
    assert late.known_ns < time.time_ns() - 60 * NS, "known bad long before the window"
    reading = probes.sli(conf)
    assert reading["requests"] == 1 and reading["sli"] == 0.0
    assert not probes.within_target(reading, conf)


def test_the_warmup_lasts_until_the_sli_window_holds_an_answer(tmp_path: Path) -> None:
    """The first hypothesis meets a window with an answer in it, however late the host gave
    the first one: the warm-up ends on the event (a record known within the window), and an
    empty log keeps it waiting until its limit."""
    conf = {"requests_path": str(tmp_path / "requests.jsonl"), "sli_window_s": 60.0}
    written = threading.Event()

    def answer_later() -> None:
        time.sleep(0.3)
        now_s = (time.time_ns() - T0) / NS
        with JsonlWriter(conf["requests_path"]) as out:
            out.write(record(0, now_s - 0.2, 0.1))
        written.set()

    threading.Thread(target=answer_later, daemon=True).start()
    until_the_window_holds_an_answer(conf, limit_s=600.0)
    assert probes.sli(conf)["requests"] == 1, "it ended on the answer, not on its limit"
    assert written.wait(timeout=600.0)
    empty = {"requests_path": str(tmp_path / "none.jsonl"), "sli_window_s": 60.0}
    waited = until_the_window_holds_an_answer(empty, limit_s=0.2)
    assert waited >= 0.2 and probes.sli(empty)["requests"] == 0


def _a_bad_window(tmp_path: Path) -> dict[str, Any]:
    """A request log whose SLI window holds one late answer: not within target."""
    conf = {"requests_path": str(tmp_path / "requests.jsonl"), "sli_window_s": 60.0}
    now_s = (time.time_ns() - T0) / NS
    with JsonlWriter(conf["requests_path"]) as out:
        out.write(record(0, now_s - 10.0, 5.0))
    return conf


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every reading of the SLI a probe takes, from here on."""
    reads: list[dict[str, Any]] = []
    real = probes.sli

    def counted(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
        reads.append(real(configuration))
        return reads[-1]

    monkeypatch.setattr(probes, "sli", counted)
    return reads


def test_a_wait_for_the_sli_to_recover_ends_when_no_load_can_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no load running nothing more comes back, so the wait reads the window once and
    ends, whatever its timeout (CI's host spent a timeout grown with its stand-up here)."""
    conf = _a_bad_window(tmp_path)
    reads = _counting_reads(monkeypatch)
    reading = probes.sli_recovers(timeout_s=2.0, configuration=conf)
    assert len(reads) == 1, "it read the window again after the load had ended"
    assert reading["requests"] == 1 and not probes.within_target(reading, conf)


def test_a_wait_for_the_sli_to_recover_polls_while_the_load_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the load runs, a window below target is read again until the timeout."""
    conf = _a_bad_window(tmp_path)
    monkeypatch.setattr(probes, "load_running", lambda: True)
    reads = _counting_reads(monkeypatch)
    reading = probes.sli_recovers(timeout_s=0.5, configuration=conf)
    assert len(reads) >= 2 and reading["waited_s"] >= 0.5
    assert not probes.within_target(reading, conf)


def synthetic_run() -> tuple[list[RequestRecord], dict]:
    """10 req/s for 10 s; a fault at t=3 s fails everything on r1 sent in [3, 5)."""
    records = []
    for i in range(100):
        t = i / 10
        bad = 3.0 <= t < 5.0 and i % 2 == 1
        replica = "r1" if i % 2 else "r0"
        records.append(record(i, t, None if bad else 0.1, "error" if bad else "completed",
                              replica, end_s=0.01 if bad else None))  # fmt: skip
    fault = {"fault": "kill", "role": "replica", "pids": [1], "urls": ["r1"], "t_ns": T0 + 3 * NS}
    journal = {
        "status": "completed",
        "steady_states": {"before": {"steady_state_met": True}, "after": None},
        "run": [{"activity": {"type": "action"}, "output": fault, "start": "", "end": ""}],
        "rollbacks": [{"status": "succeeded"}],
    }
    return records, journal


def test_recovery_metrics_from_a_known_timeline() -> None:
    records, journal = synthetic_run()
    target = Target("zerolayer", ["r0", "r1"], "h2", {"replica": [1, 2]},
                    [ReplicaSpec("r0", 2, 0, []), ReplicaSpec("r1", 1, 0, [])],
                    engine_replicas=2)  # fmt: skip
    row = recovery.compute(records, journal, target, experiment="x", slo_ttft_ms=1000,
                           window_s=1.0, sli_target=0.9)  # fmt: skip
    assert (row.requests, row.failed, row.lost, row.bad) == (100, 10, 0, 10)
    # failures known at 3.11 and 3.31 s against nine good ones in the window: 9/11 < 0.9
    assert row.time_to_detect_s == pytest.approx(0.35, abs=0.051)
    # the last failure is known at t=4.91 s; a 1 s window clears it at 5.91 s
    assert row.time_to_recover_s == pytest.approx(2.95, abs=0.051)
    assert row.blast_radius_replicas == 0.5 and row.replicas_affected == ["r1"]
    assert row.blast_radius_requests == pytest.approx(10 / 30, abs=0.04)
    assert row.error_budget_burn == pytest.approx(row.blast_radius_requests / 0.1)
    assert row.hypothesis_before is True and row.rollbacks_ok


def test_a_fault_the_slo_never_sees_has_no_detection() -> None:
    records = [record(i, i / 10, 0.1) for i in range(50)]
    _, journal = synthetic_run()
    target = Target("baseline", ["front"], "http1", {"engine": [1, 2]}, engine_replicas=2)
    journal["run"][0]["output"] = {"fault": "kill", "role": "orchestrator", "t_ns": T0 + 2 * NS}
    row = recovery.compute(records, journal, target, experiment="x", slo_ttft_ms=1000,
                           window_s=1.0, sli_target=0.9)  # fmt: skip
    assert row.time_to_detect_s is None and row.time_to_recover_s is None and row.bad == 0
    assert row.blast_radius_replicas == 1.0  # every request passes the orchestrator


@pytest.mark.parametrize(("stack", "everyone"), [("baseline", True), ("zerolayer", False)])
def test_a_network_fault_reaches_every_replica_only_behind_a_front_door(
    stack: str, everyone: bool
) -> None:
    """The proxy stands in front of the baseline's front door, but of one zero-layer replica."""
    replicas = [ReplicaSpec("r0", 1, 0, []), ReplicaSpec("r1", 2, 0, [])]
    target = Target(stack, ["proxy", "r1"], "h2", replicas=replicas, netproxy_url="proxy",
                    netproxy_front="r0", engine_replicas=2)  # fmt: skip
    out = {"fault": "delay", "urls": ["proxy"], "t_ns": T0}
    hit, total = recovery.affected_replicas(target, [out], [])
    assert total == 2 and (len(hit) == 2) is everyone
    if not everyone:
        assert hit == {"r0"}, "the proxy's URL is the replica behind it"


def test_the_sdk_health_log_records_a_change_when_the_sdk_made_it(tmp_path: Path) -> None:
    """A request routed between a change of the SDK's verdict and the watcher's next look is
    judged against the change (profile D's reroute time, the paused-replica test): the log
    holds the SDK's own stamp, not the time the watcher looked."""
    from zerolayer.client import ZeroLayerClient

    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    path = tmp_path / "sdk-health.jsonl"

    async def go() -> int:
        client = ZeroLayerClient(urls, health_interval_s=0)
        watcher = asyncio.create_task(watch_sdk_health(client, path))
        await asyncio.sleep(0)  # the watcher has written the starting state
        client.replicas[urls[0]].force_down()
        stamp = client.replicas[urls[0]].changed_ns
        # The watcher's next look is due before this sleep ends (timers run in due order).
        await asyncio.sleep(2 * HEALTH_WATCH_S)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return stamp

    stamp = asyncio.run(go())
    rows = read_jsonl(path)
    assert [(r["url"], r["up"]) for r in rows] == [
        (urls[0], True),
        (urls[1], True),
        (urls[0], False),
    ]
    assert rows[2]["t_ns"] == stamp


def test_stoppable_schedule_ends_iteration_but_keeps_its_length() -> None:
    schedule = StoppableSchedule(list(range(10)))  # type: ignore[arg-type]
    seen = []
    for item in schedule:
        seen.append(item)
        if item == 3:
            schedule.stop()
    assert seen == [0, 1, 2, 3] and len(schedule) == 10 and schedule[9] == 9


def test_sdk_reroute_is_the_first_down_mark_after_the_fault() -> None:
    health = [
        {"t_ns": T0, "url": "r1", "up": True},
        {"t_ns": T0 + NS // 2, "url": "r0", "up": False},
        {"t_ns": T0 + 2 * NS, "url": "r1", "up": False},
    ]
    assert recovery.sdk_reroute_s(health, ["r1"], T0 + NS) == pytest.approx(1.0)
    assert recovery.sdk_reroute_s(health, ["r2"], T0) is None


def test_kv_pressure_is_sized_from_the_engine_kv_cache_alike_on_both_stacks() -> None:
    sc = chaos_settings(load_profile("d_fault", "smoke"))
    for options in ({"num_kv_blocks": 2048}, {}):
        zl, bl = (
            StackSpec(name, "sim", options, 3) for name in (StackName.ZEROLAYER, StackName.BASELINE)
        )
        prompt = kv_prompt(zl, sc, BYTES_RULE)
        assert prompt == kv_prompt(bl, sc, BYTES_RULE), "both stacks get the same pressure"
        assert prompt.prompt_bytes == prompt.tokens * BYTES_PER_TOKEN
        kv = kv_tokens("sim", options)
        assert kv is not None
        asked = sc.kv_requests * prompt.tokens  # the prompts alone: the cache fills as they arrive
        if prompt.tokens + sc.kv_max_tokens < 131_072:  # not capped by the context length
            assert kv * sc.kv_fill <= asked < kv * sc.kv_fill + sc.kv_requests
    capped = StackSpec(StackName.ZEROLAYER, "sim", {"max_model_len": 4096}, 2)
    assert kv_prompt(capped, sc, BYTES_RULE).tokens == target_tokens(10**6, sc.kv_max_tokens, 4096)
    unknown = StackSpec(StackName.ZEROLAYER, "torch", {}, 2)
    assert kv_prompt(unknown, sc, BYTES_RULE).tokens == sc.kv_prompt_tokens
    # A cache larger than the sim's own default context (131,072): capped to that context.
    big = StackSpec(StackName.ZEROLAYER, "sim", {"num_kv_blocks": 10**6}, 2)
    assert kv_prompt(big, sc, BYTES_RULE).tokens + sc.kv_max_tokens <= 131_072


def test_kv_pressure_prompts_fit_the_models_own_context(tmp_path: Path) -> None:
    # vLLM's KV size is not modelled, so the profile's figure is asked: it must still fit a
    # model of 2,048 positions (every KV-pressure request was refused prompt_too_long).
    sc = chaos_settings(load_profile("d_fault", "smoke"))
    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048}
    (model / "config.json").write_bytes(orjson.dumps({**config, "vocab_size": 512}))
    spec = StackSpec(StackName.ZEROLAYER, "vllm", {"model": str(model)}, 1)
    assert sc.kv_prompt_tokens + sc.kv_max_tokens > 2048, "the profile asks for more"
    tokens = kv_prompt(spec, sc, BYTES_RULE).tokens
    assert tokens == target_tokens(sc.kv_prompt_tokens, sc.kv_max_tokens, 2048) < 2048 - 1024
    tight = StackSpec(StackName.ZEROLAYER, "vllm", {"max_model_len": sc.kv_max_tokens}, 1)
    assert kv_prompt(tight, sc, BYTES_RULE).tokens == 1, "no room: each request is refused"


@settings(max_examples=40, deadline=None)
@given(context=st.integers(min_value=1100, max_value=8192), head=st.integers(0, 999))
def test_kv_pressure_prompts_fit_the_context_under_the_engines_tokenizer(
    context: int, head: int
) -> None:
    """Under a tokenizer of fewer bytes a token than the wire's four, the pressure's prompts are
    sized in its tokens: at four bytes a token a 2,048-position model refused every one of them
    prompt_too_long, as the action builds them."""
    sc = chaos_settings(load_profile("d_fault", "smoke"))
    rule = BpeLikeRule()
    spec = StackSpec(StackName.ZEROLAYER, "vllm", {"max_model_len": context}, 1)
    prompt = kv_prompt(spec, sc, rule)
    text = make_prompt(f"kv-pressure-1-{head}", prompt.prompt_bytes)
    assert prompt.tokens + sc.kv_max_tokens <= context
    assert abs(rule.count(text) - prompt.tokens) <= 1  # as a profile's classes are fitted


def test_chaos_refuses_an_external_stack_and_a_profile_without_chaos(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no \\[chaos\\] settings"):
        chaos_settings(load_profile("a_latency", "smoke"))
    with answering_url() as url:
        stack = stand_up(StackSpec(StackName.ZEROLAYER, urls=(url,)), tmp_path)
        with pytest.raises(ValueError, match="external"), fault_target(stack, tmp_path):
            pass


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine-option", "num_kv_blockz=4"], "num_kv_blockz"),
        (["--replicas", "0"], "--replicas"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_chaos_command_mistakes_are_usage_errors(argv: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UsageError, match=message):
        run_command(parser.parse_args(argv))


def test_chaos_telemetry_reads_the_stack_engines(tmp_path: Path) -> None:
    stats = tmp_path / "engine-stats-0.jsonl"
    stats.write_text(
        '{"t_ns": 1, "running": 1, "waiting": 0, "kv_blocks_used": 8, "kv_blocks_total": 16,'
        ' "live_tokens": 100, "preemptions": 0, "busy_time_s": 0.1, "allocator": {}}\n'
    )
    target = Target(
        stack="baseline",
        load_urls=["http://127.0.0.1:1"],
        protocol="http1",
        engine_stats_files=[str(stats)],
    )
    rows = engine_source(target).read()
    assert [(r["name"], r["up"], r["kv_blocks_total"]) for r in rows] == [("serve-0", 1, 16)]
    zl = Target(stack="zerolayer", load_urls=[], protocol="h2",
                engine_metrics=["http://127.0.0.1:1/metrics"])  # fmt: skip
    assert [(r["name"], r["up"]) for r in engine_source(zl).read()] == [("zl-0", 0)]


def test_chaos_test_allowances_grow_with_the_measured_stand_up() -> None:
    from chaos.runner import RECOVERY_PER_STAND_UP
    from tests.support.chaos_checks import DEADLINE_CAP_MS, allowing

    profile = load_profile("d_fault", "smoke")
    sc = chaos_settings(profile)
    assert allowing(profile, 0.1).chaos == sc, "a quick machine keeps the profile's figures"
    slow = chaos_settings(allowing(profile, 30.0))
    assert slow.deadline_ms == int(RECOVERY_PER_STAND_UP * 30.0 * 1000)
    assert slow.recover_timeout_s == RECOVERY_PER_STAND_UP * 30.0
    # capped so that one experiment fits the test's guard (past the cap a request is lost)
    assert chaos_settings(allowing(profile, 1e6)).deadline_ms == DEADLINE_CAP_MS < 900_000


def test_recovery_waits_at_least_as_long_as_the_engine_takes_to_start() -> None:
    """A killed replica over vLLM loads its engine again; the smoke scale's 15 s cannot cover it."""
    from chaos.runner import ENGINE_START_S, chaos_settings, for_engine
    from harness.profile import load_profile

    smoke = chaos_settings(load_profile("d_fault", "smoke", None))
    assert smoke.recover_timeout_s < ENGINE_START_S["vllm"]
    assert for_engine(smoke, "vllm").recover_timeout_s == ENGINE_START_S["vllm"]
    assert for_engine(smoke, "vllm").deadline_ms == smoke.deadline_ms
    assert for_engine(smoke, "sim") is smoke


def test_recovery_waits_longer_on_a_host_slow_to_stand_the_stack_up() -> None:
    """A run's recovery cap grows with its stack's measured stand-up (a loaded host restarts a
    killed part slower than the scale's quiet one), never below the scale's own figure."""
    from chaos.runner import RECOVERY_PER_STAND_UP, chaos_settings, for_host
    from harness.profile import load_profile

    smoke = chaos_settings(load_profile("d_fault", "smoke", None))
    assert for_host(smoke, None) is smoke, "an external stack's stand-up says nothing"
    assert for_host(smoke, 0.5) is smoke, "a quick stand-up keeps the scale's bound"
    slow = for_host(smoke, 20.0)
    assert slow.recover_timeout_s == RECOVERY_PER_STAND_UP * 20.0 > smoke.recover_timeout_s
    assert dataclasses.replace(slow, recover_timeout_s=smoke.recover_timeout_s) == smoke


def test_baseline_pids_count_ray_serve_llm_replicas_not_their_engine_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray Serve LLM's ingress and router are both the orchestrator; a replica's engine core
    is its child (killed and replaced with it), so ``engine`` counts replicas."""
    import ray

    from baselines.rayserve_llm import standup
    from chaos.actions import baseline_pids

    found = {
        "controller": [1],
        "proxy": [2],
        "ingress": [3],
        "router": [4],
        "engine": [6, 5],
        "engine_core": [7, 8],
    }
    monkeypatch.setattr(standup, "llm_actor_pids", lambda: found)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert baseline_pids("llm") == {}, "not attached to Ray: nothing to ask"
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert baseline_pids("llm") == {
        "controller": [1],
        "proxy": [2],
        "orchestrator": [3, 4],
        "engine": [5, 6],
    }
