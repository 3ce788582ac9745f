"""The fragmentation claim as seed 003 measured it: one stack, two engine configurations.

Seed 003: with ``--max-model-len 4096``, prefix caching off and client-side truncation, memory
fragmentation fell from 31 % to 4 % and P95 latency became 3.8x more stable. ``zl-bench
fragmentation`` runs the seed's fixed shapes (``harness.variants.FIXED_SHAPES``) against the
engine's defaults in paired trials; this claim judges them. The fragmentation measured is KV tail
waste, ``1 - tokens held / (blocks used x block size)``, from the engine's own counters in each
trial's window (the sim counts its tokens; vLLM does not publish them, so there it is not
measured); a GPU's allocator split (``inactive_split / reserved``, torch engine) is shown where
the run has it. P95 stability is the tail's reach past the median, ``p95 - p50`` of E2EL. A plain
run of stacks measures neither: both of its stacks run the same engine configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from bench.report.claim_inputs import reference_speed
from bench.report.claims.common import NOT_MEASURED, UNDECIDED, VALIDITY_RULE, ClaimResult
from bench.report.data import RunData
from bench.report.verdicts import SPANS, Band, combine, decide
from harness.curves import Interval, interval
from harness.schema import SummaryRow
from harness.validity import MIN_TRIALS, too_few, trial_problems
from harness.variants import ENGINE_DEFAULTS, FIXED_SHAPES

CLAIM: Final = (
    "fixed shapes cut memory fragmentation from 31 % to 4 % and make P95 3.8x more stable"
)
CLAIMED: Final = "31 % -> 4 % (7.75x), P95 3.8x more stable"
WASTE_BAND: Final = Band(31 / 4 / 2)
STABILITY_BAND: Final = Band(3.8 / 2)
NO_COMPARISON: Final = (
    "seed 003 compares engine configurations on one stack, and both stacks of this run run the "
    "same one: `zl-bench fragmentation` measures it"
)
Pair = tuple[SummaryRow, SummaryRow]


def kv_waste_pct(run: RunData, row: SummaryRow) -> float | None:
    """Mean KV tail waste (%) over the engine samples of ``row``'s trial with KV in use."""
    values = [float(t["kv_waste"]) for t in run.trial_telemetry(row, "engine")
              if t.get("kv_blocks_used") and t.get("kv_waste") is not None]  # fmt: skip
    return 100 * float(np.mean(values)) if values else None


def split_pct(run: RunData, row: SummaryRow) -> float | None:
    """Mean allocator split (inactive split / reserved, %) where a GPU engine reports it."""
    values = [t["alloc_inactive_split_bytes"] / t["alloc_reserved_bytes"]
              for t in run.trial_telemetry(row, "engine")
              if t.get("alloc_reserved_bytes") and "alloc_inactive_split_bytes" in t]  # fmt: skip
    return 100 * float(np.mean(values)) if values else None


def p95_spread_ms(row: SummaryRow) -> float | None:
    p95, p50 = row.stat("p95_e2el_ms"), row.stat("median_e2el_ms")
    return None if p95 is None or p50 is None else p95 - p50


def _pairs(run: RunData) -> list[Pair]:
    """(fixed-shapes, engine-defaults) rows of each repeat that has both."""
    fixed = {r.repeat: r for r in run.summaries if r.stack == FIXED_SHAPES.name}
    defaults = {r.repeat: r for r in run.summaries if r.stack == ENGINE_DEFAULTS.name}
    return [(fixed[k], defaults[k]) for k in sorted(fixed.keys() & defaults.keys())]


def _figure(
    pairs: Sequence[Pair], of: Callable[[SummaryRow, SummaryRow], float | None]
) -> Interval:
    return interval([of(f, d) for f, d in pairs], "not measured in a trial", floor=0.0)


def _ratio(
    value: Callable[[SummaryRow], float | None],
) -> Callable[[SummaryRow, SummaryRow], float | None]:
    def ratio(fixed: SummaryRow, default: SummaryRow) -> float | None:
        a, b = value(fixed), value(default)
        return None if a is None or b is None or a <= 0 else b / a

    return ratio


def fragmentation(run: RunData) -> ClaimResult:
    rule = (
        f"held when, per paired trial of one stack under the same mixed workload, the engine "
        f"defaults' KV tail waste is at least {WASTE_BAND.low:.2f}x the fixed shapes' and their "
        f"P95 spread (p95 - p50 E2EL) at least {STABILITY_BAND.low:.1f}x (half the claimed "
        "ratios); KV tail waste from the engine's own counters (not measured where the engine "
        "does not count its tokens, vLLM); " + VALIDITY_RULE
    )
    pairs = _pairs(run)
    if not pairs:
        return ClaimResult("fragmentation", CLAIM, CLAIMED, "-", NOT_MEASURED, rule, NO_COMPARISON)
    reference = reference_speed(run.summaries, run.meta.machine.cpu_speed_start)
    valid = [
        p for p in pairs if not trial_problems(p[0], reference) + trial_problems(p[1], reference)
    ]
    waste = {id(r): kv_waste_pct(run, r) for pair in pairs for r in pair}
    figures = {
        "fixed_waste_pct": _figure(valid, lambda f, _: waste[id(f)]),
        "default_waste_pct": _figure(valid, lambda _, d: waste[id(d)]),
        "waste_ratio": _figure(valid, _ratio(lambda r: waste[id(r)])),
        "stability_ratio": _figure(valid, _ratio(p95_spread_ms)),
    }
    bands = {"waste_ratio": WASTE_BAND, "stability_ratio": STABILITY_BAND}
    split = [s for s in (split_pct(run, r) for pair in valid for r in pair) if s is not None]
    measured = (
        f"KV tail waste {figures['default_waste_pct'].text('.2f', '%')} (engine defaults) -> "
        f"{figures['fixed_waste_pct'].text('.2f', '%')} (fixed shapes), ratio "
        f"{figures['waste_ratio'].text('.2f', 'x')}; P95 spread ratio "
        f"{figures['stability_ratio'].text('.2f', 'x')}; allocator split "
        + (f"{np.mean(split):.1f} %" if split else "needs a GPU (torch engine)")
        + f"; {len(valid)} paired trials of {run.profiles[0] if run.profiles else '?'}"
    )
    if len(valid) < MIN_TRIALS:
        flagged = [f"{r.stack} trial {r.repeat}: {'; '.join(trial_problems(r, reference))}"
                   for pair in pairs for r in pair if trial_problems(r, reference)]  # fmt: skip
        reason = "; ".join([too_few(len(valid)), *flagged[:3]])
        return ClaimResult("fragmentation", CLAIM, CLAIMED, measured, UNDECIDED, rule, reason,
                           figures, len(valid), bands)  # fmt: skip
    parts = [decide(figures[k], band) for k, band in bands.items()]
    status = combine(parts)
    reason = SPANS if status is UNDECIDED else ""
    if status is NOT_MEASURED:
        reason = "KV tail waste not measured: the engine does not count the tokens its blocks hold"
    return ClaimResult("fragmentation", CLAIM, CLAIMED, measured, status, rule, reason, figures,
                       len(valid), bands)  # fmt: skip
