"""Telemetry: the absolute schedule, phase labels, and each source against the real thing."""

from __future__ import annotations

import asyncio
import collections
import http.server
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.schema import Machine, read_jsonl
from harness.telemetry import (
    Availability,
    Component,
    EngineSource,
    EngineTarget,
    NvmlSource,
    PhaseLog,
    ProcessSource,
    Sampler,
    host,
    parse_prometheus,
)
from harness.telemetry.engine import stats_row
from harness.telemetry.process import ProcessCpu, cpu_seconds, cpu_spent, read_cpu
from serving.engine import EngineRequest, EngineStats, SimConfig, SimEngine
from tests.support.httpserver import answering_url


def _nvml_present() -> bool:
    source = NvmlSource()
    avail = source.open()
    source.close()
    return avail.available


HAS_GPU = _nvml_present()


class StallingSource:
    """A source whose third read takes three intervals, to test the schedule's catch-up."""

    kind = "stall"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.reads = 0

    def open(self) -> Availability:
        return Availability(True)

    def read(self) -> list[dict[str, Any]]:
        self.reads += 1
        if self.reads == 3:
            time.sleep(3.5 * self.interval_s)
        return [{"name": "s", "reads": self.reads}]

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def _wait_for_ticks(sampler: Sampler, ticks: int, limit_s: float = 60.0) -> None:
    """Until ``sampler`` has finished ``ticks`` ticks: events, not a time (the limit is a hang
    guard). Its rows then cover every tick before; the one running now may straddle an event."""
    deadline = time.monotonic() + limit_s
    while sampler.ticks < ticks:
        assert time.monotonic() < deadline, f"{sampler.ticks} of {ticks} ticks"
        time.sleep(0.005)


def test_schedule_is_absolute_and_a_stall_counts_missed_ticks(tmp_path: Path) -> None:
    interval = 0.05
    sampler = Sampler([StallingSource(interval)], tmp_path / "t.jsonl", interval_s=interval)
    with sampler:
        _wait_for_ticks(sampler, 6)  # the stall is the third
    rows = read_jsonl(tmp_path / "t.jsonl")
    seqs = [r["seq"] for r in rows]
    assert seqs == sorted(set(seqs)), "one row per tick, in order"
    assert sampler.missed >= 2, "the stall's ticks are counted, not shifted"
    assert any(b - a > 1 for a, b in itertools.pairwise(seqs)), "the schedule skipped"
    t0 = rows[0]["sched_ns"]
    for row in rows:
        assert row["sched_ns"] == t0 + row["seq"] * int(interval * 1e9)
        assert row["t_ns"] >= row["sched_ns"] - 2_000_000


def test_rows_carry_the_phase_they_were_sampled_in(tmp_path: Path) -> None:
    """Ticks are counted around each phase event, not timed: a tick finished before an event
    was sampled before it, and one started after the event was seen finishing after it."""
    phases = PhaseLog(tmp_path / "phases.jsonl")
    source = ProcessSource([Component("me", os.getpid(), "loader")])
    with Sampler([source], tmp_path / "t.jsonl", interval_s=0.02, phases=phases) as sampler:
        _wait_for_ticks(sampler, 3)
        before = sampler.ticks
        phases.begin("zerolayer/a_latency", stack="zerolayer")
        first_in = sampler.ticks + 1
        _wait_for_ticks(sampler, first_in + 3)
        phases.fault("kill replica-0", stack="zerolayer")
        last_in = sampler.ticks
        phases.end()
        first_after = sampler.ticks + 1
        _wait_for_ticks(sampler, first_after + 3)
    phases.close()
    rows = read_jsonl(tmp_path / "t.jsonl")  # a row a tick: one source, one process
    events = read_jsonl(tmp_path / "phases.jsonl")
    assert [(e["kind"], e["event"]) for e in events] == [
        ("phase", "start"),
        ("fault", "start"),
        ("phase", "end"),
    ]
    start, end = events[0]["t_ns"], events[2]["t_ns"]
    inside, outside = rows[first_in:last_in], rows[:before] + rows[first_after:]
    assert len(inside) >= 3 and len(outside) >= 6
    assert all(start < r["t_ns"] < end for r in inside)
    assert all(r["t_ns"] < start or r["t_ns"] > end for r in outside)
    assert all(r["phase"] == "zerolayer/a_latency" for r in inside)
    assert all(r["phase"] == "idle" for r in outside)
    assert all(r["rss_bytes"] > 1_000_000 for r in rows)


