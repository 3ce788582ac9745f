"""summary.json: one row per (stack, profile, loader), and a sweep's section; reader beside
writer."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from harness.schema.codec import from_data, to_data
from harness.schema.files import (
    SCHEMA_VERSION,
    SUMMARY,
    ResultsError,
    check_version,
    fit_error,
    read_json,
    write_json_atomic,
)
from harness.schema.records import LengthStats, PrefixCacheStats, TurnStats, Validity

_STAT_KEY = re.compile(r"^(mean|median|std|p\d+(\.\d+)?)_[a-z0-9_]+_ms$")
_NESTED: frozenset[str] = frozenset({"stats", "other"})


@dataclass(slots=True)
class SummaryRow:
    """One (stack, profile, loader) row of summary.json: a plain run's profile, or one point
    (an offered rate, one repeat) of a sweep.

    ``loader_limited`` marks a row whose load generator could not keep to the schedule: its
    figures are the loader's, not the stack's, and a sweep plots it as invalid.
    ``offered_rate`` is the rate the schedule was built for (the profile's, or the sweep
    point's); ``saturated`` says the load was past what the stack serves
    (``harness.metrics.saturation``); ``host_cpu_pct`` is the whole host's CPU use over the
    phase (all cores), and ``host_saturated`` marks a phase in which the stacks and the loader
    fought for CPU (all cores, or one, at the bound); ``host_speed`` is one core's speed probed
    just before the trial (``harness.telemetry.cpu_speed``; None where it was not probed).
    ``repeat`` numbers the trial of a plain run's profile or of a sweep's rate, and
    ``records_file`` names its per-request file, relative to the run directory.

    The workload's shape, computed by ``harness.metrics``: ``input_lens`` and ``output_lens``,
    ``by_turn`` (one per turn number; empty without turns) and ``prefix_cache`` (from the
    engines' telemetry; no counters where the run had none).

    On disk the row is flat with vLLM's key names (``median_e2el_ms`` ...); here the series
    statistics sit in ``stats`` (None where the series was empty: no completions means no
    latency, not 0 ms) and keys this class does not know are kept in ``other``, verbatim.
    ``schema.to_data`` and ``schema.from_data`` convert between the two.
    """

    stack: str = ""
    profile: str = ""
    loader: str = ""
    num_requests: int = 0
    completed: int = 0
    errors: int = 0
    lost: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    duration: float = 0.0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    request_throughput: float = 0.0
    request_goodput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    slos_ms: dict[str, float] = field(default_factory=dict)
    slo_percentiles: dict[str, float] = field(default_factory=dict)
    slo_met: bool | None = None
    saturated: bool = False
    saturation_reasons: list[str] = field(default_factory=list)
    offered_rate: float = 0.0
    host_cpu_pct: float | None = None
    host_busiest_cpu_pct: float | None = None
    host_saturated: bool = False
    host_speed: float | None = None
    repeat: int = 0
    point: int | None = None
    records_file: str = ""
    stats: dict[str, float | None] = field(default_factory=dict)
    hdr_us: dict[str, str] = field(default_factory=dict)
    valid: bool = True
    invalid_reasons: list[str] = field(default_factory=list)
    loader_limited: bool = False
    loader_protocol: str = ""
    ttft_is_first_byte: bool = False
    loader_extra: dict[str, Any] = field(default_factory=dict)
    recomputed: bool = False
    input_lens: LengthStats = field(default_factory=LengthStats)
    output_lens: LengthStats = field(default_factory=LengthStats)
    by_turn: list[TurnStats] = field(default_factory=list)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    other: dict[str, Any] = field(default_factory=dict)

    def stat(self, key: str) -> float | None:
        """A series statistic by its vLLM name, e.g. ``p99_e2el_ms``; None when not measured."""
        return self.stats.get(key)

    @property
    def failed(self) -> int:
        return self.errors + self.lost

    @property
    def validity(self) -> Validity:
        return Validity(self.valid, tuple(self.invalid_reasons))

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        """The flat layout on disk: validation nests it, serialisation flattens it back."""
        return core_schema.no_info_before_validator_function(
            _nest_row,
            handler(source),
            serialization=core_schema.wrap_serializer_function_ser_schema(_flatten_row),
        )


def _nest_row(data: Any) -> Any:
    """A flat row's keys sorted into fields, ``stats`` and ``other``. Nothing about a row has
    changed shape since version 1: a ``prefix_cache`` written as {} reads as no counters."""
    if not isinstance(data, dict):
        return data
    names = {f.name for f in fields(SummaryRow)} - _NESTED
    known = {k: v for k, v in data.items() if k in names}
    stats = {k: v for k, v in data.items() if k not in names and _STAT_KEY.match(k)}
    other = {k: v for k, v in data.items() if k not in names and k not in stats}
    return {**known, "stats": stats, "other": other}


def _flatten_row(row: Any, serialise: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    data = serialise(row)
    flat = {k: v for k, v in data.items() if k not in _NESTED}
    return {**flat, **data["stats"], **data["other"]}


@dataclass(slots=True)
class SweepSection:
    """summary.json's ``sweep``: one profile at a series of offered rates on every stack.

    ``points`` are rows with ``offered_rate``, ``repeat`` and ``point`` set; ``stacks`` holds per
    stack why its sweep stopped (``stopped``) and its headline figures (max goodput, knee, each an
    interval over repeats); ``added_latency`` the rate at which the baseline's latency over the
    zero-layer stack's passes ``added_latency_bound_ms``. ``mode`` is ``grid`` or ``adaptive``
    (bisection to ``resolution``, a fraction of the rate).
    """

    profile: str
    scale: str
    mode: str
    slos: list[dict[str, Any]]
    rates: list[float]
    repeats: int
    resolution: float | None = None
    added_latency_bound_ms: float = 0.0
    capacity_rps: float | None = None
    points: list[SummaryRow] = field(default_factory=list)
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    added_latency: dict[str, Any] = field(default_factory=dict)

    def stack_points(self, stack: str) -> list[SummaryRow]:
        """One stack's points in order of offered rate, then repeat."""
        rows = [p for p in self.points if p.stack == stack]
        return sorted(rows, key=lambda p: (p.offered_rate, p.repeat))


@dataclass(slots=True)
class Summary:
    """summary.json whole: the plain rows and, for a sweep, its section."""

    rows: list[SummaryRow] = field(default_factory=list)
    sweep: SweepSection | None = None
    schema_version: int = SCHEMA_VERSION


def write_summary(
    run_dir: Path, rows: Sequence[SummaryRow], sweep: SweepSection | None = None
) -> None:
    """summary.json, rewritten whole and atomically after every row and every sweep point."""
    write_json_atomic(run_dir / SUMMARY, to_data(Summary(list(rows), sweep)))


def _read_summary(run_dir: Path) -> Summary:
    """summary.json back; a version-1 file (a bare list of rows) reads as ``rows``."""
    path = run_dir / SUMMARY
    data = read_json(path)
    if isinstance(data, list):
        data = {"rows": data, "schema_version": 1}
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected summary rows")
    check_version(path, data)
    if not data.get("sweep"):
        data = {**data, "sweep": None}
    try:
        return from_data(Summary, data)
    except ValueError as exc:
        raise fit_error(path, exc) from exc


def read_summary(run_dir: Path) -> list[SummaryRow]:
    """summary.json's plain rows; ResultsError when it is not what it claims to be."""
    return _read_summary(run_dir).rows


def read_sweep(run_dir: Path) -> SweepSection | None:
    """summary.json's sweep section, or None for a plain run."""
    return _read_summary(run_dir).sweep
