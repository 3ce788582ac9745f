"""The loader's CPU priority, raised above the stacks' it drives where this process may, and
its cores: those a CPU layout leaves to the loader and the layers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from serving.cpus import CpuLayout

LOADER_NICE = -5


@contextlib.contextmanager
def loader_priority() -> Iterator[None]:
    """Run the loader thread at a higher CPU priority than the stack it drives.

    The loader shares the cores with the stack under test; a load generator that the stack can
    starve measures its own lag, not the server. Niceness is per thread on Linux and inherited by
    children, so it is raised only around the loader's own run (the stacks are already up) and
    restored afterwards. Without the privilege the run goes on at normal priority and says so.
    """
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LOADER_NICE)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


def loader_nice() -> int:
    """The niceness the loader will run at: LOADER_NICE where this process may raise its
    priority, else the niceness it already has (the run goes on and records so)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LOADER_NICE)
    except PermissionError:
        return before
    os.setpriority(os.PRIO_PROCESS, 0, before)
    return LOADER_NICE


@contextlib.contextmanager
def loader_cores(layout: CpuLayout | None) -> Iterator[None]:
    """Run the loader thread (and the loader processes it starts) on the cores ``layout`` leaves
    to the loader and the layers, off the engines' cores; restored afterwards. Nothing without a
    layout, or with one that leaves no core of its own to them."""
    if layout is None or not layout.rest:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, layout.rest)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
