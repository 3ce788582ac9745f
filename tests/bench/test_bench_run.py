"""``zl-bench run`` end to end, as ``nox -s bench -- --scale smoke`` runs it; and SIGINT."""

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
from bench.run import FAULT_PROFILE as FAULT
from harness import schema
from harness.loaders import LoadResult
from harness.metrics import summarize
from harness.profile import DEFAULT_PROFILES, load_profile
from harness.runner import stack as runner_stack
from harness.runner.config import RunConfig, load_profiles
from harness.runner.drive import summary_row
from harness.stacks import StackName, StackSpec, descendants
from harness.telemetry import HostCpu
from tests.support import readme

BENCH = [sys.executable, "-m", "bench.cli", "run"]
SMOKE_LIMIT_S = 600


def _must_lose_nothing(stack: str, profile: str) -> bool:
    """The zero-layer stack never loses a request, nor does either stack without a fault. The
    baseline may under one: on a loaded CI host a request that Ray Serve's proxy held while its
    one ingress replica was being replaced got no answer by deadline plus grace. That is a
    measurement of the baseline, counted in profile D's recovery rows, not a defect of ours."""
    return stack == "zerolayer" or profile != FAULT


def _run_dir(out: Path) -> Path:
    runs = [p for p in out.iterdir() if (p / schema.RUN_META).is_file()]
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_LIMIT_S + 60)  # its own bound, past the suite's 300 s
def test_smoke_bench_runs_every_profile_on_both_stacks(tmp_path: Path) -> None:
    """The README's short run (its ``nox -s bench -- ...`` line's arguments, so the two cannot
    drift apart) into a temporary directory."""
    bench_line = readme.commands(readme.NOTEBOOK_SECTION)[0]
    started = time.monotonic()
    proc = subprocess.run(
        [*BENCH, *readme.zl_bench_args(bench_line), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=SMOKE_LIMIT_S,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(f"smoke bench took {elapsed:.0f} s")
    run = _run_dir(tmp_path)
    meta = orjson.loads((run / schema.RUN_META).read_bytes())
    assert meta["complete"] is True
    summary = orjson.loads((run / schema.SUMMARY).read_bytes())["rows"]
    pairs = {(row["stack"], row["profile"]) for row in summary}
    profiles = DEFAULT_PROFILES
    assert pairs == {(s, p) for s in ("zerolayer", "baseline") for p in profiles}
    for row in summary:
        assert row["num_requests"] > 0, row["profile"]
        assert row["completed"] + row["errors"] + row["lost"] == row["num_requests"]
        if _must_lose_nothing(row["stack"], row["profile"]):
            assert row["lost"] == 0, (row["stack"], row["profile"])
    recovery = orjson.loads((run / schema.CHAOS_DIR / "recovery.json").read_bytes())
    assert {r["stack"] for r in recovery} == {"zerolayer", "baseline"}
    assert all(r["rollbacks_ok"] for r in recovery)
    assert all(r["lost"] == 0 for r in recovery if r["stack"] == "zerolayer")
    (fault_row,) = (r for r in summary if (r["stack"], r["profile"]) == ("baseline", FAULT))
    assert fault_row["lost"] == sum(r["lost"] for r in recovery if r["stack"] == "baseline")
    html = (run / schema.REPORT).read_text()
    assert "Recovery (profile D" in html and "Seed-study claims" in html
    assert len(list((run / schema.PLOTS_DIR).glob("*.png"))) >= 6
    assert "capacity preflight" in proc.stdout and "offered load" in proc.stdout
    assert proc.stdout.count("warmed up with 4 requests") == 2, "each stack, before profile A"
    labels = {name: stack["label"] for name, stack in meta["stacks"].items()}
    assert labels["baseline"].startswith("Ray Serve orchestrator (ours)")
    assert labels["zerolayer"].startswith("zero-layer: zl-replica x2")
    assert all(f"{name}: {label}" in proc.stdout for name, label in labels.items())
    assert meta["stacks"]["zerolayer"]["request_body_fields"] == {}, "the sim needs none"


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
    _, alive = psutil.wait_procs(started, timeout=10)
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
    _, alive = psutil.wait_procs(started, timeout=10)
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
