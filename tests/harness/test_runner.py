"""``harness.runner``'s own rules, without a stack: how a run's end is recorded, and that a
phase ends however its block does."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import cast

import orjson
import pytest

from harness import schema
from harness.runner.ending import EXIT_INTERRUPTED, EXIT_TERMINATED, until_stopped
from harness.runner.results import RunDir
from harness.runner.sampling import phase
from harness.schema import RunEnd
from harness.telemetry import PhaseLog


class _Run:
    """What ``until_stopped`` asks of a RunDir: ``finish``."""

    def __init__(self) -> None:
        self.ends: list[tuple[RunEnd, str]] = []

    def finish(self, end: RunEnd, detail: str = "") -> None:
        self.ends.append((end, detail))


def test_a_block_that_ends_is_a_complete_run() -> None:
    run = _Run()
    with until_stopped(cast(RunDir, run)) as ending:
        pass
    assert run.ends == [(RunEnd.COMPLETE, "")]
    assert not ending.stopped and ending.status == 0


def test_sigint_stops_the_block_and_is_kept_with_the_shells_status() -> None:
    run = _Run()
    with until_stopped(cast(RunDir, run)) as ending:
        signal.raise_signal(signal.SIGINT)
    assert run.ends == [(RunEnd.SIGINT, "interrupted by SIGINT")]
    assert ending.stopped and ending.status == EXIT_INTERRUPTED and ending.verb == "interrupted"


def test_sigterm_stops_the_block_as_sigint_does_and_says_it_was_sigterm() -> None:
    before = signal.getsignal(signal.SIGTERM)
    run = _Run()
    with until_stopped(cast(RunDir, run)) as ending:
        signal.raise_signal(signal.SIGTERM)
    assert run.ends == [(RunEnd.SIGTERM, "stopped by SIGTERM")]
    assert ending.status == EXIT_TERMINATED and ending.detail == "stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before, "the handlers are put back"


def test_an_error_is_recorded_and_raised() -> None:
    run = _Run()
    with pytest.raises(RuntimeError, match="on fire"), until_stopped(cast(RunDir, run)):
        raise RuntimeError("on fire")
    assert run.ends == [(RunEnd.ERROR, "RuntimeError: on fire")]


def test_a_phase_ends_when_its_block_raises(tmp_path: Path) -> None:
    log = PhaseLog(tmp_path / schema.PHASES)
    with pytest.raises(ValueError), phase(log, "zerolayer/a_latency", stack="zerolayer"):
        assert log.current == "zerolayer/a_latency"
        raise ValueError
    log.close()
    rows = [orjson.loads(line) for line in (tmp_path / schema.PHASES).read_bytes().splitlines()]
    assert [(r["event"], r["name"]) for r in rows] == [
        ("start", "zerolayer/a_latency"),
        ("end", "zerolayer/a_latency"),
    ]
    assert rows[0]["stack"] == "zerolayer" and log.current != "zerolayer/a_latency"


def test_a_phase_without_a_log_only_runs_its_block() -> None:
    ran = []
    with phase(None, "zerolayer/d_fault"):
        ran.append(True)
    assert ran == [True]
