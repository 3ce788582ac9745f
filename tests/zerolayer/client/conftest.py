"""Fixtures for the SDK's tests against real ``zl-replica`` processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from harness.stacks import ReplicaProcess
from tests.support.sdk import Spawn


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start replica processes; every one is killed at teardown, whatever the test did (a frozen
    one is resumed first, so the kill reaches it)."""
    started: list[ReplicaProcess] = []

    def start(engine: str = "sim", *args: str) -> ReplicaProcess:
        proc = ReplicaProcess(engine, extra_args=args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.alive():
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
