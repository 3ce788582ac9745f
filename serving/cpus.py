"""Which cores each vLLM engine replica computes on, and what is left for the loader and the layers.

vLLM's CPU build binds each engine's OpenMP threads to cores it picks for itself
(``VLLM_CPU_OMP_THREADS_BIND=auto``): every engine process on a host picks the same ones (core 0
of two, the other kept for its scheduler), so two replicas on one machine compute on one core
and their runs are the host's, not the stacks'. A :class:`CpuLayout` gives each engine replica
its own core list, split from the cores this process may use or given as ``--cpu-layout``, and
leaves the rest to the loader and the layer processes (a replica's front end, vLLM's own server
front, Ray). Every stack applies it the same way: an engine replica's compute threads (vLLM's
OpenMP threads, in its worker process) are bound to its cores (``engine_env``), and once it
serves, its front end's threads move to the rest (``pin_threads``), where the loader runs too.

The split needs a core for each engine replica and one for the rest; on fewer cores it is
refused with the reason (:class:`LayoutError`), as a run on them would measure the host.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

AUTO: Final = "auto"
GIVEN: Final = "--cpu-layout"
BIND_VARIABLE: Final = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_VARIABLE: Final = "VLLM_CPU_NUM_OF_RESERVED_CPU"
LAYOUT_HELP: Final = (
    "the cores of each engine replica's compute, '|' between replicas, then '/' and the cores "
    "of the loader and the layer processes (e.g. 1|2-3/0); default: split from the cores "
    "available, one core for the loader and layers and the others shared out among the engines"
)


class LayoutError(ValueError):
    """A layout that cannot be made or used; the message says why in one line."""


def cores_text(cores: Iterable[int]) -> str:
    """``0-3,6`` for 0, 1, 2, 3 and 6 (ranges where consecutive)."""
    ordered = sorted(set(cores))
    parts: list[str] = []
    start = prev = None
    for core in [*ordered, None]:
        if prev is not None and core == prev + 1:
            prev = core
            continue
        if start is not None and prev is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = core
    return ",".join(parts)


def parse_cores(text: str) -> tuple[int, ...]:
    """``0-3,6`` as (0, 1, 2, 3, 6); LayoutError for anything else."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise LayoutError(
                f"{part!r} is not a core or a range of cores (like 2 or 0-3)"
            ) from None
        if first < 0 or last < first:
            raise LayoutError(f"{part!r} is not a range of cores")
        cores += range(first, last + 1)
    return tuple(sorted(set(cores)))


@dataclass(frozen=True)
class CpuLayout:
    """Each engine replica's cores (``engines[i]``: replica i's compute), the cores left for
    the loader and the layer processes (``rest``; empty: they run anywhere), and where the
    split came from (``source``: ``auto`` or ``--cpu-layout``)."""

    engines: tuple[tuple[int, ...], ...]
    rest: tuple[int, ...]
    source: str = AUTO

    def engine_env(self, replica: int) -> dict[str, str]:
        """What an engine replica's process starts with so that vLLM binds its OpenMP threads
        to the replica's cores alone (none kept back: the layers have their own)."""
        return {BIND_VARIABLE: cores_text(self.engines[replica]), RESERVED_VARIABLE: "0"}

    def text(self) -> str:
        """``engine replica 0 computes on core 1; loader and layers on core 0 (auto)``."""
        parts = [
            f"engine replica {i} computes on {_cores_word(cores)} {cores_text(cores)}"
            for i, cores in enumerate(self.engines)
        ]
        rest = (f"{_cores_word(self.rest)} {cores_text(self.rest)}" if self.rest
                else "any core")  # fmt: skip
        return "; ".join([*parts, f"loader and layers on {rest}"]) + f" ({self.source})"

    @classmethod
    def from_config(cls, data: Any) -> CpuLayout | None:
        """The layout as run.json's ``config`` holds it (the dataclass as JSON), or None for a
        run without one (or from before layouts)."""
        if not isinstance(data, dict) or "engines" not in data:
            return None
        engines = tuple(tuple(int(c) for c in cores) for cores in data["engines"])
        return cls(engines, tuple(int(c) for c in data.get("rest", ())), str(data.get("source")))

    def to_data(self) -> dict[str, Any]:
        """As run.json records it."""
        return {
            "source": self.source,
            "engines": [cores_text(cores) for cores in self.engines],
            "rest": cores_text(self.rest),
        }


def layout_text(config: Any) -> str:
    """Where a run put its vLLM engines' compute and its loader and layers, from run.json's
    ``config``; for an engine without compute threads, that nothing was pinned."""
    found = CpuLayout.from_config(config.get("cpu_layout") if isinstance(config, dict) else None)
    return found.text() if found is not None else "none (no engine compute to place)"


