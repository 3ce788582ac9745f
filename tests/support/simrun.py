"""Real results directories for the report, compare and notebook tests.

Drives the sim engine in-process with a seeded open-loop schedule, writes one RequestRecord per
request as it ends, and samples telemetry through the real Sampler, so the report is tested on
what a run genuinely produces. Two in-process stand-ins play the two stacks: ``zerolayer`` calls
the engine directly; ``baseline`` passes each request through a bounded pool (an orchestrator's
``max_ongoing_requests``), which is real queueing in front of the same engine.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from harness import metrics, schema
from harness.runner.trials import trial_phase
from harness.telemetry import (
    Component,
    EngineSource,
    EngineTarget,
    NvmlSource,
    PhaseLog,
    ProcessSource,
    Sampler,
)
from harness.workload import arrival_offsets
from serving.engine import EngineError, EngineRequest, SimConfig, SimEngine

# a small KV cache so occupancy and waste move visibly at test scale
ENGINE = {"model_shape": "llama-3.2-1b", "num_kv_blocks": 96}


@dataclass(frozen=True)
class Spec:
    """A small profile: ``count`` Poisson arrivals at ``rate``; ``fault_at`` aborts in-flight
    requests that many seconds in (a real fault: those requests end in errors)."""

    count: int = 24
    rate: float = 40.0
    prompt_tokens: int = 64
    max_tokens: int = 12
    fault_at: float | None = None


PROFILES = {"a_latency": Spec(), "d_fault": Spec(count=24, rate=30.0, fault_at=0.3)}
STACKS: dict[str, int | None] = {"zerolayer": None, "baseline": 2}


async def _one(
    engine: SimEngine,
    gate: asyncio.Semaphore | None,
    rec: schema.RequestRecord,
    req: EngineRequest,
    writer: schema.JsonlWriter,
) -> None:
    rec.dispatch_ns = rec.sent_ns = time.time_ns()
    if gate is not None:
        await gate.acquire()
    try:
        start = time.time_ns()
        try:
            async for chunk in engine.generate(req):
                now = time.time_ns()
                if chunk.token_ids:
                    rec.chunk_ns.append(now)
                    rec.output_tokens += len(chunk.token_ids)
                    if not rec.first_token_ns:
                        rec.first_token_ns = now
                if chunk.finish_reason == "abort":
                    rec.outcome, rec.error_code = "error", "engine_down"
                elif chunk.finish_reason is not None:
                    rec.outcome = "completed"
        except EngineError as exc:
            rec.outcome, rec.error_code = "error", exc.code
        rec.end_ns = time.time_ns()
        rec.engine_ns = rec.end_ns - start
    finally:
        if gate is not None:
            gate.release()
    writer.write(rec)


async def _drive(
    out: Path,
    stack: str,
    profile: str,
    spec: Spec,
    engine: SimEngine,
    gate_size: int | None,
    phases: PhaseLog,
    seed: int,
    repeat: int = 0,
) -> None:
    gate = asyncio.Semaphore(gate_size) if gate_size else None
    offsets = arrival_offsets("poisson", spec.rate, spec.count, seed + repeat)
    name = trial_phase(stack, profile, repeat)
    phases.begin(name, stack=stack, profile=profile, repeat=repeat)
    t0_ns, t0 = time.time_ns() + 20_000_000, time.monotonic() + 0.02
    tasks = []
    with schema.JsonlWriter(out / schema.requests_file(stack, profile, repeat)) as writer:
        fault_done = spec.fault_at is None
        for i, offset in enumerate(offsets):
            if not fault_done and offset >= spec.fault_at:
                await asyncio.sleep(max(0.0, t0 + spec.fault_at - time.monotonic()))
                phases.fault("abort in-flight", stack=stack, profile=profile)
                for seq_id in list(engine.batcher.seqs):
                    engine.abort(seq_id)
                fault_done = True
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            rec = schema.RequestRecord(
                request_id=f"{stack}-{profile}-r{repeat}-{i}"
                if repeat
                else f"{stack}-{profile}-{i}",
                stack=stack,
                profile=profile,
                loader="inproc",
                intended_start_ns=t0_ns + int(offset * 1e9),
                prompt_tokens=spec.prompt_tokens,
                request_class="a",
                session=f"s{i % 8}",
                replica="engine0",
                deadline_ms=30_000,
            )
            req = EngineRequest(rec.request_id, spec.prompt_tokens, spec.max_tokens, seed=i)
            tasks.append(asyncio.create_task(_one(engine, gate, rec, req, writer)))
        await asyncio.gather(*tasks)
    phases.end()


def make_run(
    out: Path,
    max_num_seqs: int = 64,
    profiles: dict[str, Spec] | None = None,
    stacks: dict[str, int | None] | None = None,
    seed: int = 7,
    complete: bool = True,
    repeats: int = 1,
) -> Path:
    """Write a results directory under ``out`` and return it; ``complete=False`` marks it cut;
    ``repeats`` trials of each profile on each stack (repeat k seeded ``seed + k``)."""
    profiles = PROFILES if profiles is None else profiles
    stacks = STACKS if stacks is None else stacks
    out.mkdir(parents=True, exist_ok=True)
    phases = PhaseLog(out / schema.PHASES)
    engines = EngineSource()
    sampler = Sampler(
        [NvmlSource(), engines, ProcessSource([Component("pytest", os.getpid(), "loader")])],
        out / schema.TELEMETRY,
        interval_s=0.05,
        phases=phases,
    )
    config = SimConfig(**ENGINE, max_num_seqs=max_num_seqs)

    async def main() -> None:
        for repeat in range(repeats):
            for stack, gate in stacks.items():
                for profile, spec in profiles.items():
                    await _trial(stack, gate, profile, spec, repeat)

    async def _trial(stack: str, gate: int | None, profile: str, spec: Spec, repeat: int) -> None:
        engine = SimEngine(config)
        target = EngineTarget.in_process("engine0", stack, engine)
        engines.add(target)
        try:
            await _drive(out, stack, profile, spec, engine, gate, phases, seed, repeat)
        finally:
            engines.targets = [t for t in engines.targets if t is not target]
            await engine.close()

    sampler.start()
    try:
        asyncio.run(main())
    finally:
        sampler.stop()
        phases.close()
    meta: dict[str, Any] = {
        "schema_version": schema.SCHEMA_VERSION,
        "run_id": out.name,
        "scale": "test",
        "engine": {"name": "sim", **config.as_dict()},
        "stacks": {s: {"impl": "in-process", "gate": g} for s, g in stacks.items()},
        "profiles": {p: {"rate": s.rate, "max_requests": s.count} for p, s in profiles.items()},
        "telemetry": sampler.describe(),
        "complete": complete,
    }
    (out / schema.RUN_META).write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
    if complete:
        _write_summary(out, stacks, profiles, repeats)
    return out


# The host as this in-process double reports it: one engine in the test's own process measures
# the engine, not a host, so every trial carries the same unsaturated host CPU and speed.
# This driver is no loader under test: it sleeps to each send time (no spin, unlike the native
# loader), and a few ms late on 20 ms requests is its timer on a busy test machine. Its lag counts
# only past the whole median E2EL, so that the rows' validity is the engine's, not the timer's.
DRIVER_LAG_FRACTION = 1.0
HOST_FIELDS: dict[str, Any] = {
    "host_cpu_pct": 50.0,
    "host_busiest_cpu_pct": 50.0,
    "host_speed": 1_000_000.0,
}


def _write_summary(
    out: Path, stacks: dict[str, int | None], profiles: dict[str, Spec], repeats: int = 1
) -> None:
    """summary.json: one row per trial (stack, profile, repeat), from the records written."""
    summary = []
    for repeat in range(repeats):
        for stack in stacks:
            for profile in profiles:
                name = schema.requests_file(stack, profile, repeat)
                recs = schema.read_requests(out / name)
                row = {"stack": stack, "profile": profile, "loader": "inproc", "repeat": repeat}
                stats = metrics.summarize(recs, lag_fraction=DRIVER_LAG_FRACTION)
                summary.append(row | {"records_file": name} | HOST_FIELDS | stats)
    (out / schema.SUMMARY).write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))


def fail_everything(run_dir: Path, code: str = "engine_down") -> Path:
    """Rewrite a run as an outage: every request ends in an error, summaries recomputed.

    This is what a run against a stack that is down produces: records, and no completions.
    """
    for path in run_dir.glob("requests-*.jsonl"):
        failed = []
        for rec in schema.read_requests(path):
            rec.outcome, rec.error_code, rec.http_status = "error", code, 503
            rec.first_token_ns, rec.chunk_ns, rec.output_tokens = 0, [], 0
            failed.append(orjson.dumps(rec))
        path.write_bytes(b"".join(line + b"\n" for line in failed))
    if (run_dir / schema.SUMMARY).exists():
        rows = []
        for row in schema.read_summary(run_dir):
            name = schema.requests_file(row.stack, row.profile, row.repeat)
            recs = schema.read_requests(run_dir / name)
            data = {"stack": row.stack, "profile": row.profile, "loader": row.loader,
                    "repeat": row.repeat, "records_file": name} | HOST_FIELDS  # fmt: skip
            stats = metrics.summarize(recs, lag_fraction=DRIVER_LAG_FRACTION)
            down = schema.from_data(schema.SummaryRow, data | stats)
            # nothing completed: the lag rule falls back to 1 ms absolute, this driver's timer
            down.loader_limited = False
            down.invalid_reasons = [r for r in down.invalid_reasons if not r.startswith("loader")]
            down.valid = not down.invalid_reasons
            rows.append(down)
        schema.write_summary(run_dir, rows)
    return run_dir
