"""``zl-bench run`` and configuration parity, end to end: engines that really run with different
settings stop the run before any load with one error line and exit 2, or, under
``--allow-mismatch``, run and are recorded in run.json and marked in red in report.html.

The mismatches are real: replicas a test starts with their own ``--engine-option`` values and
hands to the run as a stack running elsewhere (``--zerolayer-urls``), beside the baseline the run
stands up with the run's options. Every replica a test starts, the test stops.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest

from baselines.rayserve.config import STAND_UP_GUARD_S
from harness import schema
from harness.schema import ParityVerdict, RunEnd
from harness.stacks import ReplicaProcess, descendants
from tests.support.waiting import HANG_GUARD_S

BENCH = [sys.executable, "-m", "bench.cli", "run", "--scale", "smoke", "--profiles", "a_latency"]
OPTIONS = {"model_shape": "llama-3.2-1b", "num_kv_blocks": 256}
RUN_LIMIT_S = STAND_UP_GUARD_S + 240
"""A hang guard for one ``zl-bench run``: the guard the run itself gives the baseline's stand-up,
then room for the check and one smoke trial. A fixed 300 s was passed under load by a run that
ended by itself."""
pytestmark = pytest.mark.timeout(RUN_LIMIT_S + 60)


@pytest.fixture
def replicas() -> Iterator[list[ReplicaProcess]]:
    """Two zero-layer replicas over the sim whose ``max_num_seqs`` differ (8, 16)."""
    started: list[ReplicaProcess] = []
    try:
        for seqs in (8, 16):
            started.append(ReplicaProcess("sim", {**OPTIONS, "max_num_seqs": seqs}))
        yield started
    finally:
        for replica in started:
            replica.stop()


def _bench(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], set[int]]:
    """Run ``zl-bench run`` and return it with every process it started along the way."""
    proc = subprocess.Popen(
        [*BENCH, "--out", str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: set[int] = set()
    deadline = time.monotonic() + RUN_LIMIT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= {p.pid for p in descendants(proc.pid)}
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), seen


def _run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if (p / schema.RUN_META).is_file()]
    return run


def _left_running(pids: Sequence[int]) -> list[int]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=HANG_GUARD_S)
    return [p.pid for p in alive]


def _stopped_before_any_load(done: subprocess.CompletedProcess[str], run: Path) -> list[str]:
    """The run exited 2 with exactly one error line (Ray's own log lines aside), no traceback,
    and sent no request."""
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("zl-bench: error: "), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not list(run.rglob("requests-*.jsonl")), "load was sent before the check"
    meta = schema.read_run_meta(run)
    assert meta.parity.verdict is ParityVerdict.STOPPED and meta.end is RunEnd.ERROR
    return lines


def test_replicas_that_disagree_stop_the_run_before_any_load(
    replicas: list[ReplicaProcess], tmp_path: Path
) -> None:
    urls = ",".join(r.url for r in replicas)
    done, _ = _bench(tmp_path, "--stacks", "zerolayer", "--zerolayer-urls", urls)
    (line,) = _stopped_before_any_load(done, _run_dir(tmp_path))
    assert "max_num_seqs: zerolayer/zl-0 8, zerolayer/zl-1 16" in line
    assert all(r.alive() for r in replicas), "a stack running elsewhere is never stopped"


def test_allow_mismatch_runs_and_records_it_in_red(
    replicas: list[ReplicaProcess], tmp_path: Path
) -> None:
    urls = ",".join(r.url for r in replicas)
    done, _ = _bench(
        tmp_path, "--stacks", "zerolayer", "--zerolayer-urls", urls,
        "--repeats", "1", "--allow-mismatch",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = _run_dir(tmp_path)
    parity = schema.read_run_meta(run).parity
    assert parity.verdict is ParityVerdict.ALLOWED and parity.allow_mismatch
    assert [(m.setting, m.values) for m in parity.mismatches] == [
        ("max_num_seqs", {"zerolayer/zl-0": 8, "zerolayer/zl-1": 16})
    ]
    assert list(run.glob("requests-zerolayer-*.jsonl")), "the run went on"
    html = (run / schema.REPORT).read_text()
    assert "<tr class='mismatch'><td class='l'>max_num_seqs</td><td>8 / 16</td>" in html
    assert "Engine settings differ between stacks: max_num_seqs: zerolayer/zl-0 8" in html


@pytest.mark.slow
def test_a_stack_whose_engines_differ_from_the_baselines_stops_the_run_before_any_load(
    replicas: list[ReplicaProcess], tmp_path: Path
) -> None:
    """A zero-layer stack running elsewhere with max_num_seqs 8 beside the baseline the run
    stands up with the run's options (the sim's default, 256)."""
    done, started = _bench(
        tmp_path, "--stacks", "zerolayer,baseline", "--zerolayer-urls", replicas[0].url,
        "--replicas", "1", *(f"--engine-option={k}={v}" for k, v in OPTIONS.items()),
    )  # fmt: skip
    (line,) = _stopped_before_any_load(done, _run_dir(tmp_path))
    assert "max_num_seqs: zerolayer 8, baseline 256" in line
    assert started, "the run stood the baseline up"
    assert not _left_running(sorted(started)), "the baseline was not torn down"