def _cores_word(cores: Sequence[int]) -> str:
    return "core" if len(cores) == 1 else "cores"


def available_cores() -> tuple[int, ...]:
    """The cores this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def split_cores(available: Sequence[int], replicas: int) -> CpuLayout:
    """One core for the loader and the layers (the first), the others shared out among the
    engine replicas in contiguous blocks (the first replicas get one more where they do not
    divide evenly); LayoutError when there is not a core for each engine and one for the rest."""
    cores = sorted(set(available))
    if len(cores) < replicas + 1:
        raise LayoutError(
            f"{replicas} vLLM engine replica{'s' if replicas > 1 else ''} need "
            f"{replicas + 1} cores (one each for their compute and one for the loader and the "
            f"layers) and this run may use {len(cores)} ({cores_text(cores)}): run "
            f"--replicas {max(1, len(cores) - 1)} here, or give --cpu-layout"
        )
    rest, pool = cores[:1], cores[1:]
    share, extra = divmod(len(pool), replicas)
    engines = []
    for i in range(replicas):
        size = share + (1 if i < extra else 0)
        engines.append(tuple(pool[:size]))
        pool = pool[size:]
    return CpuLayout(tuple(engines), tuple(rest), AUTO)


def parse_layout(text: str, replicas: int, available: Sequence[int]) -> CpuLayout:
    """``--cpu-layout`` (see ``LAYOUT_HELP``), checked: one core list per engine replica, no
    core in two engines, every core one this run may use."""
    engines_text, sep, rest_text = text.partition("/")
    if not sep:
        raise LayoutError(f"--cpu-layout {text!r}: expected ENGINES/REST, like 1|2/0")
    engines = tuple(parse_cores(part) for part in engines_text.split("|"))
    rest = parse_cores(rest_text)
    if len(engines) != replicas:
        raise LayoutError(
            f"--cpu-layout {text!r} names {len(engines)} engine core lists for {replicas} "
            "engine replicas"
        )
    if not all(engines):
        raise LayoutError(f"--cpu-layout {text!r}: every engine replica needs a core")
    taken = [core for cores in engines for core in cores]
    if len(taken) != len(set(taken)):
        raise LayoutError(f"--cpu-layout {text!r}: a core is in two engines' lists")
    outside = sorted((set(taken) | set(rest)) - set(available))
    if outside:
        raise LayoutError(
            f"--cpu-layout {text!r}: core(s) {cores_text(outside)} are not among the cores "
            f"this run may use ({cores_text(available)})"
        )
    return CpuLayout(engines, rest, GIVEN)


def choose_layout(text: str | None, replicas: int) -> CpuLayout:
    """``--cpu-layout`` when given, else the split of the cores this process may use."""
    available = available_cores()
    return parse_layout(text, replicas, available) if text else split_cores(available, replicas)


def thread_ids(pid: int) -> list[int]:
    """The threads of process ``pid`` (none once it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError):
        return []


def run_times(pids: Sequence[int]) -> tuple[int, int]:
    """Nanoseconds the threads of ``pids`` have run and have waited on a run queue, summed
    (the kernel's schedstat; threads gone between two readings drop out of both). The wait is
    the time a loaded host held them off a core while they were ready to run."""
    ran = waited = 0
    for pid in pids:
        for tid in thread_ids(pid):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                ran += int(fields[0])
                waited += int(fields[1])
    return ran, waited


def pin_threads(pid: int, cores: Sequence[int]) -> None:
    """Every thread of process ``pid`` onto ``cores`` (its children keep theirs); nothing for
    an empty list or a process that is gone. Threads it starts later inherit the affinity of the
    thread that starts them."""
    if not cores:
        return
    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(tid, cores)


@contextlib.contextmanager
def engine_cores(layout: CpuLayout | None, replica: int = 0) -> Any:
    """Within the block, engine ``replica``'s OpenMP binding is in the environment, so that the
    engine a process started now runs binds its compute threads (vLLM's worker) to the
    replica's cores. Its scheduler process (``VLLM::EngineCore``, which vLLM keeps off its
    OpenMP cores too) and its front end are not put there: sharing a core with the worker, the
    scheduler's spinning slowed every decode step (a third longer, measured in one process).
    No layout: nothing changes."""
    if layout is None:
        yield
        return
    saved = {name: os.environ.get(name) for name in (BIND_VARIABLE, RESERVED_VARIABLE)}
    os.environ.update(layout.engine_env(replica))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