def test_engine_source_follows_a_loaded_sim_engine(tmp_path: Path) -> None:
    """The engine stays loaded for five of the sampler's ticks (requests far longer than that,
    aborted then), and idle for two more: events, not a time, however slow the host."""

    async def ticks(sampler: Sampler, n: int) -> None:
        deadline = time.monotonic() + 60.0  # a hang guard
        while sampler.ticks < n:
            assert time.monotonic() < deadline, f"{sampler.ticks} of {n} ticks"
            await asyncio.sleep(0.005)

    async def main() -> None:
        engine = SimEngine(SimConfig(model_shape="llama-3.2-1b", max_num_seqs=8))
        source = EngineSource([EngineTarget.in_process("engine0", "zerolayer", engine)])
        with Sampler([source], tmp_path / "t.jsonl", interval_s=0.02) as sampler:

            async def one(i: int) -> None:
                async for _ in engine.generate(EngineRequest(f"r{i}", 100 + i, 2000, seed=i)):
                    pass

            tasks = [asyncio.create_task(one(i)) for i in range(24)]
            while engine.stats().running < 8:
                await asyncio.sleep(0.001)
            await ticks(sampler, sampler.ticks + 6)
            for i in range(24):
                engine.abort(f"r{i}")
            await asyncio.gather(*tasks)
            await ticks(sampler, sampler.ticks + 2)
        await engine.close()

    asyncio.run(main())
    rows = read_jsonl(tmp_path / "t.jsonl")
    assert all(r["source"] == "engine" and r["stack"] == "zerolayer" for r in rows)
    assert max(r["running"] for r in rows) == 8, "max_num_seqs caps the batch"
    assert max(r["waiting"] for r in rows) > 0
    assert max(r["kv_usage"] for r in rows) > 0
    loaded = [r for r in rows if r["kv_blocks_used"]]
    assert loaded and all(0.0 <= r["kv_waste"] < 1.0 for r in loaded)
    busy = [r["engine_busy"] for r in rows if "engine_busy" in r]
    assert max(busy) > 0.5, "the engine stepped most of the time while loaded"
    assert rows[-1]["running"] == 0 and rows[-1]["kv_usage"] == 0


def test_allocator_split_ratio_when_the_engine_exports_it(tmp_path: Path) -> None:
    stats = EngineStats(
        kv_blocks_used=10,
        kv_blocks_total=100,
        live_tokens=120,
        allocator={"inactive_split_bytes.all.current": 3e8, "reserved_bytes.all.current": 2e9},
    )
    row = stats_row(stats)
    assert row["kv_waste"] == pytest.approx(1 - 120 / 160)
    source = EngineSource([EngineTarget("gpu-engine", "zerolayer", lambda: stats_row(stats))])
    (out,) = source.read()
    assert out["alloc_split_ratio"] == pytest.approx(0.15)
    assert (
        "alloc_split_ratio"
        not in EngineSource(
            [EngineTarget("sim", "zerolayer", lambda: stats_row(EngineStats()))]
        ).read()[0]
    )


