"""run.json: what a run was asked to do, on what, and how it ended; reader beside writer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from harness.schema.codec import from_data, to_data
from harness.schema.files import (
    RUN_META,
    SCHEMA_VERSION,
    ResultsError,
    check_version,
    fit_error,
    read_json,
    write_json_atomic,
)
from harness.schema.records import Validity
from serving.engine.settings import EngineSettings


class RunEnd(StrEnum):
    """How a run ended, as run.json records it."""

    RUNNING = "running"
    COMPLETE = "complete"
    SIGINT = "sigint"
    SIGTERM = "sigterm"
    ERROR = "error"


@dataclass(slots=True)
class Machine:
    """The host a run ran on. ``cpu_speed_start`` and ``cpu_speed_end`` are one core's SHA-256
    digests per second as the run started and ended (``harness.telemetry.cpu_speed``); None
    where not probed (an older run, a run that did not end)."""

    hostname: str = ""
    platform: str = ""
    cpus: int | None = None
    memory_bytes: int | None = None
    cpu_speed_start: int | None = None
    cpu_speed_end: int | None = None

    def __str__(self) -> str:
        cpus = "?" if self.cpus is None else self.cpus
        return f"{self.hostname or '?'}, {self.platform or '?'}, {cpus} CPUs"


@dataclass(slots=True)
class TelemetryInfo:
    """run.json's ``telemetry``: the sampling interval, each source as it describes itself
    (``kind``, whether ``available`` and why not, and what it watches: free-form per kind), and
    the sampler's tick counts when it was described."""

    interval_s: float = 0.0
    sources: list[dict[str, Any]] = field(default_factory=list)
    ticks: int = 0
    missed_ticks: int = 0
    read_errors: int = 0


class ParityVerdict(StrEnum):
    """What the check of the stacks' engine settings found (``harness.parity``)."""

    UNCHECKED = "unchecked"  # no setting known on two or more stacks (so far)
    MATCHED = "matched"  # every setting known on two or more stacks has one value
    ALLOWED = "mismatch allowed"  # settings differ; --allow-mismatch ran the run anyway
    STOPPED = "mismatch stopped the run"


@dataclass(slots=True)
class SettingsMismatch:
    """One engine setting with more than one value across the stacks: each stack's value (by
    ``stack/replica`` where the replicas of one stack disagree)."""

    setting: str
    values: dict[str, bool | int | float | str]

    def text(self) -> str:
        """``max_num_seqs: zerolayer 8, baseline 256``."""
        return f"{self.setting}: " + ", ".join(f"{k} {v}" for k, v in self.values.items())


@dataclass(slots=True)
class Parity:
    """run.json's ``parity``: each stack's engine settings as its engines reported them (stack
    -> replica -> settings), the settings compared (known on two or more stacks), what differed,
    why a stack's could not be read, and the verdict."""

    verdict: ParityVerdict = ParityVerdict.UNCHECKED
    allow_mismatch: bool = False
    settings: dict[str, dict[str, EngineSettings]] = field(default_factory=dict)
    compared: list[str] = field(default_factory=list)
    mismatches: list[SettingsMismatch] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class PlacedProcess:
    """One process the suite placed on a Ray cluster (run.json's ``cluster.processes``):
    what it is (``group``: a stack's name, ``loader`` or ``telemetry``; ``role``: ``replica``,
    ``engine``, ``orchestrator``, ``proxy``, ``controller``, ``loader-worker``,
    ``node-agent``), where it runs (the node's id, its label and address, the pid there), the
    address clients reach it at (a replica's URL), the Ray resources it holds and its log there."""

    group: str
    role: str
    name: str
    node_id: str
    node: str = ""
    node_ip: str = ""
    pid: int | None = None
    address: str = ""
    resources: dict[str, float] = field(default_factory=dict)
    log_path: str = ""


@dataclass(slots=True)
class NodeLoss:
    """A node that left the cluster while the run used it: when it was seen gone, what it
    hosted, and whether a chaos experiment took it (``expected``) or not."""

    node_id: str
    node: str
    seen_ns: int
    hosted: list[str] = field(default_factory=list)
    expected: bool = False
    cause: str = ""


