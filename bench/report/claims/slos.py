"""Seed 000's five SLOs as a claim: the stack without the layer meets them at the latency
profile (``harness.slosets.SEED000``, judged by ``bench.report.slosets``)."""

from __future__ import annotations

from bench.report.claim_inputs import STACK_CHANGING, ZEROLAYER, latency_profile
from bench.report.claims.common import NOT_MEASURED, VALIDITY_RULE, ClaimResult
from bench.report.data import RunData
from bench.report.slosets import judge
from bench.report.verdicts import Status
from harness.slosets import SEED000

CLAIM = (
    "seed 000's SLOs hold without the layer: P99 < 200 ms, errors < 0.1 %, GPU utilisation "
    "> 75 %, memory fragmentation < 15 %, NVLink loss 0"
)


def seed_slos(run: RunData) -> ClaimResult:
    rule = (
        "held when every objective the host can measure is met on the zero-layer stack at the "
        "latency profile (the whole interval over its valid trials on the objective's side of its "
        "bound); one surely missed is not held; P99 is TTFT's; fragmentation is the engines' KV "
        "tail waste; GPU utilisation and NVLink errors need a GPU (NVML) and are left out, named, "
        "without one; " + VALIDITY_RULE
    )
    claimed = "P99 < 200 ms, errors < 0.1 %, GPU > 75 %, fragmentation < 15 %, NVLink 0"
    rows = [r for r in run.summaries if r.profile not in STACK_CHANGING]
    if run.sweep is not None or not any(r.stack == ZEROLAYER for r in rows):
        return ClaimResult("seed_slos", CLAIM, claimed, "-", NOT_MEASURED, rule)
    profile = latency_profile(rows)
    if not any(r.stack == ZEROLAYER and r.profile == profile for r in rows):
        return ClaimResult("seed_slos", CLAIM, claimed, "-", NOT_MEASURED, rule)
    got = judge(run, SEED000, ZEROLAYER, profile)
    parts = [
        f"{o.text}: {o.figure.text('.3g', o.unit) if o.figure.value is not None else '-'} "
        f"({o.status})"
        for o in got.objectives
    ]
    reasons = [f"{o.text}: {o.reason}" for o in got.objectives if o.reason]
    status = got.status
    return ClaimResult(
        "seed_slos",
        CLAIM,
        claimed,
        f"zero-layer, {profile}, {got.trials} valid trials: " + "; ".join(parts),
        status,
        rule,
        "; ".join(reasons) if status in (Status.UNDECIDED, Status.NOT_MEASURED) else "",
        {f"{o.text}": o.figure for o in got.objectives if o.figure.value is not None},
        got.trials,
        {f"{o.text}": o.band for o in got.objectives if o.figure.value is not None},
    )
