"""A results directory read back into memory: metadata, per-request records, summaries,
telemetry, phases and fault markers. The one loader behind the plots, the HTML report, the claims
check, ``zl-bench compare`` and the notebook.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import orjson

from chaos.recovery import Recovery
from harness import metrics, schema
from harness.errors import UsageError
from harness.runner.trials import trial_phase
from harness.telemetry.usage import phase_windows

RECOVERY_TABLE = "recovery.json"
_REQUESTS_RE = re.compile(r"^requests-(?P<stack>.+)-(?P<profile>[^-.]+)(\.r\d+)?\.jsonl$")


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault marker: when it started (and ended, if known), what it was, and on which stack."""

    t_ns: int
    name: str
    stack: str = ""
    end_ns: int = 0
    source: str = "phases"


@dataclass
class RunData:
    """Everything the report needs from one run, loaded once."""

    path: Path
    meta: schema.RunMeta
    records: dict[tuple[str, str], list[schema.RequestRecord]]
    summaries: list[schema.SummaryRow]
    telemetry: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    faults: list[Fault]
    incomplete_reasons: list[str] = field(default_factory=list)
    sweep: schema.SweepSection | None = None

    @property
    def run_id(self) -> str:
        return self.meta.run_id or self.path.name

    @property
    def scale(self) -> str:
        return self.meta.scale

    @property
    def incomplete(self) -> bool:
        return bool(self.incomplete_reasons)

    @property
    def stacks(self) -> list[str]:
        return _ordered(k[0] for k in self.records)

    @property
    def profiles(self) -> list[str]:
        return _ordered(k[1] for k in self.records)

    @cached_property
    def t0_ns(self) -> int:
        """The run's time origin for plots: the earliest intended send or phase start. Read once
        per run: the plots subtract it from every sample (a smoke run's report spent 29 of its
        64 s finding it again for each of 52,152 telemetry rows)."""
        starts = [r.intended_start_ns for recs in self.records.values() for r in recs]
        starts += [p["t_ns"] for p in self.phases if p.get("kind") == "phase"]
        return min(starts) if starts else 0

    def summary(self, stack: str, profile: str) -> schema.SummaryRow | None:
        for entry in self.summaries:
            if entry.stack == stack and entry.profile == profile:
                return entry
        return None

    def trial_window(self, row: schema.SummaryRow) -> tuple[int, int] | None:
        """The (start, end) wall-clock ns of a plain run's trial, from the phase log; None
        where the log does not have it (an older run, a trial cut short)."""
        name = trial_phase(row.stack, row.profile, row.repeat)
        return phase_windows(self.phases).get(name)

    def trial_telemetry(self, row: schema.SummaryRow, source: str) -> list[dict[str, Any]]:
        """The telemetry rows of ``source`` (``engine``, ``nvml``, ``process``) sampled in
        ``row``'s trial (none without its window)."""
        window = self.trial_window(row)
        if window is None:
            return []
        start, end = window
        return [
            t
            for t in self.telemetry
            if t.get("source") == source and start <= t.get("t_ns", 0) <= end
        ]

    def offered_rate(self, profile: str) -> float | None:
        """Offered load (req/s) as the run recorded it: the capacity preflight's, else the rate."""
        prof = self.meta.profiles.get(profile, {})
        capacity = prof.get("capacity") or {}
        value = capacity.get("offered_requests_per_s", prof.get("rate"))
        return float(value) if value is not None else None

    def point_records(self, row: schema.SummaryRow) -> list[schema.RequestRecord]:
        """A sweep point's per-request records (none where its file is gone)."""
        path = self.path / row.records_file
        if not row.records_file or not path.exists():
            return []
        return schema.read_requests(path)

    @property
    def turn_profiles(self) -> list[str]:
        """The profiles whose requests carry turns (multi-turn sessions), in profile order."""
        return [
            p
            for p in self.profiles
            if any(r.turn > 0 for s in self.stacks for r in self.records.get((s, p), []))
        ]

    def prefix_cache(self, stack: str, profile: str) -> schema.PrefixCacheStats:
        """The stack's prefix-cache figures over the profile as the run recorded them from its
        engines' telemetry; without them (no engine telemetry, an older run) all None."""
        row = self.summary(stack, profile)
        return row.prefix_cache if row else schema.PrefixCacheStats()

    def workload_lengths(self, profile: str) -> dict[str, schema.LengthStats]:
        """The workload file's own input and output length distributions (run.json's
        ``workload_stats``), keyed ``input``/``output``; empty when the run did not record them."""
        stats = self.meta.profiles.get(profile, {}).get("workload_stats") or {}
        return {
            which: schema.from_data(schema.LengthStats, stats[which])
            for which in ("input", "output")
            if isinstance(stats.get(which), dict)
        }

    def capacity(self, profile: str) -> float | None:
        """The engines' predicted capacity (req/s) for a profile, when the run recorded it."""
        capacity = self.meta.profiles.get(profile, {}).get("capacity") or {}
        value = capacity.get("requests_per_s")
        return float(value) if value is not None else None


