"""``python -m chaos.runner``: stand a stack up, run chaos experiments on it, print recovery.

    python -m chaos.runner --stack zerolayer|baseline [--experiments FILE ...]
                           [--scale smoke|laptop] [--out DIR]

Each experiment runs through chaostoolkit-lib's ``run_experiment`` in the main thread (Chaos
Toolkit installs signal handlers), with rollbacks set to run ``always``. Per experiment, under
``DIR/chaos/``: the journal (``<stack>-<name>.journal.json``), the background load's requests
(``requests-<stack>-d_fault-<name>.jsonl``), telemetry, phases and the SDK's health view; and
``recovery-<stack>.json`` with every row of the recovery table, which is also printed.
The bench's profile D calls :func:`run_profile_d`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from chaos.actions import wait_ready
from chaos.recovery import Recovery, compute_from_files
from chaos.stacks import baseline_stack, zerolayer_stack
from chaos.targets import read_target
from harness.profile import load_profile
from harness.schema import CHAOS_DIR, requests_file

EXPERIMENT_DIR: Final = Path(__file__).parent / "experiments"
STACKS: Final = ("zerolayer", "baseline")
CHAOS_SCALES: Final = ("smoke", "laptop")
SETTINGS: Final = {"runtime": {"rollbacks": {"strategy": "always"}}}
ENGINE: Final = "sim"
REPLICAS: Final = 2


@dataclass(frozen=True)
class ChaosScale:
    """How long and how hard a chaos run is at one scale (load rate comes from profile D)."""

    warmup_s: float
    tail_s: float
    settle_s: float
    window_s: float
    slo_ttft_ms: float
    sli_target: float
    deadline_ms: int
    recover_timeout_s: float
    pause_s: float
    kv_hold_s: float
    kv_requests: int
    load_max_s: float
    num_kv_blocks: int
    health_interval_s: float = 1.0
    health_timeout_s: float = 0.5


SCALES: Final = {
    "smoke": ChaosScale(
        warmup_s=2.0, tail_s=1.0, settle_s=2.0, window_s=2.0, slo_ttft_ms=1000.0,
        sli_target=0.9, deadline_ms=10_000, recover_timeout_s=15.0, pause_s=5.0,
        kv_hold_s=4.0, kv_requests=24, load_max_s=90.0, num_kv_blocks=2048,
    ),
    "laptop": ChaosScale(
        warmup_s=5.0, tail_s=3.0, settle_s=5.0, window_s=5.0, slo_ttft_ms=1000.0,
        sli_target=0.95, deadline_ms=30_000, recover_timeout_s=40.0, pause_s=5.0,
        kv_hold_s=10.0, kv_requests=48, load_max_s=240.0, num_kv_blocks=4096,
    ),
}  # fmt: skip


def experiment_paths(names: Sequence[str] | None = None) -> list[Path]:
    """Experiment files by path or by name in ``chaos/experiments/``; all of them by default."""
    if not names:
        return sorted(EXPERIMENT_DIR.glob("*.json"))
    out = []
    for name in names:
        path = Path(name)
        out.append(path if path.suffix == ".json" else EXPERIMENT_DIR / f"{name}.json")
    return out


def configuration(
    stack: str, name: str, scale: str, target_file: Path, chaos_dir: Path, sc: ChaosScale
) -> dict[str, Any]:
    """The Chaos Toolkit configuration one experiment runs with (see ``chaos.controls``)."""
    profile = load_profile("d_fault", scale)
    prefix = f"{stack}-{name}"
    return {
        "target_file": str(target_file),
        "experiment_tag": name,
        "scale": scale,
        "requests_path": str(chaos_dir / requests_file(stack, f"d_fault-{name}")),
        "telemetry_path": str(chaos_dir / f"telemetry-{prefix}.jsonl"),
        "phases_path": str(chaos_dir / f"phases-{prefix}.jsonl"),
        "sdk_health_path": str(chaos_dir / f"sdk-health-{prefix}.jsonl"),
        "load_rate": profile.rate,
        "load_deadline_ms": sc.deadline_ms,
        "load_max_s": sc.load_max_s,
        "warmup_s": sc.warmup_s,
        "tail_s": sc.tail_s,
        "settle_s": sc.settle_s,
        "sli_window_s": sc.window_s,
        "slo_ttft_ms": sc.slo_ttft_ms,
        "sli_target": sc.sli_target,
        "recover_timeout_s": sc.recover_timeout_s,
        "pause_s": sc.pause_s,
        "kv_hold_s": sc.kv_hold_s,
        "kv_requests": sc.kv_requests,
        "health_interval_s": sc.health_interval_s,
        "health_timeout_s": sc.health_timeout_s,
    }


def run_one(
    path: Path,
    stack: str,
    scale: str,
    target_file: Path,
    chaos_dir: Path,
    sc: ChaosScale | None = None,
) -> Recovery:
    """Run one experiment file against the stack in ``target_file``; write its journal.

    ``sc`` overrides the scale's settings (SLO, health interval...)."""
    from chaoslib.experiment import ensure_experiment_is_valid, run_experiment
    from chaoslib.loader import load_experiment

    name = path.stem
    sc = sc or SCALES[scale]
    conf = configuration(stack, name, scale, target_file, chaos_dir, sc)
    for key in ("requests_path", "telemetry_path", "phases_path", "sdk_health_path"):
        Path(conf[key]).unlink(missing_ok=True)
    experiment = load_experiment(str(path), settings=SETTINGS)
    experiment["configuration"] = {**experiment.get("configuration", {}), **conf}
    ensure_experiment_is_valid(experiment)
    journal = run_experiment(experiment, settings=SETTINGS)
    journal_path = chaos_dir / f"{stack}-{name}.journal.json"
    journal_path.write_text(json.dumps(journal, indent=2, default=str))
    return compute_from_files(
        conf["requests_path"],
        journal,
        read_target(target_file),
        experiment=name,
        slo_ttft_ms=sc.slo_ttft_ms,
        window_s=sc.window_s,
        sli_target=sc.sli_target,
        sdk_health_path=conf["sdk_health_path"],
    )


