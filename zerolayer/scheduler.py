"""The embedded scheduler: admission and ordering, decided from the contract headers alone.

``decide`` is a pure function of (``RequestMeta``, ``EngineStats``, what the replica has queued
and the configuration): no clock, no IO, a handful of arithmetic operations, so it can run on the
HEADERS frame of every stream and be unit-tested without sockets. Checks, in order:

1. ``prompt_too_long``: the request can never fit (``max_model_len`` or the whole KV cache).
2. ``queue_full``: the waiting line this request would join (the engine's waiting requests plus
   the replica's queued ones of its class or a higher one) is at its class's bound.
3. ``kv_exhausted``: projected KV usage (blocks in use, plus the prefill of everything waiting
   ahead, plus this request's full ``prompt + max_tokens`` footprint) is above its class's
   watermark (by default ``low`` 92 %, ``normal`` 98 %, ``high`` 100 %: only when it cannot fit);
   the retry hint is at least ``kv_retry_steps`` recent engine steps, time for sequences to end.
4. ``deadline_exceeded``: the estimated queue wait (prefill tokens ahead / token budget per
   step x the recent step time) already exceeds the request's deadline: fail fast.

:class:`AdmissionQueue` orders admitted requests that the engine has no room for yet: strict
priority classes, earliest deadline first inside a class, FIFO among equal deadlines. It keeps
the per-class figures ``decide`` needs (:class:`QueueState`) up to date incrementally.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from serving.engine.kinds import ENGINE_KINDS
from serving.engine.kv import blocks_for
from serving.engine.types import EngineStats
from serving.wire.contract import (
    DEADLINE_EXCEEDED,
    KV_EXHAUSTED,
    PRIORITY_HIGH,
    PRIORITY_LOW,
    PRIORITY_NORMAL,
    PROMPT_TOO_LONG,
    QUEUE_FULL,
    ErrorCode,
    RequestMeta,
)

T = TypeVar("T")

NUM_CLASSES: Final = 3
CLASSES: Final = (PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Admission limits. Index tuples by priority class (0 high, 1 normal, 2 low).

    ``kv_watermarks=None`` turns KV admission off (engines without a KV cache, like ``null``).
    """

    kv_watermarks: tuple[float, float, float] | None = (1.0, 0.98, 0.92)
    max_queue: tuple[int, int, int] = (4096, 2048, 512)
    token_budget: int = 8192
    max_model_len: int | None = None
    min_step_ms: float = 0.0
    min_retry_after_ms: int = 20
    kv_retry_steps: int = 32
    max_retry_after_ms: int = 10_000

    @classmethod
    def for_engine(cls, engine: Any, **overrides: Any) -> SchedulerConfig:
        """Defaults that fit an engine: KV admission off for ``null``, limits from its config."""
        values: dict[str, Any] = {}
        kind = ENGINE_KINDS.get(getattr(engine, "name", ""))
        if kind is not None and not kind.has_kv_cache:
            values["kv_watermarks"] = None
        config = getattr(engine, "config", None)
        for name, attr in (
            ("token_budget", "max_num_batched_tokens"),
            ("max_model_len", "max_model_len"),
        ):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                values[name] = value
        values.update(overrides)
        return cls(**values)


@dataclass(slots=True)
class QueueState:
    """What the replica holds that the engine has not seen yet, per priority class."""

    count: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)
    prefill_tokens: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)
    blocks: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)

    def ahead(self, priority: int) -> tuple[int, int, int]:
        """(requests, prefill tokens, KV blocks) queued at ``priority`` or a higher class."""
        n = priority + 1
        return sum(self.count[:n]), sum(self.prefill_tokens[:n]), sum(self.blocks[:n])

    @property
    def depth(self) -> int:
        return sum(self.count)