def read_recovery(run_dir: Path) -> list[Recovery]:
    """chaos/recovery.json, profile D's recovery rows for every stack (none if absent)."""
    path = run_dir / schema.CHAOS_DIR / RECOVERY_TABLE
    if not path.exists():
        return []
    data = _read_json(path)
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise schema.ResultsError(f"{path}: expected a list of recovery rows")
    try:
        return schema.from_data(list[Recovery], data)
    except ValueError as exc:
        raise schema.fit_error(path, exc) from exc


def append_recovery(run_dir: Path, rows: list[Recovery]) -> None:
    """Add one stack's recovery rows to chaos/recovery.json (rewritten whole)."""
    path = run_dir / schema.CHAOS_DIR / RECOVERY_TABLE
    path.parent.mkdir(parents=True, exist_ok=True)
    table = schema.to_data([*read_recovery(run_dir), *rows])
    path.write_bytes(orjson.dumps(table, option=orjson.OPT_INDENT_2))


def _ordered(items: Any) -> list[str]:
    """Unique, in a stable order: zerolayer first, baseline second, the rest by name."""
    rank = {"zerolayer": 0, "baseline": 1}
    return sorted(set(items), key=lambda s: (rank.get(s, 2), s))


def _read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise schema.ResultsError(f"{path}: not JSON ({exc})") from exc


def _iso_ns(value: str) -> int:
    stamp = datetime.fromisoformat(value)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return int(stamp.timestamp() * 1e9)


def _chaos_faults(chaos_dir: Path, stacks: list[str]) -> list[Fault]:
    """Fault markers from Chaos Toolkit journals: each action of the method is one fault."""
    faults = []
    for path in sorted(chaos_dir.glob("*.json")):
        try:
            journal = _read_json(path)
        except (orjson.JSONDecodeError, OSError):
            continue
        if not isinstance(journal, dict) or not isinstance(journal.get("run"), list):
            continue
        stack = next((s for s in stacks if s in path.stem), "")
        for item in journal["run"]:
            activity = item.get("activity", {})
            if activity.get("type") != "action" or not item.get("start"):
                continue
            end = _iso_ns(item["end"]) if item.get("end") else 0
            faults.append(
                Fault(_iso_ns(item["start"]), activity.get("name", "fault"), stack, end, "chaos")
            )
    return faults


def _records(path: Path) -> dict[tuple[str, str], list[schema.RequestRecord]]:
    out: dict[tuple[str, str], list[schema.RequestRecord]] = {}
    chaos_logs = (path / schema.CHAOS_DIR).glob("requests-*.jsonl")
    for file in sorted([*path.glob("requests-*.jsonl"), *chaos_logs]):
        recs = schema.read_requests(file)
        if recs:
            key = (recs[0].stack, recs[0].profile)
        else:
            match = _REQUESTS_RE.match(file.name)
            if match is None:
                continue
            key = (match["stack"], match["profile"])
        out.setdefault(key, []).extend(recs)
    return out