VLLM_TEXT = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_preemptions_total{engine="0",model_name="llama"} 2.0
zl_refusals_total{code="queue_full"} 4
zl_refusals_total{code="kv_exhausted"} 1
zl_kv_waste_ratio 0.0625
zl_requests_total{outcome="completed"} 40
zl_requests_total{outcome="error"} 2
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1200.0
vllm:prefix_cache_queries_created{engine="0",model_name="llama"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 900.0
"""


@pytest.fixture
def metrics_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = VLLM_TEXT.encode() if self.path == "/metrics" else b'{"kv_usage": 0.5}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with answering_url(Handler) as url:
        yield url


def test_prometheus_scrape_and_a_replica_that_is_down(metrics_server: str) -> None:
    values = parse_prometheus(VLLM_TEXT)
    assert values["zl_refusals_total"] == 5, "labelled series of one name are summed"
    down = EngineTarget.metrics("r1", "zerolayer", "http://127.0.0.1:9/metrics", timeout_s=0.5)
    source = EngineSource(
        [
            EngineTarget.metrics("r0", "zerolayer", f"{metrics_server}/metrics"),
            EngineTarget.health("r0h", "zerolayer", f"{metrics_server}/health"),
            down,
        ]
    )
    up, health, gone = source.read()
    assert (up["kv_usage"], up["running"], up["waiting"], up["preemptions"]) == (0.25, 7, 3, 2)
    assert up["kv_waste"] == 0.0625 and up["up"] == 1
    assert up["requests_total"] == 42, "requests served, every outcome, for per-replica spread"
    assert (up["prefix_cache_queries"], up["prefix_cache_hits"]) == (1200, 900)
    assert "prefix_cache_queries" not in health, "/health has no prefix-cache counters"
    assert health["kv_usage"] == 0.5
    assert gone["up"] == 0 and "error" in gone


def _started(code: str) -> subprocess.Popen[str]:
    """A Python child running ``code`` once it has said it is past its start-up."""
    ready = "import time\nprint('ready', flush=True)\n"
    proc = subprocess.Popen([sys.executable, "-c", ready + code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _gain_cpu(pid: int, seconds: float, limit_s: float = 60.0) -> None:
    """Until process ``pid`` has spent ``seconds`` more CPU (the limit is a hang guard)."""
    proc = psutil.Process(pid)
    target, deadline = cpu_seconds(proc) + seconds, time.monotonic() + limit_s
    while cpu_seconds(proc) < target:
        assert time.monotonic() < deadline, f"{pid} spent under {seconds} s of CPU"
        time.sleep(0.02)


def test_process_source_sees_a_busy_child_and_its_exit(tmp_path: Path) -> None:
    """Over a window that lasts until the busy child has spent 0.3 s of CPU (however small its
    share of a loaded host), the idle child, past its start-up, spent next to none."""
    busy = _started("t = time.monotonic()\nwhile time.monotonic() - t < 120: pass\n")
    idle = _started("time.sleep(120)\n")
    try:
        source = ProcessSource(
            [Component("busy", busy.pid, "orchestrator"), Component("idle", idle.pid, "replica")]
        )
        _gain_cpu(busy.pid, 0.3)
        rows = {r["name"]: r for r in source.read()}
        assert rows["busy"]["cpu_pct"] > 10 * rows["idle"]["cpu_pct"], rows
        assert rows["busy"]["role"] == "orchestrator" and rows["idle"]["rss_bytes"] > 0
        busy.kill()
        busy.wait()
        rows = {r["name"]: r for r in source.read()}
        assert rows["busy"]["alive"] == 0 and rows["idle"]["alive"] == 1
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.communicate()


def _tree_of_two(parent: subprocess.Popen[str]) -> dict[int, ProcessCpu]:
    """The reading of ``parent``'s tree once its child has started."""
    deadline = time.monotonic() + 20
    while len(reading := read_cpu([parent.pid])) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return reading


def test_read_cpu_covers_a_process_tree_and_cpu_spent_what_each_spent() -> None:
    """The window lasts until the spinning parent has spent 0.3 s of CPU, and starts once its
    sleeping child is past its start-up (it says so), however loaded the host."""
    code = (
        "import subprocess, sys\n"
        "sleeper = 'import time; print(\"ready\", flush=True); time.sleep(120)'\n"
        "child = subprocess.Popen([sys.executable, '-c', sleeper])\n"
        "while True: pass\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "ready\n"
        before = _tree_of_two(parent)
        _gain_cpu(parent.pid, 0.3)
        after = read_cpu([parent.pid])
        assert parent.pid in after and len(after) == 2, "the parent and its child"
        spent = cpu_spent(before, after)
        (child,) = set(after) - {parent.pid}
        assert spent[parent.pid].seconds > max(0.05, spent[child].seconds), spent
        assert spent.keys() == after.keys()
        assert all(p.name.startswith("python") for p in after.values())
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.communicate()
    assert read_cpu([parent.pid]) == {}, "a gone process is left out"


def test_cpu_spent_counts_new_processes_whole_and_leaves_gone_ones_out() -> None:
    before = {1: ProcessCpu("a", 10.0), 2: ProcessCpu("gone", 7.0), 3: ProcessCpu("reused", 9.0)}
    after = {1: ProcessCpu("a", 10.5), 3: ProcessCpu("reused", 1.0), 4: ProcessCpu("new", 2.0)}
    spent = cpu_spent(before, after)
    assert spent == {
        1: ProcessCpu("a", 0.5),
        3: ProcessCpu("reused", 0.0),
        4: ProcessCpu("new", 2.0),
    }
    assert cpu_seconds(psutil.Process()) > 0


def test_component_roles_are_checked() -> None:
    with pytest.raises(ValueError, match="role"):
        Component("x", 1, "router")


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU fallback")
def test_nvml_without_a_gpu_is_unavailable_with_a_reason(tmp_path: Path) -> None:
    sampler = Sampler([NvmlSource()], tmp_path / "t.jsonl", interval_s=0.02)
    with sampler:
        time.sleep(0.05)
    (meta,) = sampler.describe().sources
    assert meta["available"] is False and "NVML" in meta["reason"]
    assert read_jsonl(tmp_path / "t.jsonl") == []


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU and driver")
def test_nvml_reads_memory_v2_and_utilisation(tmp_path: Path) -> None:
    sampler = Sampler([NvmlSource()], tmp_path / "t.jsonl", interval_s=0.1)
    with sampler:
        time.sleep(1.0)
    rows = read_jsonl(tmp_path / "t.jsonl")
    assert rows and all(r["mem_total_bytes"] > r["mem_used_bytes"] > 0 for r in rows)
    assert all(r["mem_reserved_bytes"] >= 0 for r in rows)
    utils = [r["gpu_util_pct"] for r in rows if r["gpu_util_pct"] is not None]
    assert utils and all(0 <= u <= 100 for u in utils)
    assert all(r["nvlink_errors"] is None or r["nvlink_errors"] >= 0 for r in rows)


class FakeNvml:
    """A test double of NVML's NVLink calls (no GPU here): links 0 and 2 active, counters set
    per (link, counter); every other link raises NVML's not-supported error."""

    NVML_NVLINK_MAX_LINKS = 4
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3

    class NVMLError(Exception):
        pass

    def __init__(self, counters: dict[tuple[int, int], int]) -> None:
        self.counters = counters

    def nvmlDeviceGetNvLinkState(self, handle: object, link: int) -> int:
        if link == 3:
            raise self.NVMLError("not supported")
        return int(link in (0, 2))

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: object, link: int, kind: int) -> int:
        return self.counters.get((link, kind), 0)


def test_nvlink_errors_sum_every_counter_of_the_active_links_only() -> None:
    source = NvmlSource()
    source._nvml = FakeNvml({(0, 0): 2, (0, 3): 5, (2, 1): 1, (1, 0): 100})
    assert source._nvlink_errors(object()) == 8, "link 1 is inactive, link 3 unsupported"
    source._nvml = FakeNvml({})
    assert source._nvlink_errors(object()) == 0
    no_links = FakeNvml({})
    no_links.NVML_NVLINK_MAX_LINKS = 0
    source._nvml = no_links
    assert source._nvlink_errors(object()) is None, "a GPU without NVLink has no figure"


def test_baseline_replica_stats_file_round_trips(tmp_path: Path) -> None:
    """A Serve engine replica publishes its stats; the sampler reads the newest snapshot."""
    from baselines.rayserve.engine_replica import publish_stats
    from serving.engine import EngineRequest, SimConfig, SimEngine

    engine = SimEngine(SimConfig(model_shape="llama-3.2-1b", num_kv_blocks=64))
    path = tmp_path / "engine-stats-1.jsonl"
    target = EngineTarget.stats_file("serve-0", "baseline", path)
    with pytest.raises(OSError):
        target.read()
    publish_stats(path, engine.stats())
    engine.add_request(EngineRequest("a", 40, 8))
    engine.commit(engine.schedule())
    publish_stats(path, replace(engine.stats(), prefix_cache_queries=40, prefix_cache_hits=16))
    row = target.read()
    assert row["running"] == 1
    assert (row["prefix_cache_queries"], row["prefix_cache_hits"]) == (40, 16)
    assert row["kv_blocks_used"] == 3 and row["live_tokens"] == 40
    assert row["kv_usage"] == pytest.approx(3 / 64)
    assert row["kv_waste"] == pytest.approx(1 - 40 / 48)


def test_two_runs_on_hosts_of_different_speed_say_so() -> None:
    fast = Machine(cpu_speed_start=900_000, cpu_speed_end=880_000)
    slow = Machine(cpu_speed_start=640_000, cpu_speed_end=700_000)
    note = host.speed_note(fast, slow)
    assert "A 880,000, B 640,000 digests/s per core (-27%)" in note
    assert host.speed_note(fast, Machine(cpu_speed_start=800_000)) == ""  # within 25 %
    assert host.speed_note(fast, Machine()) == ""  # an older run without the probe
    assert host.cpu_speed(duration_s=0.01, probes=2) > 0


def test_host_busy_share_counts_all_but_idle_and_iowait() -> None:
    Times = collections.namedtuple("Times", "user nice system idle iowait steal guest")
    before = Times(10, 0, 5, 80, 5, 0, 3)
    after = Times(40, 0, 15, 110, 15, 20, 9)  # 30 user + 10 system + 20 steal busy, 40 idle
    assert host.busy_pct(before, after) == pytest.approx(60.0)
    assert host.HostCpu(91.0, 100.0, 2).saturated and not host.HostCpu(89.0, 89.0, 2).saturated
    # one pegged core of two is saturation too: the mean alone never sees it
    assert host.HostCpu(55.0, 100.0, 2).saturated and not host.HostCpu(55.0, 60.0, 2).saturated
