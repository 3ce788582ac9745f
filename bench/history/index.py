"""``zl-bench index [RESULTS_DIR]``: file results directories in the results store.

A run is read by the report's own reader (``bench.report.data.load_run``: the schema version
decides how each file is read, missing summaries are recomputed from the records), so a
directory written by any earlier version of the suite files the same way a new one does. A run
that did not finish (SIGINT, SIGTERM, a crash, a kill, or still going) is filed as partial with
its reason; a damaged file is skipped with a warning and the rest of the run is filed, as
partial; nothing in the run directory is changed. Filing a run again replaces its rows
(``harness.store.Store.write_run``), so indexing is idempotent and a run filed partial while it
ran is filed whole once it has ended.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar

import orjson

from bench.history.page import write_page
from bench.report import claims
from bench.report.data import RunData, load_run
from harness import curves, metrics, schema, store
from harness.errors import UsageError
from harness.outputs import output_dir
from harness.schema import RequestRecord, ResultsError, RunMeta, SummaryRow, SweepSection
from harness.schema.files import read_json
from harness.store.rows import requests_table, telemetry_table, trials_table

T = TypeVar("T")
RECORD_GLOBS: Final = ("requests-*.jsonl", f"{schema.CHAOS_DIR}/requests-*.jsonl")
_READ_ERRORS: Final = (ResultsError, OSError, ValueError)


@dataclass(frozen=True, slots=True)
class Filed:
    """One run as filed: its id, and whether it is partial and why (it did not finish, or a
    file of it could not be read)."""

    run_id: str
    path: Path
    partial_reasons: tuple[str, ...]

    @property
    def partial(self) -> bool:
        return bool(self.partial_reasons)


def _attempt(warnings: list[str], read: Callable[[], T], fallback: T) -> T:
    """``read()``, or ``fallback`` with the reason in ``warnings``: one damaged file never
    stops a run from being filed."""
    try:
        return read()
    except _READ_ERRORS as exc:
        warnings.append(str(exc))
        return fallback


@dataclass(frozen=True, slots=True)
class _Reading:
    """A run as read: the report's view of it, its per-request files, its claims as
    ``claims.json`` holds them, and what in it could not be read (each once)."""

    run: RunData
    records: dict[str, list[RequestRecord]]
    claims: list[dict[str, Any]]
    warnings: list[str]


def is_run(path: Path) -> bool:
    """A results directory: run.json, or per-request records (a run killed before run.json)."""
    return (path / schema.RUN_META).is_file() or any(path.glob("requests-*.jsonl"))


def find_runs(results: Path, skip: Path) -> Iterator[Path]:
    """Every run directory at or under ``results`` (not inside a run, nor in ``skip``)."""
    if results.resolve() == skip or not results.is_dir():
        return
    if is_run(results):
        yield results
        return
    for child in sorted(p for p in results.iterdir() if p.is_dir()):
        yield from find_runs(child, skip)


def _salvaged(path: Path, warnings: list[str]) -> RunData:
    """What can be read of a run whose report reader stopped on a damaged file."""
    meta = _attempt(warnings, lambda: schema.read_run_meta(path), RunMeta(run_id=path.name))
    summary, telemetry = path / schema.SUMMARY, path / schema.TELEMETRY
    return RunData(
        path=path,
        meta=meta,
        records={},
        summaries=_attempt(warnings, lambda: schema.read_summary(path), [])
        if summary.exists()
        else [],
        telemetry=_attempt(warnings, lambda: schema.read_jsonl(telemetry), [])
        if telemetry.exists()
        else [],
        phases=[],
        faults=[],
        incomplete_reasons=[r for r in [meta.incomplete_reason] if r],
        sweep=_attempt(warnings, lambda: schema.read_sweep(path), None)
        if summary.exists()
        else None,
    )


def _record_files(path: Path) -> list[Path]:
    found = [p for pattern in RECORD_GLOBS for p in sorted(path.glob(pattern))]
    return found + sorted((path / schema.SWEEP_DIR).rglob("*.jsonl"))


def read(path: Path) -> _Reading:
    """The run at ``path``, every per-request file of it and its claims; what could not be
    read is a warning."""
    warnings: list[str] = []
    try:
        run = load_run(path)
    except ResultsError as exc:
        warnings.append(str(exc))
        run = _salvaged(path, warnings)
    records: dict[str, list[RequestRecord]] = {}
    for file in _record_files(path):
        read = partial(schema.read_requests, file)
        records[str(file.relative_to(path))] = _attempt(warnings, read, [])
    results: list[dict[str, Any]] = _attempt(warnings, partial(_claims, path), [])
    return _Reading(run, records, results, list(dict.fromkeys(warnings)))


def _utc(ns: int | float | None) -> datetime | None:
    return datetime.fromtimestamp(ns / 1e9, UTC).replace(tzinfo=None) if ns else None


def _model(meta: RunMeta) -> str:
    """The engine's model: its ``model`` or ``model_shape`` option, else the one the capacity
    preflight named (``sim:llama-3.1-8b``: the engine's default)."""
    options = meta.engine_options
    named = options.get("model") or options.get("model_shape")
    if named:
        return str(named)
    for profile in meta.profiles.values():
        engine = str((profile.get("capacity") or {}).get("engine") or "")
        if ":" in engine:
            return engine.split(":", 1)[1]
    return ""


def _sweep_json(sweep: SweepSection | None) -> str | None:
    if sweep is None:
        return None
    return orjson.dumps(schema.to_data(dataclasses.replace(sweep, points=[]))).decode()


def _started(run: RunData) -> datetime | None:
    """When the run started: as run.json says, else its first send, else its directory's time."""
    return _utc(run.meta.started_ns or run.t0_ns or run.path.stat().st_mtime_ns)


def _run_row(run: RunData, filed: Filed) -> dict[str, object]:
    meta, report = run.meta, run.path / schema.REPORT
    return {
        "run_id": filed.run_id,
        "kind": "sweep" if run.sweep is not None else "run",
        "path": str(run.path),
        "report": str(report) if report.is_file() else None,
        "started": _started(run),
        "finished": _utc(meta.finished_ns),
        "end_state": str(meta.end),
        "partial": filed.partial,
        "partial_reasons": list(filed.partial_reasons),
        "scale": meta.scale,
        "engine": meta.engine,
        "engine_options": orjson.dumps(meta.engine_options, default=str).decode(),
        "model": _model(meta),
        "profiles": list(meta.profiles) or run.profiles,
        "stacks": list(meta.stacks) or run.stacks,
        "loader": meta.loader,
        "seed": meta.seed,
        "repeats": meta.config.get("repeats"),
        "git_revision": meta.git_revision,
        "host": meta.machine.hostname,
        "platform": meta.machine.platform,
        "cpus": meta.machine.cpus,
        "cpu_speed_start": meta.machine.cpu_speed_start,
        "cpu_speed_end": meta.machine.cpu_speed_end,
        "schema_version": meta.schema_version,
        "indexed": datetime.now(UTC).replace(tzinfo=None),
        "meta_json": orjson.dumps(schema.to_data(meta)).decode(),
        "sweep_json": _sweep_json(run.sweep),
    }


def _claims(path: Path) -> list[dict[str, Any]]:
    """The claims of ``claims.json`` as data (none without the file): the columns the store
    keeps are read by name, so a file written before or after a claim gained a field reads."""
    file = path / claims.CLAIMS_FILE
    found = read_json(file).get("claims", []) if file.exists() else []
    if not all(isinstance(c, dict) for c in found):
        raise ResultsError(f"{file}: expected a list of claims")
    return list(found)


_CLAIM_TEXT: Final = ("key", "claim", "claimed", "measured", "status", "reason", "rule")


def _claims_rows(run_id: str, found: list[dict[str, Any]]) -> list[dict[str, object]]:
    return [
        {
            "run_id": run_id,
            **{k: str(c.get(k) or "") for k in _CLAIM_TEXT},
            "trials": int(c.get("trials") or 0),
            "figures_json": orjson.dumps(c.get("figures") or {}).decode(),
        }
        for c in found
    ]


def _headline(sweep: SweepSection, stack: str) -> dict[str, Any]:
    """A stack's headline figures as the sweep stored them, else computed from its points."""
    stored = (sweep.stacks.get(stack) or {}).get("headline") or {}
    if stored:
        return dict(stored)
    slos = schema.from_data(list[metrics.Slo], sweep.slos)
    return schema.to_data(curves.headline(sweep.stack_points(stack), slos))


def _sweep_rows(run_id: str, sweep: SweepSection | None) -> list[dict[str, object]]:
    if sweep is None:
        return []
    figures: list[tuple[str, str, dict[str, Any], str]] = [
        (stack, name, figure, str((sweep.stacks.get(stack) or {}).get("stopped") or ""))
        for stack in dict.fromkeys(p.stack for p in sweep.points)
        for name, figure in _headline(sweep, stack).items()
    ]
    swept = {p.stack for p in sweep.points}
    if {curves.BASELINE, curves.ZEROLAYER} <= swept and sweep.added_latency.get("rate"):
        added = sweep.added_latency["rate"]
        figures.append((f"{curves.BASELINE}-{curves.ZEROLAYER}", "added_latency_rate", added, ""))
    keys = ("value", "low", "high", "n", "note")
    return [
        {"run_id": run_id, "profile": sweep.profile, "stack": stack, "figure": name,
         **{k: figure.get(k) for k in keys}, "stopped": stopped}
        for stack, name, figure, stopped in figures
    ]  # fmt: skip


def _records_file(row: SummaryRow, path: Path) -> SummaryRow:
    """An older row that does not name its records file, named by the layout it was written in."""
    if row.records_file:
        return row
    name = schema.requests_file(row.stack, row.profile, row.repeat)
    return dataclasses.replace(row, records_file=name) if (path / name).exists() else row


def tables(reading: _Reading, filed: Filed) -> store.RunTables:
    """Every per-run table's rows for the run read."""
    run, run_id = reading.run, filed.run_id
    rows = [_records_file(r, run.path) for r in run.summaries]
    points = run.sweep.points if run.sweep is not None else []
    claim_rows = _claims_rows(run_id, reading.claims)
    return store.RunTables(
        runs=store.table_of(store.RUNS, [_run_row(run, filed)]),
        trials=trials_table(run_id, rows, points, run.meta.machine.cpu_speed_start),
        requests=requests_table(run_id, reading.records),
        claims=store.table_of(store.CLAIMS, claim_rows),
        sweeps=store.table_of(store.SWEEPS, _sweep_rows(run_id, run.sweep)),
        telemetry=telemetry_table(run_id, run.telemetry),
    )


def index_run(into: store.Store, path: Path) -> Filed:
    """File the run at ``path`` in the store ``into`` (its rows replaced if already there)."""
    path = path.resolve()
    reading = read(path)
    run_id = reading.run.meta.run_id or path.name
    reasons = tuple(dict.fromkeys([*reading.run.incomplete_reasons, *reading.warnings]))
    filed = Filed(run_id, path, reasons)
    into.write_run(run_id, tables(reading, filed))
    return filed


def index_results(results: Path, into: store.Store) -> list[Filed]:
    """File every run under ``results``; a run that cannot be filed at all is a warning line
    and the others are filed."""
    filed = []
    for path in find_runs(results, into.root):
        try:
            done = index_run(into, path)
        except Exception as exc:
            print(f"warning: {path}: not filed: {exc}", flush=True)
            continue
        filed.append(done)
        state = f"partial ({'; '.join(done.partial_reasons)})" if done.partial else "complete"
        print(f"filed {done.run_id}: {state}", flush=True)
    return filed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench index``'s arguments."""
    parser.add_argument(
        "results",
        nargs="?",
        default="results",
        help="a results directory (the runs under it are filed, at any depth) or one run",
    )
    parser.add_argument(
        "--store",
        default=None,
        help=f"the store (default: ${store.STORE_ENV}, else RESULTS/store; for one run, "
        "the store beside it)",
    )


def run_command(args: argparse.Namespace) -> int:
    """File every run under RESULTS, then rewrite the index page beside them."""
    results = Path(args.results).expanduser().resolve()
    if not results.is_dir():
        raise UsageError(f"no results directory at {args.results}")
    parent = results.parent if is_run(results) else results
    if args.store is not None:
        output_dir(args.store, "--store")
    into = store.Store(store.store_path(parent, args.store))
    filed = index_results(results, into)
    if not filed:
        raise UsageError(f"no run directory under {args.results} (none holds {schema.RUN_META})")
    page = write_page(into, parent)
    partial = sum(1 for f in filed if f.partial)
    print(f"store {into.root}: {len(filed)} run(s) filed, {partial} partial; index: {page}")
    return 0
