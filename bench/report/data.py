"""A results directory read back into memory: metadata, per-request records, summaries,
telemetry, phases and fault markers. The one loader behind the plots, the HTML report, the claims
check, ``zl-bench compare`` and the notebook.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from harness import metrics, schema

_REQUESTS_RE = re.compile(r"^requests-(?P<stack>.+)-(?P<profile>[^-]+)\.jsonl$")


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
    meta: dict[str, Any]
    records: dict[tuple[str, str], list[schema.RequestRecord]]
    summaries: list[dict[str, Any]]
    telemetry: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    faults: list[Fault]
    incomplete_reasons: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return str(self.meta.get("run_id") or self.path.name)

    @property
    def scale(self) -> str:
        return str(self.meta.get("scale", "unknown"))

    @property
    def incomplete(self) -> bool:
        return bool(self.incomplete_reasons)

    @property
    def stacks(self) -> list[str]:
        return _ordered(k[0] for k in self.records)

    @property
    def profiles(self) -> list[str]:
        return _ordered(k[1] for k in self.records)

    @property
    def t0_ns(self) -> int:
        """The run's time origin for plots: the earliest intended send or phase start."""
        starts = [r.intended_start_ns for recs in self.records.values() for r in recs]
        starts += [p["t_ns"] for p in self.phases if p.get("kind") == "phase"]
        return min(starts) if starts else 0

    def summary(self, stack: str, profile: str) -> dict[str, Any] | None:
        for entry in self.summaries:
            if entry.get("stack") == stack and entry.get("profile") == profile:
                return entry
        return None

    def offered_rate(self, profile: str) -> float | None:
        """Offered load (req/s) as the run recorded it: the capacity preflight's, else the rate."""
        prof = self.meta.get("profiles", {}).get(profile, {})
        capacity = prof.get("capacity") or {}
        value = capacity.get("offered_requests_per_s", prof.get("rate"))
        return float(value) if value is not None else None

    def capacity(self, profile: str) -> float | None:
        """The engines' predicted capacity (req/s) for a profile, when the run recorded it."""
        capacity = self.meta.get("profiles", {}).get(profile, {}).get("capacity") or {}
        value = capacity.get("requests_per_s")
        return float(value) if value is not None else None


def _ordered(items: Any) -> list[str]:
    """Unique, in a stable order: zerolayer first, baseline second, the rest by name."""
    rank = {"zerolayer": 0, "baseline": 1}
    return sorted(set(items), key=lambda s: (rank.get(s, 2), s))


def _read_json(path: Path) -> Any:
    return orjson.loads(path.read_bytes())


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


def load_run(path: str | Path) -> RunData:
    """Read a results directory; summaries missing from summary.json are computed from records."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no results directory at {path}")
    reasons = []
    meta_path = path / schema.RUN_META
    meta: dict[str, Any] = _read_json(meta_path) if meta_path.exists() else {}
    if not meta:
        reasons.append(f"{schema.RUN_META} is missing: the run never finished writing it")
    elif meta.get("complete") is False or meta.get("status") in ("incomplete", "interrupted"):
        reasons.append(str(meta.get("incomplete_reason") or "the run was interrupted"))
    records = _records(path)
    summary_path = path / schema.SUMMARY
    summaries: list[dict[str, Any]] = _read_json(summary_path) if summary_path.exists() else []
    if meta and not summary_path.exists():
        reasons.append(f"{schema.SUMMARY} is missing: summaries recomputed from the records")
    have = {(s.get("stack"), s.get("profile")) for s in summaries}
    for (stack, profile), recs in records.items():
        if (stack, profile) not in have and recs:
            loader = recs[0].loader
            summaries.append(
                {
                    "stack": stack,
                    "profile": profile,
                    "loader": loader,
                    "recomputed": True,
                    **metrics.summarize(recs),
                }
            )
    tele_path, phase_path = path / schema.TELEMETRY, path / schema.PHASES
    telemetry = schema.read_jsonl(tele_path) if tele_path.exists() else []
    phases = schema.read_jsonl(phase_path) if phase_path.exists() else []
    faults = [
        Fault(p["t_ns"], str(p.get("name", "fault")), str(p.get("stack", "")))
        for p in phases
        if p.get("kind") == "fault" and p.get("event", "start") == "start"
    ]
    stacks = _ordered(k[0] for k in records)
    chaos_dir = path / schema.CHAOS_DIR
    if chaos_dir.is_dir():
        faults.extend(_chaos_faults(chaos_dir, stacks))
    return RunData(
        path=path,
        meta=meta,
        records=records,
        summaries=summaries,
        telemetry=telemetry,
        phases=phases,
        faults=sorted(faults, key=lambda f: f.t_ns),
        incomplete_reasons=reasons,
    )
