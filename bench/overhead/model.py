"""The overhead benchmark's data: the run's settings, what each target is while measured, and
what one target at one in-flight level measured (``Level``), with the arithmetic on it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import psutil

from harness.loaders.senders import Sender, SendFn
from serving.engine import kinds

DEADLINE_MS = 30_000
TENANT = "default"
# A level whose host CPU was this busy (fraction of all cores) ran on a saturated machine.
SATURATED_BUSY = 0.9
# The engines it measures over: the reference engine (no work of its own, so every millisecond
# is the layer's) and real vLLM.
ENGINES: tuple[str, ...] = tuple(
    name
    for name in kinds.ENGINES
    if kinds.engine_kind(name).is_reference or kinds.engine_kind(name).serves_vllm
)


@dataclass(frozen=True, slots=True)
class Defaults:
    """What an option means when not given, per engine: the null engine measures the bare layer
    at high rates; the real vLLM engine a short prompt and a modest stream, in bursts of the
    in-flight count (at a modest rate, evenly spaced requests would rarely overlap)."""

    targets: str
    levels: tuple[int, ...]
    prompt_bytes: int
    max_tokens: int
    duration_s: float
    warmup_s: float
    rss_streams: int
    burst: bool


REFERENCE_DEFAULTS = Defaults("inproc,zerolayer", (1, 64), 1024, 128, 20.0, 1.0, 1000, burst=False)
VLLM_DEFAULTS = Defaults(
    "inproc,zerolayer,vllm-serve,baseline", (1, 16), 256, 32, 20.0, 3.0, 0, burst=True
)
DEFAULTS: Mapping[str, Defaults] = {
    name: REFERENCE_DEFAULTS if kinds.engine_kind(name).is_reference else VLLM_DEFAULTS
    for name in ENGINES
}


@dataclass(frozen=True, slots=True)
class Workload:
    """The request every target serves, and the engine (with its options) behind every target."""

    prompt_bytes: int = 1024
    max_tokens: int = 128
    engine: str = "null"
    engine_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> kinds.EngineKind:
        return kinds.engine_kind(self.engine)


@dataclass(frozen=True, slots=True)
class Settings:
    """One run's options after the engine's defaults are filled in."""

    workload: Workload
    targets: str
    levels: tuple[int, ...]
    rate: float
    duration_s: float
    warmup_s: float
    burst: bool
    rss_streams: int
    rss_max_tokens: int
    out: Path | None
    auth: bool = False


class Role(Enum):
    """What a target is to the report: the floor every other is measured against (the engine
    in-process), the two the verdict compares (the zero-layer stack, vLLM's own server), or
    any other."""

    FLOOR = "floor"
    OURS = "ours"
    PEER = "peer"
    OTHER = "other"


@dataclass(slots=True)
class SystemUnderTest:
    """One stood-up target: how the loader sends to it, how it is torn down, and whose CPU is
    its cost."""

    name: str
    send: SendFn | Sender
    close: Callable[[], Awaitable[None]]
    server_pids: list[int] = field(default_factory=list)


# How a target is stood up (a plug-in's too): ``async fn(name, workload, workdir)``.
TargetFactory = Callable[[str, Workload, Path], Awaitable[SystemUnderTest]]


def host_cores() -> int:
    return psutil.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class HostLoad:
    """How busy the whole host was during a level: CPU busy fraction of all cores, 1-min load."""

    busy: float
    load1: float
    cores: int

    @property
    def saturated(self) -> bool:
        return self.busy >= SATURATED_BUSY or self.load1 >= self.cores


@dataclass(frozen=True, slots=True)
class ServerCpu:
    """CPU seconds a target's server processes spent during a level: all of them, and the
    serving layer's alone (every process but the engine's own)."""

    total_s: float
    layer_s: float


@dataclass(frozen=True, slots=True)
class Level:
    """One target at one in-flight level: percentiles (ms, from intended send) from the run's
    summary, tokens streamed per completed request, CPU costs, and the target's role."""

    target: str
    in_flight: int
    rate: float
    completed: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2el_p50_ms: float | None
    e2el_p99_ms: float | None
    lag_p99_ms: float | None
    tokens: tuple[int, ...]
    client_cpu_us: float
    server_cpu: ServerCpu | None
    host: HostLoad
    error_codes: dict[str, int] = field(default_factory=dict)
    invalid_reasons: tuple[str, ...] = ()
    role: Role = Role.OTHER

    @property
    def tokens_total(self) -> int:
        return sum(self.tokens)

    def _per(self, seconds: float | None, count: int) -> float | None:
        return seconds / count * 1e6 if seconds is not None and count else None

    @property
    def server_us_per_request(self) -> float | None:
        total = self.server_cpu.total_s if self.server_cpu else None
        return self._per(total, self.completed)

    @property
    def server_us_per_token(self) -> float | None:
        total = self.server_cpu.total_s if self.server_cpu else None
        return self._per(total, self.tokens_total)

    @property
    def layer_us_per_token(self) -> float | None:
        layer = self.server_cpu.layer_s if self.server_cpu else None
        return self._per(layer, self.tokens_total)

    def short_streams(self, max_tokens: int) -> int:
        """Completed requests that streamed other than ``max_tokens`` tokens."""
        return sum(1 for n in self.tokens if n != max_tokens)


@dataclass(frozen=True, slots=True)
class Added:
    """What a target adds over the in-process floor at the same in-flight level (ms)."""

    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2el_p50_ms: float | None
    e2el_p99_ms: float | None


def minus(a: float | None, b: float | None) -> float | None:
    """``a - b``, None where either is missing."""
    return a - b if a is not None and b is not None else None


def added(level: Level, floor: Level | None) -> Added:
    """``level``'s percentiles less the floor's (None where either is missing)."""
    if floor is None:
        return Added(None, None, None, None)
    return Added(
        minus(level.ttft_p50_ms, floor.ttft_p50_ms),
        minus(level.ttft_p99_ms, floor.ttft_p99_ms),
        minus(level.e2el_p50_ms, floor.e2el_p50_ms),
        minus(level.e2el_p99_ms, floor.e2el_p99_ms),
    )


def floors(levels: Iterable[Level]) -> dict[int, Level]:
    """The in-process level per in-flight count."""
    return {lv.in_flight: lv for lv in levels if lv.role is Role.FLOOR}