EMPTY_QUEUE: Final = QueueState()


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission decision: ``error is None`` means admitted."""

    error: ErrorCode | None = None
    message: str = ""
    retry_after_ms: int | None = None
    wait_ms: float = 0.0

    @property
    def admitted(self) -> bool:
        return self.error is None


ADMIT: Final = Decision()


def estimated_wait_ms(stats: EngineStats, prefill_ahead: int, config: SchedulerConfig) -> float:
    """Queue wait before a request's prefill starts: the prefill tokens waiting ahead of it, in
    steps of ``token_budget`` tokens, at the engine's recent step time."""
    step_ms = max(stats.step_ms_recent, config.min_step_ms)
    if step_ms <= 0.0 or prefill_ahead <= 0:
        return 0.0
    return step_ms * -(-prefill_ahead // config.token_budget)


def _retry_after(wait_ms: float, config: SchedulerConfig) -> int:
    return int(min(max(wait_ms, config.min_retry_after_ms), config.max_retry_after_ms))


def decide(
    meta: RequestMeta,
    stats: EngineStats,
    queue: QueueState = EMPTY_QUEUE,
    config: SchedulerConfig = SchedulerConfig(),
    *,
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
) -> Decision:
    """Admit or refuse one request; see the module docstring for the checks and their order.

    The cost is ``prompt_tokens``/``max_tokens`` when given, else the headers' values; when
    neither says (a request whose cost is in its body), the request's own footprint counts as
    zero and only the load already there can refuse it: call again once the body is parsed.
    """
    priority = meta.priority
    prompt = meta.prompt_tokens if prompt_tokens is None else prompt_tokens
    output = meta.max_tokens if max_tokens is None else max_tokens
    own_tokens = (prompt or 0) + (output or 0)
    block_size = stats.block_size or 1
    own_blocks = blocks_for(own_tokens, block_size)
    if own_tokens:
        too_long = _never_fits(prompt or 0, output or 0, own_blocks, stats, config)
        if too_long is not None:
            return too_long

    queued, queued_prefill, queued_blocks = queue.ahead(priority) if queue.depth else (0, 0, 0)
    prefill_ahead = stats.waiting_prefill_tokens + queued_prefill
    wait = estimated_wait_ms(stats, prefill_ahead, config)
    depth = stats.waiting + queued
    if depth >= config.max_queue[priority]:
        return Decision(
            QUEUE_FULL,
            f"{depth} requests wait ahead; this class's bound is {config.max_queue[priority]}",
            _retry_after(wait, config),
            wait,
        )
    over_kv = _over_kv_watermark(priority, queued_blocks + own_blocks, wait, stats, config)
    if over_kv is not None:
        return over_kv
    if wait >= meta.deadline_ms:
        return Decision(
            DEADLINE_EXCEEDED,
            f"estimated queue wait {wait:.0f} ms already exceeds deadline {meta.deadline_ms} ms",
            None,
            wait,
        )
    return ADMIT if wait == 0.0 else Decision(wait_ms=wait)


def _never_fits(
    prompt: int, output: int, own_blocks: int, stats: EngineStats, config: SchedulerConfig
) -> Decision | None:
    """``prompt_too_long`` for a request that no load could admit: past ``max_model_len``, or
    needing more KV blocks than the engine has."""
    own_tokens = prompt + output
    if config.max_model_len is not None and own_tokens > config.max_model_len:
        return Decision(
            PROMPT_TOO_LONG,
            f"prompt {prompt} + max_tokens {output} tokens exceeds max_model_len "
            f"{config.max_model_len}",
        )
    if (
        config.kv_watermarks is not None
        and stats.kv_blocks_total
        and own_blocks > stats.kv_blocks_total
    ):
        return Decision(
            PROMPT_TOO_LONG,
            f"{own_tokens} tokens need {own_blocks} KV blocks; the engine has "
            f"{stats.kv_blocks_total}",
        )
    return None


def _over_kv_watermark(
    priority: int, blocks: int, wait: float, stats: EngineStats, config: SchedulerConfig
) -> Decision | None:
    """``kv_exhausted`` when the KV usage projected with ``blocks`` more (those queued ahead
    and the request's own) passes this class's watermark."""
    watermarks = config.kv_watermarks
    if watermarks is None or not stats.kv_blocks_total:
        return None
    projected = (
        stats.kv_blocks_used
        + blocks_for(stats.waiting_prefill_tokens, stats.block_size or 1)
        + blocks
    )
    usage = projected / stats.kv_blocks_total
    if usage <= watermarks[priority]:
        return None
    return Decision(
        KV_EXHAUSTED,
        f"projected KV usage {usage:.1%} is above this class's watermark "
        f"{watermarks[priority]:.0%}",
        _retry_after(max(wait, stats.step_ms_recent * config.kv_retry_steps), config),
        wait,
    )


def engine_has_room(
    stats: EngineStats, config: SchedulerConfig, starting: int = 0, starting_prefill: int = 0
) -> bool:
    """Whether the engine can take another request now without queueing it behind a full step:
    a free sequence slot and less than one step's token budget of prefill already waiting.

    ``starting``/``starting_prefill``: requests handed over but not yet seen in ``stats``.
    """
    if stats.max_num_seqs and stats.running + stats.waiting + starting >= stats.max_num_seqs:
        return False
    return stats.waiting_prefill_tokens + starting_prefill < config.token_budget


@dataclass(slots=True, eq=False)
class QueueEntry(Generic[T]):
    """One queued item, the cost it adds to its class's figures, and whether it still waits."""

    item: T
    priority: int
    prefill_tokens: int
    blocks: int
    live: bool = True


class AdmissionQueue(Generic[T]):
    """Admitted requests waiting for engine room: strict priority, then earliest deadline first.

    ``push`` takes the ordering keys and the cost figures that :class:`QueueState` aggregates.
    Removing an entry (deadline, client reset) is lazy: it is marked and skipped when it reaches
    the front, but leaves the per-class figures at once. The heap holds (priority, deadline,
    arrival, entry) tuples, so ordering is a tuple comparison in C.
    """

    __slots__ = ("_counter", "_heap", "_live", "state")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, QueueEntry[T]]] = []
        self._counter = itertools.count()
        self._live = 0
        self.state = QueueState()

    def __len__(self) -> int:
        return self._live

    def push(
        self, item: T, priority: int, deadline: float, prefill_tokens: int, blocks: int
    ) -> QueueEntry[T]:
        """Queue ``item``; returns the entry handle to pass to ``remove``."""
        entry = QueueEntry(item, priority, prefill_tokens, blocks)
        heapq.heappush(self._heap, (priority, deadline, next(self._counter), entry))
        state = self.state
        state.count[priority] += 1
        state.prefill_tokens[priority] += prefill_tokens
        state.blocks[priority] += blocks
        self._live += 1
        return entry

    def _forget(self, entry: QueueEntry[T]) -> None:
        entry.live = False
        priority = entry.priority
        state = self.state
        state.count[priority] -= 1
        state.prefill_tokens[priority] -= entry.prefill_tokens
        state.blocks[priority] -= entry.blocks
        self._live -= 1

    def remove(self, entry: QueueEntry[T]) -> bool:
        """Take an entry out of the line; False if it already left."""
        if not entry.live:
            return False
        self._forget(entry)
        return True

    def pop(self) -> T | None:
        """The next item in order, or None when empty."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)[3]
            if entry.live:
                self._forget(entry)
                return entry.item
        return None


__all__ = [
    "ADMIT",
    "CLASSES",
    "PRIORITY_HIGH",
    "PRIORITY_LOW",
    "PRIORITY_NORMAL",
    "AdmissionQueue",
    "Decision",
    "QueueEntry",
    "QueueState",
    "SchedulerConfig",
    "decide",
    "engine_has_room",
    "estimated_wait_ms",
]