def run_on_target(
    target_file: Path,
    paths: Sequence[Path],
    scale: str,
    out_dir: Path,
    sc: ChaosScale | None = None,
) -> list[Recovery]:
    """Every experiment in turn on a stack already up; the stack is whole again between them."""
    stack = read_target(target_file).stack
    chaos_dir = Path(out_dir) / CHAOS_DIR
    chaos_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in paths:
        rows.append(run_one(path, stack, scale, target_file, chaos_dir, sc))
        wait_ready(SCALES[scale].recover_timeout_s, {"target_file": str(target_file)})
    (chaos_dir / f"recovery-{stack}.json").write_text(
        json.dumps([r.to_dict() for r in rows], indent=2)
    )
    return rows


def engine_options(scale: str) -> dict[str, Any]:
    """A KV cache small enough that KV pressure fills it in seconds at this scale."""
    return {"num_kv_blocks": SCALES[scale].num_kv_blocks}


def run_profile_d(
    stack: str,
    out_dir: str | Path,
    scale: str = "smoke",
    experiments: Sequence[str] | None = None,
    baseline_handle: Any = None,
    **overrides: Any,
) -> list[Recovery]:
    """Profile D for the bench: every chaos experiment on one stack, recovery rows back.

    Stands the stack up (a zero-layer stack always; the baseline unless ``baseline_handle``, a
    running ``BaselineHandle``, is given: then it is reused and left running) and writes
    everything under ``out_dir/chaos/``. ``overrides`` replace fields of the scale's
    :class:`ChaosScale` (for example ``slo_ttft_ms=250``, ``health_interval_s=0.5``).
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    if scale not in SCALES:
        raise ValueError(f"chaos runs at {CHAOS_SCALES}, not {scale!r}")
    out = Path(out_dir)
    sc = dataclasses.replace(SCALES[scale], **overrides)
    paths = experiment_paths(experiments)
    run_dir = out / CHAOS_DIR / f"stack-{stack}"
    options = {**engine_options(scale), "num_kv_blocks": sc.num_kv_blocks}
    if stack == "zerolayer":
        with zerolayer_stack(run_dir, REPLICAS, ENGINE, options) as target:
            return run_on_target(target, paths, scale, out, sc)
    with baseline_stack(run_dir, baseline_handle, REPLICAS, ENGINE, options) as target:
        return run_on_target(target, paths, scale, out, sc)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[Recovery]) -> str:
    """The recovery table as aligned text."""
    head = ("stack", "experiment", "fault", "reqs", "failed", "lost", "TTD s", "TTR s",
            "SDK reroute s", "burn", "blast req", "blast repl", "hyp before/after",
            "rollbacks")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append((
            r.stack, r.experiment, r.fault, str(r.requests), str(r.failed), str(r.lost),
            _fmt(r.time_to_detect_s), _fmt(r.time_to_recover_s), _fmt(r.sdk_reroute_s),
            _fmt(r.error_budget_burn, ".1f"), _fmt(r.blast_radius_requests, ".0%"),
            _fmt(r.blast_radius_replicas, ".0%"), f"{r.hypothesis_before}/{r.hypothesis_after}",
            "ok" if r.rollbacks_ok else "FAILED",
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chaos.runner", description=__doc__)
    parser.add_argument("--stack", choices=STACKS, required=True)
    parser.add_argument("--experiments", nargs="*", help="files or names (default: all)")
    parser.add_argument("--scale", choices=CHAOS_SCALES, default="smoke")
    parser.add_argument("--out", default="results/chaos", help="results directory")
    parser.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO of the SLI (ms)")
    parser.add_argument("--health-interval-s", type=float, help="zero-layer SDK health poll")
    parser.add_argument("--health-timeout-s", type=float, help="zero-layer SDK health timeout")
    parser.add_argument("--verbose", action="store_true", help="Chaos Toolkit's own log")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.getLogger("chaostoolkit").setLevel(logging.INFO if args.verbose else logging.WARNING)
    names = ("slo_ttft_ms", "health_interval_s", "health_timeout_s")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    rows = run_profile_d(args.stack, args.out, args.scale, args.experiments, **overrides)
    print(table(rows))
    lost = sum(r.lost for r in rows)
    return 1 if lost or not all(r.rollbacks_ok for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
