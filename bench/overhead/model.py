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
from harness.telemetry.host import SATURATED_PCT, SPEED_DIFFERS
from serving.cpus import CpuLayout
from serving.engine import kinds

DEADLINE_MS = 30_000
TENANT = "default"
# A level whose host CPU was this busy (fraction of all cores, or of its busiest core) ran on a
# saturated machine (harness.telemetry.host's bound).
SATURATED_BUSY = SATURATED_PCT / 100
# Under a CPU layout: the loader and the layer processes waited on a run queue for this share of
# their runnable time (a core of their own would leave them near 0).
WAIT_SATURATED = 0.25
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
    (its h2c and HTTP/1.1 sides and a bare h2 echo beside it) at high rates; the real vLLM
    engine a short prompt and a modest stream. Both send in bursts of the in-flight count (at a
    modest rate, evenly spaced requests would rarely overlap), three repeats in a balanced order
    so that intervals are over repeats."""

    targets: str
    levels: tuple[int, ...]
    prompt_bytes: int
    max_tokens: int
    duration_s: float
    warmup_s: float
    rss_streams: int
    burst: bool
    repeats: int = 3


REFERENCE_DEFAULTS = Defaults(
    "inproc,zerolayer,zerolayer-h1,h2-echo", (1, 16), 1024, 32, 10.0, 1.0, 1000, burst=True
)
VLLM_DEFAULTS = Defaults(
    "inproc,zerolayer,vllm-serve,baseline", (1, 4, 16), 256, 32, 20.0, 3.0, 0, burst=True
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
    # Where a vLLM engine computes and where the loader and the layers run (serving.cpus).
    cpu_layout: CpuLayout | None = None

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
    repeats: int = 1


class Role(Enum):
    """What a target is to the report: the floor every other is measured against (the engine
    in-process), the zero-layer stack the verdicts judge, what they judge it against (vLLM's
    own server; the same replica spoken to over HTTP/1.1; a bare h2 echo server, the floor of
    the h2 library), or any other."""

    FLOOR = "floor"
    OURS = "ours"
    PEER = "peer"
    HTTP1 = "http1"
    ECHO = "echo"
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
    """How busy the whole host was during a level: CPU busy fraction of all cores and of the
    busiest one, the 1-min load average (the higher of the readings before and after), one
    core's speed probed just before (``harness.telemetry.host.cpu_speed``; None: not probed),
    and under a CPU layout the busiest of the cores left to the loader and the layers
    (``rest_busiest``; None without one)."""

    busy: float
    load1: float
    cores: int
    busiest: float = 0.0
    speed: float | None = None
    rest_busiest: float | None = None
    wait_share: float | None = None

    @property
    def saturated(self) -> bool:
        """The loader and the layers could not get the CPU they wanted: the project's one rule
        (``harness.validity``), the mean of the cores or any single one at 90 %. Under a CPU
        layout busy cores say nothing: vLLM's engine processes spin on ``sched_yield`` between
        steps while requests come often, on their own cores and, for the scheduler process,
        on the rest's too, yielding to anything that wants the core; there the loader's and
        the layer processes' own wait for a core decides (``wait_share``: the share of their
        runnable time spent on a run queue, from the kernel's schedstat). The load average is
        shown, not judged: it counts the level's own loader and server, and those spinners."""
        if self.wait_share is not None:
            return self.wait_share >= WAIT_SATURATED
        return max(self.busy, self.busiest) >= SATURATED_BUSY

    def problems(self, reference_speed: float | None) -> list[str]:
        """Why the host, not the target, may have set a level's figures: saturated, or its
        speed moved past ``SPEED_DIFFERS`` from ``reference_speed`` (the run's median probe)."""
        found = []
        if self.saturated:
            wait = (f", the loader and layers waited for a core {100 * self.wait_share:.0f} % "
                    "of their runnable time" if self.wait_share is not None else "")  # fmt: skip
            found.append(
                f"host saturated (CPU {100 * self.busy:.0f} %, busiest core "
                f"{100 * self.busiest:.0f} %{wait}, load {self.load1:.2f} on {self.cores} cores)"
            )
        if self.speed is not None and reference_speed:
            moved = self.speed / reference_speed - 1.0
            if abs(moved) > SPEED_DIFFERS:
                found.append(f"host speed moved {moved:+.0%} from the run's median probe")
        return found


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
    repeat: int = 0
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None

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

    def problems(self, reference_speed: float | None) -> list[str]:
        """Why this level is no valid measurement of its target: its summary's reasons (the
        loader lagged, requests were lost) and the host's (saturated, speed moved)."""
        return [*self.invalid_reasons, *self.host.problems(reference_speed)]


# The latency figures every level has, in the order the tables show them (ms).
LATENCY: tuple[str, ...] = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2el_p50_ms",
    "e2el_p99_ms",
)


def minus(a: float | None, b: float | None) -> float | None:
    """``a - b``, None where either is missing."""
    return a - b if a is not None and b is not None else None


def added(level: Level, floor: Level | None) -> dict[str, float | None]:
    """``level``'s latency figures less the floor's, keyed as ``LATENCY`` (None where either is
    missing)."""
    return {
        name: minus(getattr(level, name), getattr(floor, name) if floor else None)
        for name in LATENCY
    }


def floors(levels: Iterable[Level]) -> dict[tuple[int, int], Level]:
    """The in-process level per (in-flight count, repeat)."""
    return {(lv.in_flight, lv.repeat): lv for lv in levels if lv.role is Role.FLOOR}
