"""``zl-bench run``: a crash, a signal mid-profile and mid-experiment, what a summary row carries
(the README's own smoke run end to end is ``test_readme_bench``)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest

from bench import run as bench_run
from harness import schema
from harness.loaders import LoadResult
from harness.metrics import summarize
from harness.profile import load_profile
from harness.runner import stack as runner_stack
from harness.runner.config import RunConfig, load_profiles
from harness.runner.drive import summary_row
from harness.stacks import StackName, StackSpec, descendants
from harness.telemetry import HostCpu
from tests.support.waiting import HANG_GUARD_S

BENCH = [sys.executable, "-m", "bench.cli", "run"]


def _run_dir(out: Path) -> Path:
    runs = [p for p in out.iterdir() if (p / schema.RUN_META).is_file()]
    assert len(runs) == 1, runs
    return runs[0]


def test_a_crash_is_recorded_in_run_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(spec: StackSpec, workdir: Path) -> None:
        raise RuntimeError(f"{spec.name} on fire")

    monkeypatch.setattr(runner_stack, "stand_up", broken)
    config = RunConfig(
        scale="smoke", profiles=("a_latency",), stacks=(StackName.ZEROLAYER,), out=str(tmp_path)
    )
    with pytest.raises(RuntimeError, match="zerolayer on fire"):
        bench_run.run(config)
    meta = schema.read_run_meta(_run_dir(tmp_path))
    assert meta.end is schema.RunEnd.ERROR and not meta.complete
    assert meta.incomplete_reason == "stopped by an error: RuntimeError: zerolayer on fire"
    assert "Incomplete run" in (_run_dir(tmp_path) / schema.REPORT).read_text()


def _ignore_sigint() -> None:
    """What a shell does to the jobs it starts in the background."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_one_profile(out: Path) -> subprocess.Popen[str]:
    """A laptop-scale run of profile A on one zero-layer replica, started as a shell starts a
    background job."""
    return subprocess.Popen(
        [
            *(*BENCH, "--scale", "laptop", "--profiles", "a_latency", "--stacks", "zerolayer"),
            *("--replicas", "1", "--out", str(out)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint,
    )


def _first_records(proc: subprocess.Popen[str], out: Path, pattern: str) -> bool:
    """Wait (up to 120 s, while ``proc`` runs) until a file matching ``pattern`` under ``out``
    holds a record; whether one did."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(out.glob(pattern))
        if found and found[0].stat().st_size > 0:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize(
    ("signum", "status", "reason"),
    [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")],
)
def test_a_signal_mid_profile_leaves_a_renderable_incomplete_run_and_no_process(
    tmp_path: Path, signum: int, status: int, reason: str
) -> None:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler's stop) alike: the stacks are stopped, nothing
    measured is lost; also where SIGINT was inherited ignored, as a shell starts background jobs."""
    proc = _start_one_profile(tmp_path)
    try:
        assert _first_records(proc, tmp_path, "*/requests-zerolayer-a_latency.jsonl"), (
            "no request was recorded"
        )
        time.sleep(1.0)
        started = descendants(proc.pid)
        assert started, "the run started its replica"
        os.kill(proc.pid, signum)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, out[-3000:]
    _, alive = psutil.wait_procs(started, timeout=HANG_GUARD_S)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    run = _run_dir(tmp_path)
    meta = orjson.loads((run / schema.RUN_META).read_bytes())
    assert meta["complete"] is False and reason in meta["incomplete_reason"]
    kept = schema.read_requests(run / "requests-zerolayer-a_latency.jsonl")
    assert kept, f"the records measured before {reason} were lost"
    (run / schema.REPORT).unlink()
    rendered = subprocess.run(
        [sys.executable, "-m", "bench.cli", "report", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    assert "Incomplete run" in (run / schema.REPORT).read_text()


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=("int", "term")
)
def test_a_signal_mid_experiment_stops_profile_d_there(
    tmp_path: Path, signum: int, status: int
) -> None:
    """Chaos Toolkit catches the KeyboardInterrupt a signal raises mid-experiment (the journal
    says ``interrupted``) and returns: the run must stop there, the experiment's row and the
    rows before it kept, not go on to the next experiment (it did, for minutes a repeat)."""
    proc = subprocess.Popen(
        [
            *(*BENCH, "--scale", "smoke", "--profiles", "d", "--stacks", "zerolayer"),
            *("--experiments", "delay-one-replica,pause-engine-replica", "--repeats", "1"),
            *("--out", str(tmp_path)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        pattern = "*/chaos/requests-zerolayer-d_fault-delay-one-*.jsonl"
        assert _first_records(proc, tmp_path, pattern), "the first experiment sent no load"
        started = descendants(proc.pid)
        os.kill(proc.pid, signum)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, out[-3000:]
    _, alive = psutil.wait_procs(started, timeout=HANG_GUARD_S)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    chaos = _run_dir(tmp_path) / schema.CHAOS_DIR
    assert not list(chaos.glob("*pause-engine-replica*")), "the run went on to the next one"
    journal = orjson.loads((chaos / "zerolayer-delay-one-replica.journal.json").read_bytes())
    assert journal["status"] == "interrupted"
    rows = orjson.loads((chaos / "recovery-zerolayer.json").read_bytes())
    assert [r["experiment"] for r in rows] == ["delay-one-replica"]


def test_a_summary_row_carries_what_the_loader_knows(tmp_path: Path) -> None:
    record = schema.RequestRecord("r0", "zerolayer", "a_latency", "k6", 0, 1, 2, 5, 9)
    record.outcome = "completed"
    summary = summarize([record])
    result = LoadResult(
        "k6",
        "zerolayer",
        "a_latency",
        tmp_path / "r.jsonl",
        [record],
        summary,
        extra={"per_replica": {"a": 1}},
        protocol="h2",
        ttft_is_first_byte=True,
    )
    profile = load_profile("a_latency", "smoke")
    flat = schema.to_data(summary_row(result, profile, 8.0, HostCpu(95.0, 100.0, 2)))
    assert flat["loader"] == "k6" and flat["loader_protocol"] == "h2"
    assert flat["ttft_is_first_byte"] is True and flat["loader_extra"] == {"per_replica": {"a": 1}}
    assert flat["median_e2el_ms"] == summary["median_e2el_ms"]
    assert flat["slos_ms"] == {s.series: s.bound_ms for s in profile.slos}
    assert flat["offered_rate"] == 8.0 and flat["host_saturated"] is True


def test_goodput_counts_only_the_requests_within_the_profiles_slos(tmp_path: Path) -> None:
    """A plain run's row judges each request against its profile's SLOs (vLLM's goodput), so
    one request over the TTFT bound makes goodput lower than throughput."""
    profile = load_profile("a_latency", "smoke")
    ttft_bound_ns = int(next(s for s in profile.slos if s.series == "ttft").bound_ms * 1e6)
    records = []
    for i, ttft_ns in enumerate((1_000_000, 2_000_000, 3_000_000, 2 * ttft_bound_ns)):
        rec = schema.RequestRecord(f"r{i}", "zerolayer", "a_latency", "native", 0, 1, 1)
        rec.first_token_ns, rec.end_ns = 1 + ttft_ns, 1 + ttft_ns + 1_000_000
        rec.chunk_ns, rec.outcome, rec.output_tokens = [rec.first_token_ns], "completed", 1
        records.append(rec)
    summary = summarize(records)
    result = LoadResult("native", "zerolayer", "a_latency", tmp_path / "r.jsonl", records, summary)
    row = summary_row(result, profile, 8.0, HostCpu(10.0, 20.0, 2))
    assert row.request_goodput == pytest.approx(0.75 * row.request_throughput)
    assert row.slo_met is False  # p99 TTFT lies past the bound
    assert not row.host_saturated


def test_profiles_take_a_profile_file_of_the_users_own(tmp_path: Path) -> None:
    """``--profiles`` accepts a TOML path beside the shipped names; it may extend one of them."""
    path = tmp_path / "mine.toml"
    path.write_text(
        'extends = "a_latency"\nname = "mine"\n[scales.laptop]\nrate = 5.0\nduration_s = 4.0\n'
    )
    names = bench_run.profile_list(f"a,{path}")
    assert names == ("a_latency", str(path.resolve()))
    profiles = load_profiles(RunConfig(profiles=names))
    assert [(p.name, p.rate) for p in profiles] == [("a_latency", 3.0), ("mine", 5.0)]
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        bench_run.profile_list(str(tmp_path / "none.toml"))
