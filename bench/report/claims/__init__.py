"""The seed study's claims (docs/design.md), each checked against what this run measured.

The seeds' numbers come from a different machine and scale, so each check compares what carries
across scales: absolute overheads within a factor of two of the claimed range, and stack-to-stack
ratios in the claimed direction and at least half the claimed size. Every row states its rule,
the claimed figure, the measured one with its interval over trials, and the reason when it is
undecided; the rule for which trials count and when an interval decides is
``harness.validity``'s, printed from the same text (``VALIDITY_RULE``).

The latency claims are judged on paired trials (``bench.report.claim_inputs``): a plain run's
latency profile, paired by repeat; a sweep at stated fractions of the lower stack's knee. The
claim's figure is taken per pair and summarised as an interval over pairs
(``harness.curves.interval``). Claims measured once per stack (a chaos experiment, the whole
run's telemetry) have no interval over trials and are undecided until they are measured per
trial. The results are written to ``claims.json`` (``write``) for the report, the notebook and
``compare``.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.report.claims.common import (
    HELD,
    NOT_HELD,
    NOT_MEASURED,
    ONE_SAMPLE,
    UNDECIDED,
    VALIDITY_RULE,
    ClaimResult,
)
from bench.report.claims.elasticity import elastic_first_request, elastic_sessions_kept
from bench.report.claims.faults import FAULT_PROFILE, fault_errors, refusal_speed, retry_success
from bench.report.claims.footprint import layer_cpu_share, layer_memory_share, node_footprint
from bench.report.claims.fragmentation import fragmentation
from bench.report.claims.latency import TAIL_KEYS, latency_inputs, layer_overhead, tail_latency
from bench.report.claims.slos import seed_slos
from bench.report.data import RunData
from bench.report.verdicts import SPANS, Band, Status, decide
from harness import schema
from harness.schema.files import read_json, write_json_atomic

CLAIMS_FILE: Final = "claims.json"

CLAIMS: tuple[Callable[[RunData], ClaimResult], ...] = (
    layer_overhead,
    layer_cpu_share,
    layer_memory_share,
    node_footprint,
    tail_latency,
    refusal_speed,
    fault_errors,
    retry_success,
    fragmentation,
    seed_slos,
    elastic_first_request,
    elastic_sessions_kept,
)


def evaluate(run: RunData) -> list[ClaimResult]:
    """Every claim, in docs/design.md's order."""
    return [check(run) for check in CLAIMS]


def write(run_dir: Path, results: Sequence[ClaimResult]) -> Path:
    """``claims.json``: every claim with its verdict, figures, intervals, trial count and
    reason, and the validity rule it was decided under."""
    path = run_dir / CLAIMS_FILE
    data = {"validity_rule": VALIDITY_RULE, "claims": schema.to_data(list(results))}
    write_json_atomic(path, data)
    return path


@dataclass(frozen=True, slots=True)
class ClaimsFile:
    """``claims.json`` read back: the verdicts and the validity rule they were decided under."""

    claims: list[ClaimResult]
    validity_rule: str


def read(run_dir: Path) -> ClaimsFile | None:
    """The claims a run's report wrote; None when it has no ``claims.json`` (a run whose report
    was never rendered, or one written before the file existed)."""
    path = Path(run_dir) / CLAIMS_FILE
    if not path.exists():
        return None
    raw = read_json(path)
    return ClaimsFile(
        [schema.from_data(ClaimResult, c) for c in raw.get("claims", [])],
        str(raw.get("validity_rule", "")),
    )


__all__ = [
    "CLAIMS",
    "CLAIMS_FILE",
    "FAULT_PROFILE",
    "HELD",
    "NOT_HELD",
    "NOT_MEASURED",
    "ONE_SAMPLE",
    "SPANS",
    "TAIL_KEYS",
    "UNDECIDED",
    "VALIDITY_RULE",
    "Band",
    "ClaimResult",
    "ClaimsFile",
    "Status",
    "decide",
    "evaluate",
    "fault_errors",
    "fragmentation",
    "latency_inputs",
    "layer_cpu_share",
    "layer_memory_share",
    "layer_overhead",
    "node_footprint",
    "read",
    "refusal_speed",
    "retry_success",
    "seed_slos",
    "tail_latency",
    "write",
]
