"""Each Ray Serve LLM engine replica on its own cores, through its runtime environment.

Ray starts the ``LLMServer`` replica actors, so no command of ours starts their processes: the
core lists (``serving.cpus.CpuLayout.engines``) travel in the deployment's runtime environment,
and a worker process setup hook, run in each replica's worker process before it builds its
engine, claims the first list no live replica holds (a file per list in a folder of the run,
created exclusively, holding the claimant's pid; a claim whose process is gone is taken over, so
a replica Serve replaces gets its predecessor's cores). vLLM's OpenMP binding is set to them in
the replica's environment, so the engine it starts computes there. The replica actor itself
(Serve's and Serve LLM's request handling) stays where Ray put it: unlike a process of ours,
nothing moves its threads to the loader's cores after it started.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from serving.cpus import BIND_VARIABLE, RESERVED_VARIABLE, cores_text, parse_cores

CORES_VARIABLE: Final = "ZL_ENGINE_CORE_LISTS"
SLOTS_VARIABLE: Final = "ZL_ENGINE_CORE_SLOTS"
HOOK: Final = "baselines.rayserve_llm.cpus.claim_engine_cores"


def runtime_env(engine_cores: Sequence[str], slots_dir: str) -> dict[str, Any]:
    """The runtime environment that gives each replica one of ``engine_cores`` (core lists as
    ``serving.cpus.cores_text`` writes them), claimed through files in ``slots_dir``."""
    return {
        "env_vars": {CORES_VARIABLE: "|".join(engine_cores), SLOTS_VARIABLE: slots_dir},
        "worker_process_setup_hook": HOOK,
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(slot: Path) -> int | None:
    try:
        return int(slot.read_text() or 0) or None
    except (OSError, ValueError):
        return None


def claim(slots_dir: Path, count: int, pid: int) -> int | None:
    """The index of the first of ``count`` slots no live process holds, now held by ``pid``;
    None when every one is held."""
    slots_dir.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        slot = slots_dir / f"engine-{i}"
        try:
            fd = os.open(slot, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(slot)
            if holder is not None and _alive(holder):
                continue
            slot.write_text(str(pid))  # its replica is gone: this one takes its cores
            return i
        with os.fdopen(fd, "w") as out:
            out.write(str(pid))
        return i
    return None


def claim_engine_cores() -> None:
    """The worker process setup hook: Ray Serve LLM's own (it imports its modules), then vLLM's
    OpenMP binding set to the first core list no live replica holds."""
    from ray.llm._internal.serve import _worker_process_setup_hook

    _worker_process_setup_hook()
    lists = [part for part in os.environ.get(CORES_VARIABLE, "").split("|") if part]
    slots = os.environ.get(SLOTS_VARIABLE, "")
    if not lists or not slots:
        return
    index = claim(Path(slots), len(lists), os.getpid())
    if index is None:
        return
    os.environ[BIND_VARIABLE] = cores_text(parse_cores(lists[index]))
    os.environ[RESERVED_VARIABLE] = "0"
