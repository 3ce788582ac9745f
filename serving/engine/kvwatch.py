"""An engine's KV cache over time, stamped by the process that holds the engine.

The refusal-speed measurement (``chaos.refusal``) needs the moment an engine became too full to
take another request, from the engine's own figures and finer than 10 ms. Both stacks' engine
hosts run a :class:`KvWatch` (the zero-layer replica with ``--kv-watch``, the baseline's engine
replica beside its stats snapshots): every ``INTERVAL_S`` it reads the engine's stats, the KV
blocks the host has promised to requests the engine has not seen yet (the zero-layer replica:
those admitted on their headers whose bodies are still read, and its admission queue; none on
the baseline, whose engine queues what Serve hands it) and how many
requests the host has taken in (the zero-layer replica: admitted on their headers; the
baseline's engine replica: handed to it by Serve), and appends a line (:class:`KvSample`) when
the replica's *committed* KV (blocks in use, the blocks the waiting prefill will take, and those
promised) is at or above ``RECORD_FROM`` of the cache and something changed, and once more when
it falls back below.
Below that level nothing is written, and below ``FAST_FROM`` the watch reads only every
``IDLE_INTERVAL_S`` (a replica's cache cannot go from a quarter to full between two reads unless
a burst of requests, each a sizeable share of it, arrives within 50 ms), so that an idle replica
pays a fraction of a percent of a core for it and no IO.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson

from serving.engine.kv import blocks_for
from serving.engine.types import EngineStats

INTERVAL_S: Final = 0.005
IDLE_INTERVAL_S: Final = 0.05
FAST_FROM: Final = 0.25
RECORD_FROM: Final = 0.5
FILE_PREFIX: Final = "kv-watch-"


@dataclass(frozen=True, slots=True)
class KvSample:
    """One reading: wall-clock ``t_ns``, the engine's KV blocks in use and in all, the prefill
    tokens waiting in the engine, the blocks the host promised beyond them (``pending``), and
    the requests the host had taken in by then (``admitted``)."""

    t_ns: int
    used: int
    waiting_prefill_tokens: int
    total: int
    block_size: int
    pending: int = 0
    admitted: int = 0

    @property
    def committed(self) -> int:
        """Blocks the replica holds or has promised: in use, the waiting prefill's, pending."""
        blocks = blocks_for(self.waiting_prefill_tokens, self.block_size or 1)
        return self.used + blocks + self.pending

    @property
    def committed_fraction(self) -> float:
        return self.committed / self.total if self.total else 0.0


def sample_of(stats: EngineStats, pending: int, admitted: int, t_ns: int) -> KvSample:
    return KvSample(
        t_ns,
        stats.kv_blocks_used,
        stats.waiting_prefill_tokens,
        stats.kv_blocks_total,
        stats.block_size,
        pending,
        admitted,
    )


def _zero() -> int:
    return 0


def _figures(s: KvSample) -> tuple[int, int, int, int]:
    return s.used, s.waiting_prefill_tokens, s.pending, s.admitted


class KvWatch:
    """Samples ``stats()``, ``pending()`` and ``admitted()`` every ``interval_s`` into ``path``
    (JSONL, appended, one flushed line per sample kept: a killed host keeps what it wrote)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        path: str | os.PathLike[str],
        *,
        pending: Callable[[], int] = _zero,
        admitted: Callable[[], int] = _zero,
        interval_s: float = INTERVAL_S,
        record_from: float = RECORD_FROM,
    ) -> None:
        self.stats = stats
        self.pending = pending
        self.admitted = admitted
        self.path = Path(path)
        self.interval_s = interval_s
        self.record_from = record_from
        self._last: KvSample | None = None
        self._above = False
        self._task: asyncio.Task[None] | None = None

    def keep(self, sample: KvSample) -> bool:
        """Whether ``sample`` is written: at or above ``record_from`` and different from the
        last one written, or the first one back below it."""
        above = sample.committed_fraction >= self.record_from
        if not above:
            was, self._above = self._above, False
            if was:
                self._last = sample
            return was
        self._above = True
        last = self._last
        if last is not None and _figures(last) == _figures(sample):
            return False
        self._last = sample
        return True

    def start(self) -> None:
        """Start sampling on the running event loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-watch")

    async def _run(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as fh:
            while True:
                now = time.time_ns()
                sample = sample_of(self.stats(), self.pending(), self.admitted(), now)
                if self.keep(sample):
                    fh.write(orjson.dumps(sample) + b"\n")
                    fh.flush()
                near = sample.committed_fraction >= FAST_FROM
                await asyncio.sleep(
                    self.interval_s if near else max(self.interval_s, IDLE_INTERVAL_S)
                )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def read_kv_watch(path: str | Path) -> list[KvSample]:
    """A watch file's samples in time order (a line cut short by a kill is skipped)."""
    samples = []
    for line in Path(path).read_bytes().splitlines():
        try:
            samples.append(KvSample(**orjson.loads(line)))
        except (orjson.JSONDecodeError, TypeError):
            continue
    return sorted(samples, key=lambda s: s.t_ns)
