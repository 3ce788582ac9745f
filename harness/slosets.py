"""Named SLO sets: objectives a whole trial is judged against, beyond a profile's own latency
SLOs (``harness.metrics.Slo``, which decide goodput per request).

``seed000`` is seed 000's five: P99 under 200 ms, errors under 0.1 %, GPU utilisation over
75 %, memory fragmentation under 15 %, no NVLink loss. The seed does not say which latency its
P99 bounds; at 128 output tokens an 8B model's E2EL cannot be under 200 ms on any GPU, so it is
read as TTFT, the latency a streaming user waits for. Fragmentation is KV tail waste from the
engine's own counters (the figure the sim and vLLM report); GPU utilisation and NVLink errors
come from NVML and read "needs a GPU" where there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final


class Needs(StrEnum):
    """What an objective's figure needs beyond the run's own records and engine telemetry."""

    NOTHING = ""
    GPU = "gpu"


class Figure(StrEnum):
    """The per-trial figures an objective can bound (``bench.report.slosets`` measures them)."""

    P99_TTFT_MS = "p99_ttft_ms"
    P99_E2EL_MS = "p99_e2el_ms"
    ERROR_PCT = "error_pct"
    GPU_UTIL_PCT = "gpu_util_pct"
    KV_WASTE_PCT = "kv_waste_pct"
    NVLINK_ERRORS = "nvlink_errors"


@dataclass(frozen=True, slots=True)
class Objective:
    """``figure`` below ``bound`` (or above it, ``at_least``), with its unit and text."""

    figure: Figure
    bound: float
    text: str
    unit: str = ""
    at_least: bool = False
    needs: Needs = Needs.NOTHING


@dataclass(frozen=True, slots=True)
class SloSet:
    name: str
    source: str
    objectives: tuple[Objective, ...]


SEED000: Final = SloSet(
    "seed000",
    "seed 000's five SLOs",
    (
        Objective(Figure.P99_TTFT_MS, 200.0, "P99 (TTFT) < 200 ms", "ms"),
        Objective(Figure.ERROR_PCT, 0.1, "errors < 0.1 %", "%"),
        Objective(Figure.GPU_UTIL_PCT, 75.0, "GPU utilisation > 75 %", "%", True, Needs.GPU),
        Objective(Figure.KV_WASTE_PCT, 15.0, "memory fragmentation (KV tail waste) < 15 %", "%"),
        Objective(Figure.NVLINK_ERRORS, 0.0, "NVLink loss 0 (error counters' rise)", "", False,
                  Needs.GPU),
    ),
)  # fmt: skip
SLO_SETS: Final = {s.name: s for s in (SEED000,)}


def slo_set(name: str) -> SloSet:
    """The set called ``name``; ValueError (one line, the names) for any other."""
    try:
        return SLO_SETS[name]
    except KeyError:
        raise ValueError(
            f"no SLO set {name!r}; the sets are: {', '.join(sorted(SLO_SETS))}"
        ) from None