@dataclass(slots=True)
class ClusterInfo:
    """run.json's ``cluster``, for a run placed on a Ray cluster (``--ray-address``): its
    address and the namespace of the run's actors, the placement file's record, the nodes as
    the run found them, every process placed on them, and the nodes lost."""

    address: str
    namespace: str = ""
    placement: dict[str, Any] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    processes: list[PlacedProcess] = field(default_factory=list)
    lost: list[NodeLoss] = field(default_factory=list)


@dataclass(slots=True)
class RunMeta:
    """run.json: what a run was asked to do, on what, and how it ended.

    ``complete`` and ``incomplete_reason`` are written beside ``end`` so readers of older runs
    and people reading the file see the same verdict. A run that crashed says which exception.
    ``schema_version`` is the version the file was read in; a written file always says
    ``SCHEMA_VERSION``. ``config``, ``profiles`` and ``stacks`` are free-form: each profile and
    stack kind records what it has.
    """

    run_id: str
    scale: str = "unknown"
    schema_version: int = SCHEMA_VERSION
    config: dict[str, Any] = field(default_factory=dict)
    engine: str = "unknown"
    engine_options: dict[str, Any] = field(default_factory=dict)
    git_revision: str = "unknown"
    versions: dict[str, str] = field(default_factory=dict)
    machine: Machine = field(default_factory=Machine)
    started_ns: int = 0
    finished_ns: int | None = None
    end: RunEnd = RunEnd.RUNNING
    end_detail: str = ""
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    validity: dict[str, Validity] = field(default_factory=dict)
    telemetry: TelemetryInfo = field(default_factory=TelemetryInfo)
    loader_nice: int | None = None
    parity: Parity = field(default_factory=Parity)
    cluster: ClusterInfo | None = None
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

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        """run.json groups ``engine`` and ``end`` as objects and keeps unknown keys at the top."""
        return core_schema.no_info_before_validator_function(
            _meta_fields,
            handler(source),
            serialization=core_schema.wrap_serializer_function_ser_schema(_meta_layout),
        )


def _engine_fields(engine: Any) -> dict[str, Any]:
    """``engine`` as ``{name, options}``; older runs wrote a bare name or the options inline."""
    if not isinstance(engine, dict):
        engine = {"name": str(engine)} if engine else {}
    options = engine.get("options")
    if options is None:
        options = {k: v for k, v in engine.items() if k != "name"}
    return {"engine": engine.get("name", "unknown"), "engine_options": options}


def _end_fields(data: dict[str, Any]) -> dict[str, Any]:
    """``end`` as ``{state, detail}``; older runs wrote only ``complete``."""
    end = data.get("end") or {}
    if end:
        return {"end": end.get("state", "running"), "end_detail": end.get("detail", "")}
    if data.get("complete"):
        return {"end": RunEnd.COMPLETE, "end_detail": ""}
    return {"end": RunEnd.RUNNING, "end_detail": data.get("incomplete_reason") or ""}


_DERIVED: frozenset[str] = frozenset({"complete", "incomplete_reason"})


def _meta_fields(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    names = {f.name for f in fields(RunMeta)}
    grouped = {"engine", "end", "engine_options", "end_detail", "other"}
    known = {k: v for k, v in data.items() if k in names - grouped and v is not None}
    other = {k: v for k, v in data.items() if k not in names | _DERIVED}
    return {
        **known,
        **_engine_fields(data.get("engine")),
        **_end_fields(data),
        "other": other,
    }


def _meta_layout(meta: Any, serialise: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    data = serialise(meta)
    grouped = {
        "schema_version": SCHEMA_VERSION,
        "engine": {"name": data.pop("engine"), "options": data.pop("engine_options")},
        "end": {"state": data.pop("end"), "detail": data.pop("end_detail")},
        "complete": meta.complete,
        "incomplete_reason": meta.incomplete_reason,
    }
    return {**data.pop("other"), **data, **grouped}


def write_run_meta(run_dir: Path, meta: RunMeta) -> None:
    """run.json, rewritten atomically at every change of state."""
    write_json_atomic(run_dir / RUN_META, to_data(meta))


def read_run_meta(run_dir: Path) -> RunMeta:
    """run.json back; ResultsError when it is not a run's record or in a version this code does
    not read."""
    path = run_dir / RUN_META
    data = read_json(path)
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected a JSON object")
    version = check_version(path, data)
    try:
        named = {**data, "run_id": data.get("run_id") or run_dir.name, "schema_version": version}
        return from_data(RunMeta, named)
    except ValueError as exc:
        raise fit_error(path, exc) from exc
