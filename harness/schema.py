"""The result schema: file layout of ``results/<run-id>/`` and the records written there.

One home for these names and for each file's reader beside its writer; loaders and the run
write them, metrics, the report and compare read them back as typed objects.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import IO, Any, Final, Literal

import orjson

SCHEMA_VERSION: Final = 2

RUN_META: Final = "run.json"
SUMMARY: Final = "summary.json"
TELEMETRY: Final = "telemetry.jsonl"
PHASES: Final = "phases.jsonl"
PLOTS_DIR: Final = "plots"
REPORT: Final = "report.html"
CHAOS_DIR: Final = "chaos"
SWEEP_DIR: Final = "sweep"

Outcome = Literal["completed", "error", "lost"]
OUTCOMES: Final = ("completed", "error", "lost")


def requests_file(stack: str, profile: str) -> str:
    """Per-request JSONL for one stack and profile."""
    return f"requests-{stack}-{profile}.jsonl"


def point_file(stack: str, profile: str, rate: float, repeat: int) -> str:
    """Per-request JSONL for one sweep point, relative to the run directory."""
    return f"{SWEEP_DIR}/{stack}/{profile}-{rate:g}rps-r{repeat}.jsonl"


@dataclass(slots=True)
class RequestRecord:
    """One request as the loader saw it; every request ends as exactly one of OUTCOMES.

    Times are ``time.time_ns()``-based wall-clock nanoseconds so records from different processes
    line up with telemetry. ``intended_start_ns`` is when the schedule said to send (latency from
    it is coordinated-omission free); ``dispatch_ns`` is when the loader handed it to the client
    (dispatch - intended is the loader's scheduling lag); ``sent_ns`` is when it really went out.
    ``chunk_ns`` holds the arrival time of every content chunk, the first one being TTFT.
    ``engine_ns`` is the time the request spent inside the engine by the serving side's own
    accounting (0 when the stack does not report it); the rest of its latency is the layer's.
    """

    request_id: str
    stack: str
    profile: str
    loader: str
    intended_start_ns: int
    dispatch_ns: int = 0
    sent_ns: int = 0
    first_token_ns: int = 0
    end_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)
    outcome: Outcome = "lost"
    error_code: str = ""
    http_status: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_bytes: int = 0
    request_class: str = ""
    session: str = ""
    tenant: str = ""
    priority: str = "normal"
    replica: str = ""
    retries: int = 0
    deadline_ms: int = 0
    engine_ns: int = 0
    # The request's turn in its session (1, 2, ...; 0 for a workload without turns).
    turn: int = 0

    def to_json(self) -> bytes:
        """orjson serialises dataclasses natively: same JSON as ``asdict`` at a tenth of the cost
        (this runs once per request inside the loader's event loop)."""
        return orjson.dumps(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so an interrupted run keeps its data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, obj: Any) -> None:
        data = obj.to_json() if hasattr(obj, "to_json") else orjson.dumps(obj)
        self._fh.write(data + b"\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ResultsError(Exception):
    """A results file that cannot be read as what it claims to be; the message names the file."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file; only a torn LAST line (an interrupted writer's) is skipped.

    A bad line anywhere else is damage, not an interruption: it raises ResultsError naming the
    file and the line, rather than silently dropping data from the middle of a run.
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    out: list[dict[str, Any]] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError as exc:
            if number == last:
                break
            raise ResultsError(f"{path}: line {number + 1} is not JSON ({exc})") from exc
    return out


def read_requests(path: str | Path) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in read_jsonl(path)]


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2, default=str))
    tmp.replace(path)


def _read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from exc


_STAT_KEY = re.compile(r"^(mean|median|std|p\d+(\.\d+)?)_[a-z0-9_]+_ms$")


@dataclass(frozen=True, slots=True)
class Validity:
    """Whether a row's figures may be reported as the server's, and if not, why."""

    valid: bool
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Validity:
        return cls(bool(data.get("valid", True)), tuple(data.get("reasons", ())))


@dataclass(slots=True)
class SummaryRow:
    """One (stack, profile, loader) row of summary.json: a plain run's profile, or one point
    (an offered rate, one repeat) of a sweep.

    ``loader_limited`` marks a row whose load generator could not keep to the schedule: its
    figures are the loader's, not the stack's, and a sweep plots it as invalid.
    ``offered_rate`` is the rate the schedule was built for (the profile's, or the sweep
    point's); ``saturated`` says
    the load was past what the stack serves (``harness.metrics.saturation``); ``host_cpu_pct``
    is the whole host's CPU use over the phase (all cores), and ``host_saturated`` marks a phase
    in which the stacks and the loader fought for CPU. ``records_file`` names a sweep point's
    per-request file, relative to the run directory.

    The workload's shape (``harness.metrics`` writes and reads these): ``input_lens`` and
    ``output_lens`` (a ``LengthStats``: count, mean, p10/p50/p90/p99 tokens), ``by_turn`` (a
    ``TurnStats`` per turn number; empty without turns) and ``prefix_cache`` (a
    ``PrefixCacheStats`` from the engines' telemetry; empty where the run had none).

    On disk the row is flat with vLLM's key names (``median_e2el_ms`` ...); here the series
    statistics sit in ``stats`` (None where the series was empty: no completions means no
    latency, not 0 ms) and keys this class does not know are kept in ``other``, verbatim.
    """

    stack: str
    profile: str
    loader: str
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
    input_lens: dict[str, Any] = field(default_factory=dict)
    output_lens: dict[str, Any] = field(default_factory=dict)
    by_turn: list[dict[str, Any]] = field(default_factory=list)
    prefix_cache: dict[str, Any] = field(default_factory=dict)
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

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name not in ("stats", "other"):
                out[f.name] = getattr(self, f.name)
        out.update(self.stats)
        out.update(self.other)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SummaryRow:
        names = {f.name for f in fields(cls)} - {"stats", "other"}
        known = {k: v for k, v in data.items() if k in names}
        stats = {k: v for k, v in data.items() if k not in names and _STAT_KEY.match(k)}
        other = {k: v for k, v in data.items() if k not in names and k not in stats}
        known.setdefault("stack", "")
        known.setdefault("profile", "")
        known.setdefault("loader", "")
        return cls(**known, stats=stats, other=other)


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

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "points"}
        out["points"] = [row.to_dict() for row in self.points]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepSection:
        names = {f.name for f in fields(cls)} - {"points"}
        known = {k: v for k, v in data.items() if k in names}
        points = [SummaryRow.from_dict(p) for p in data.get("points") or []]
        return cls(**known, points=points)

    def stack_points(self, stack: str) -> list[SummaryRow]:
        """One stack's points in order of offered rate, then repeat."""
        rows = [p for p in self.points if p.stack == stack]
        return sorted(rows, key=lambda p: (p.offered_rate, p.repeat))


def write_summary(
    run_dir: Path, rows: Sequence[SummaryRow], sweep: SweepSection | None = None
) -> None:
    """summary.json, rewritten whole and atomically after every row and every sweep point."""
    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "rows": [row.to_dict() for row in rows],
        "sweep": sweep.to_dict() if sweep is not None else None,
    }
    _write_json_atomic(run_dir / SUMMARY, data)


def _summary_object(run_dir: Path) -> dict[str, Any]:
    """summary.json as its object; a version-1 file (a bare list of rows) reads as ``rows``."""
    data = _read_json(run_dir / SUMMARY)
    if isinstance(data, list):
        data = {"rows": data, "sweep": None}
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(d, dict) for d in rows):
        raise ResultsError(f"{run_dir / SUMMARY}: expected summary rows")
    sweep = data.get("sweep")
    if sweep is not None and not isinstance(sweep, dict):
        raise ResultsError(f"{run_dir / SUMMARY}: the sweep section must be an object")
    return data


def read_summary(run_dir: Path) -> list[SummaryRow]:
    """summary.json's plain rows; ResultsError when it is not what it claims to be."""
    return [SummaryRow.from_dict(d) for d in _summary_object(run_dir)["rows"]]


def read_sweep(run_dir: Path) -> SweepSection | None:
    """summary.json's sweep section, or None for a plain run."""
    data = _summary_object(run_dir).get("sweep")
    if not data:
        return None
    try:
        return SweepSection.from_dict(data)
    except (KeyError, TypeError) as exc:
        raise ResultsError(f"{run_dir / SUMMARY}: bad sweep section ({exc})") from exc


class RunEnd(StrEnum):
    """How a run ended, as run.json records it."""

    RUNNING = "running"
    COMPLETE = "complete"
    SIGINT = "sigint"
    SIGTERM = "sigterm"
    ERROR = "error"


@dataclass(slots=True)
class RunMeta:
    """run.json: what a run was asked to do, on what, and how it ended.

    ``complete`` and ``incomplete_reason`` are written beside ``end`` so readers of older runs
    and people reading the file see the same verdict. A run that crashed says which exception.
    """

    run_id: str
    scale: str = "unknown"
    schema_version: int = SCHEMA_VERSION
    config: dict[str, Any] = field(default_factory=dict)
    engine: str = "unknown"
    engine_options: dict[str, Any] = field(default_factory=dict)
    git_revision: str = "unknown"
    versions: dict[str, str] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    started_ns: int = 0
    finished_ns: int | None = None
    end: RunEnd = RunEnd.RUNNING
    end_detail: str = ""
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    validity: dict[str, Validity] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    loader_nice: int | None = None
    other: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.end is RunEnd.COMPLETE

    @property
    def incomplete_reason(self) -> str | None:
        """Why the run is not complete, in words; None when it is."""
        if self.end is RunEnd.COMPLETE:
            return None
        if self.end is RunEnd.SIGINT:
            return "interrupted by SIGINT"
        if self.end is RunEnd.SIGTERM:
            return "stopped by SIGTERM"
        if self.end is RunEnd.ERROR:
            return f"stopped by an error: {self.end_detail}"
        return self.end_detail or "the run was interrupted or killed before it recorded its end"

    @property
    def loader(self) -> str | None:
        value = self.config.get("loader")
        return str(value) if value is not None else None

    @property
    def seed(self) -> int | None:
        value = self.config.get("seed")
        return int(value) if value is not None else None

    def stack_labels(self) -> dict[str, str]:
        """What each stack was, in words (``label`` as stand-up recorded it; older runs: the
        implementation's name)."""
        return {
            name: str(meta.get("label") or meta.get("impl") or "?")
            for name, meta in self.stacks.items()
        }

    def profile_seeds(self) -> dict[str, int | None]:
        return {name: p.get("seed") for name, p in self.profiles.items()}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "run_id": self.run_id,
            "scale": self.scale,
            "config": self.config,
            "engine": {"name": self.engine, "options": self.engine_options},
            "git_revision": self.git_revision,
            "versions": self.versions,
            "machine": self.machine,
            "started_ns": self.started_ns,
            "finished_ns": self.finished_ns,
            "end": {"state": self.end.value, "detail": self.end_detail},
            "complete": self.complete,
            "incomplete_reason": self.incomplete_reason,
            "profiles": self.profiles,
            "stacks": self.stacks,
            "validity": {k: v.to_dict() for k, v in self.validity.items()},
            "telemetry": self.telemetry,
            "loader_nice": self.loader_nice,
        }
        return {**self.other, **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], run_id: str = "") -> RunMeta:
        engine = data.get("engine") or {}
        if not isinstance(engine, dict):
            engine = {"name": str(engine)}
        options = engine.get("options")
        if options is None:
            options = {k: v for k, v in engine.items() if k != "name"}
        end_data = data.get("end") or {}
        if end_data:
            end, detail = RunEnd(end_data.get("state", "running")), str(end_data.get("detail", ""))
        elif data.get("complete"):
            end, detail = RunEnd.COMPLETE, ""
        else:
            end, detail = RunEnd.RUNNING, str(data.get("incomplete_reason") or "")
        validity = data.get("validity") or {}
        known = {f.name for f in fields(cls)} | {"complete", "incomplete_reason"}
        return cls(
            run_id=str(data.get("run_id") or run_id),
            scale=str(data.get("scale", "unknown")),
            schema_version=int(data.get("schema_version", SCHEMA_VERSION)),
            config=dict(data.get("config") or {}),
            engine=str(engine.get("name", "unknown")),
            engine_options=dict(options),
            git_revision=str(data.get("git_revision", "unknown")),
            versions=dict(data.get("versions") or {}),
            machine=dict(data.get("machine") or {}),
            started_ns=int(data.get("started_ns") or 0),
            finished_ns=data.get("finished_ns"),
            end=end,
            end_detail=detail,
            profiles=dict(data.get("profiles") or {}),
            stacks=dict(data.get("stacks") or {}),
            validity={k: Validity.from_dict(v) for k, v in validity.items() if isinstance(v, dict)},
            telemetry=dict(data.get("telemetry") or {}),
            loader_nice=data.get("loader_nice"),
            other={k: v for k, v in data.items() if k not in known},
        )


def write_run_meta(run_dir: Path, meta: RunMeta) -> None:
    """run.json, rewritten atomically at every change of state."""
    _write_json_atomic(run_dir / RUN_META, meta.to_dict())


def read_run_meta(run_dir: Path) -> RunMeta:
    """run.json back; ResultsError when it is not a JSON object."""
    data = _read_json(run_dir / RUN_META)
    if not isinstance(data, dict):
        raise ResultsError(f"{run_dir / RUN_META}: expected a JSON object")
    return RunMeta.from_dict(data, run_dir.name)