def _check_is_run(path: Path) -> None:
    """A UsageError unless ``path`` holds a run (run.json or request records)."""
    if not path.is_dir():
        raise UsageError(f"no results directory at {path}")
    if (path / schema.RUN_META).exists() or any(path.glob("requests-*.jsonl")):
        return
    runs = sorted(p.name for p in path.iterdir() if (p / schema.RUN_META).exists())
    hint = f"; it holds the runs {', '.join(runs[:5])}" if runs else ""
    raise UsageError(f"{path} is not a run directory (no {schema.RUN_META}, no records){hint}")


def _meta(path: Path, reasons: list[str]) -> schema.RunMeta:
    if not (path / schema.RUN_META).exists():
        reasons.append(f"{schema.RUN_META} is missing: the run never finished writing it")
        return schema.RunMeta(run_id=path.name)
    meta = schema.read_run_meta(path)
    if meta.incomplete_reason is not None:
        reasons.append(meta.incomplete_reason)
    return meta


def _profile_slos(meta: schema.RunMeta, profile: str) -> list[metrics.Slo]:
    """The SLOs a profile ran with, as run.json recorded them (none for older runs)."""
    recorded = meta.profiles.get(profile, {}).get("slos") or []
    return [schema.from_data(metrics.Slo, s) for s in recorded if isinstance(s, dict)]


def _summaries(
    path: Path,
    meta: schema.RunMeta,
    records: dict[tuple[str, str], list[schema.RequestRecord]],
    reasons: list[str],
) -> list[schema.SummaryRow]:
    """summary.json's rows, plus rows recomputed from records (under the SLOs the run recorded)
    for pairs it lacks."""
    summaries = schema.read_summary(path) if (path / schema.SUMMARY).exists() else []
    if (path / schema.RUN_META).exists() and not (path / schema.SUMMARY).exists():
        reasons.append(f"{schema.SUMMARY} is missing: summaries recomputed from the records")
    have = {(s.stack, s.profile) for s in summaries}
    for (stack, profile), recs in records.items():
        if (stack, profile) not in have and recs:
            row = schema.from_data(
                schema.SummaryRow,
                {"stack": stack, "profile": profile, "loader": recs[0].loader}
                | metrics.summarize(recs, slos=_profile_slos(meta, profile)),
            )
            row.recomputed = True
            summaries.append(row)
    return summaries


def _phase_faults(phases: list[dict[str, Any]]) -> list[Fault]:
    return [
        Fault(p["t_ns"], str(p.get("name", "fault")), str(p.get("stack", "")))
        for p in phases
        if p.get("kind") == "fault" and p.get("event", "start") == "start"
    ]


def load_run(path: str | Path) -> RunData:
    """Read a results directory; summaries missing from summary.json are computed from records.

    Raises UsageError when ``path`` is not a run directory (missing, empty, or the parent of
    runs) and schema.ResultsError when a file in it is damaged.
    """
    path = Path(path)
    _check_is_run(path)
    reasons: list[str] = []
    meta = _meta(path, reasons)
    records = _records(path)
    summaries = _summaries(path, meta, records, reasons)
    tele_path, phase_path = path / schema.TELEMETRY, path / schema.PHASES
    telemetry = schema.read_jsonl(tele_path) if tele_path.exists() else []
    phases = schema.read_jsonl(phase_path) if phase_path.exists() else []
    faults = _phase_faults(phases)
    chaos_dir = path / schema.CHAOS_DIR
    if chaos_dir.is_dir():
        faults.extend(_chaos_faults(chaos_dir, _ordered(k[0] for k in records)))
    return RunData(
        path=path,
        meta=meta,
        records=records,
        summaries=summaries,
        telemetry=telemetry,
        phases=phases,
        faults=sorted(faults, key=lambda f: f.t_ns),
        incomplete_reasons=reasons,
        sweep=schema.read_sweep(path) if (path / schema.SUMMARY).exists() else None,
    )
