"""``zl-bench chaos`` and profile D: chaos experiments on a running stack, recovery rows back.

Each experiment runs through chaostoolkit-lib's ``run_experiment`` in the main thread (Chaos
Toolkit installs signal handlers), with rollbacks set to run ``always``, on the very stack the
run stood up (its engine, engine options and replica count): the fault proxy is put in front of
its first replica (zero-layer) or its front door (baseline) without restarting anything, and a
killed zero-layer replica comes back on its port with its own command. Chaos settings come from
profile D's TOML at the run's scale. Per experiment, under ``RUN/chaos/``: the journal
(``<stack>-<name>.journal.json``), the background load's requests
(``requests-<stack>-d_fault-<name>.jsonl``), telemetry (processes and engines), phases and the
SDK's health view; and ``recovery-<stack>.json`` with every row of the recovery table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from baselines.rayserve_llm.standup import READY_PATH as LLM_READY_PATH
from chaos.actions import baseline_pids, wait_ready
from chaos.netproxy import NetProxy
from chaos.recovery import Recovery, compute_from_files
from chaos.targets import ReplicaSpec, Target, read_target, write_target
from harness.capacity import kv_tokens
from harness.errors import UsageError
from harness.profile import SCALES, ChaosSettings, Profile, load_profile
from harness.runner.sampling import phase
from harness.schema import CHAOS_DIR, requests_file, to_data
from harness.stacks import (
    LLM_BASELINE_IMPL,
    STACKS,
    VLLM_READY_TIMEOUT_S,
    Credentials,
    Stack,
    StackName,
    StackSpec,
    stand_up,
)
from harness.tables import Align, Column, fmt, text_table
from harness.telemetry import PhaseLog
from serving.engine import ENGINES
from serving.engine.options import add_engine_option, validate_engine_options

EXPERIMENT_DIR: Final = Path(__file__).parent / "experiments"
SETTINGS: Final = {"runtime": {"rollbacks": {"strategy": "always"}}}
PROFILE: Final = "d_fault"
# How long an engine may take to start again after its replica is killed, where longer than
# the scales' recovery bounds (the stand-up's own bound for it).
ENGINE_START_S: Final = {"vllm": VLLM_READY_TIMEOUT_S}


def experiment_paths(names: Sequence[str] | None = None) -> list[Path]:
    """Experiment files by path or by name in ``chaos/experiments/``; all of them by default."""
    if not names:
        return sorted(EXPERIMENT_DIR.glob("*.json"))
    out = []
    for name in names:
        path = Path(name)
        out.append(path if path.suffix == ".json" else EXPERIMENT_DIR / f"{name}.json")
    return out


def chaos_settings(profile: Profile) -> ChaosSettings:
    """The profile's chaos settings; a profile without them cannot drive chaos."""
    if profile.chaos is None:
        raise ValueError(f"profile {profile.name!r} has no [chaos] settings at {profile.scale}")
    return profile.chaos


def for_engine(settings: ChaosSettings, engine: str) -> ChaosSettings:
    """The scale's settings, with recovery bounded by no less than the engine takes to start:
    a killed replica over vLLM loads its engine again (30-60 s on two cores)."""
    start_s = ENGINE_START_S.get(engine)
    if start_s is None or settings.recover_timeout_s >= start_s:
        return settings
    return dataclasses.replace(settings, recover_timeout_s=start_s)


def kv_prompt_tokens(spec: StackSpec, settings: ChaosSettings) -> int:
    """Prompt tokens per KV-pressure request: ``kv_fill`` times one replica's KV cache over
    ``kv_requests`` requests, from the engine's own KV size (the same on both stacks), capped
    by the engine's context length; the profile's fixed figure when the KV size is unknown."""
    tokens = kv_tokens(spec.engine, spec.engine_options)
    if tokens is None:
        return settings.kv_prompt_tokens
    per_request = math.ceil(settings.kv_fill * tokens / settings.kv_requests)
    max_len = int(spec.engine_options.get("max_model_len", 131_072))
    return max(1, min(per_request, max_len) - settings.kv_max_tokens)


def configuration(
    stack: str,
    name: str,
    profile: Profile,
    target_file: Path,
    chaos_dir: Path,
    prompt_tokens: int,
) -> dict[str, Any]:
    """The Chaos Toolkit configuration one experiment runs with (see ``chaos.controls``)."""
    sc = chaos_settings(profile)
    prefix = f"{stack}-{name}"
    return {
        "target_file": str(target_file),
        "experiment_tag": name,
        "scale": profile.scale,
        "seed": profile.seed,
        "requests_path": str(chaos_dir / requests_file(stack, f"{PROFILE}-{name}")),
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
        "kv_prompt_tokens": prompt_tokens,
        "kv_max_tokens": sc.kv_max_tokens,
        "health_interval_s": sc.health_interval_s,
        "health_timeout_s": sc.health_timeout_s,
    }


def run_one(
    path: Path,
    stack: str,
    profile: Profile,
    target_file: Path,
    chaos_dir: Path,
    prompt_tokens: int | None = None,
) -> Recovery:
    """Run one experiment file against the stack in ``target_file``; write its journal."""
    from chaoslib.experiment import ensure_experiment_is_valid, run_experiment
    from chaoslib.loader import load_experiment

    name = path.stem
    sc = chaos_settings(profile)
    tokens = sc.kv_prompt_tokens if prompt_tokens is None else prompt_tokens
    conf = configuration(stack, name, profile, target_file, chaos_dir, tokens)
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


def _proxy_url(stack: Stack, proxy: NetProxy) -> str:
    """The proxy forwards bytes, so a TLS stack is reached through it over TLS too."""
    return proxy.url.replace("http://", "https://", 1) if stack.tls_ca else proxy.url


def _zerolayer_target(stack: Stack, proxy: NetProxy) -> Target:
    specs = [
        ReplicaSpec(r.url, r.pid, r.port, list(r.command), str(r.log_path)) for r in stack.replicas
    ]
    return Target(
        stack=stack.name,
        load_urls=[_proxy_url(stack, proxy), *stack.urls[1:]],
        protocol=stack.protocol,
        pids=stack.pids(),
        replicas=specs,
        netproxy=proxy.control,
        netproxy_front=stack.urls[0],
        netproxy_url=_proxy_url(stack, proxy),
        health_url=stack.urls[0],
        engine_replicas=len(stack.replicas),
        tls_ca=str(stack.tls_ca or ""),
        engine_metrics=[f"{url}/metrics" for url in stack.urls],
    )


def _baseline_target(stack: Stack, proxy: NetProxy) -> Target:
    app = "llm" if stack.metadata.get("impl") == LLM_BASELINE_IMPL else "orchestrator"
    return Target(
        stack=stack.name,
        load_urls=[_proxy_url(stack, proxy)],
        protocol=stack.protocol,
        pids=baseline_pids(app) if stack.baseline is not None else stack.pids(),
        baseline_app=app,
        health_path=LLM_READY_PATH if app == "llm" else "/health",
        netproxy=proxy.control,
        netproxy_front=stack.urls[0],
        netproxy_url=_proxy_url(stack, proxy),
        health_url=stack.urls[0],
        engine_replicas=stack.spec.replicas,
        engine_stats_files=[str(t.how) for t in stack.engine_targets()],
    )


def _with_credentials(target: Target, credentials: Credentials | None) -> Target:
    """The target carrying the stack's keys (``--auth``), so that the chaos load sends each
    tenant's key and the actions the default one (a killed replica comes back with its
    ``--api-keys`` through its saved command)."""
    if credentials is not None:
        target.api_keys = dict(credentials.keys)
        target.api_key_file = str(credentials.key_file)
    return target


def adopt_restarted(stack: Stack, target_file: Path) -> None:
    """Make replicas that chaos started again (new pids in the target file) the stack's own."""
    for spec in read_target(target_file).replicas:
        stack.replica_restarted(spec.url, spec.pid)


@contextlib.contextmanager
def fault_target(stack: Stack, chaos_dir: Path) -> Iterator[Path]:
    """The fault proxy in front of the running stack, and the target file experiments read.

    On exit the proxy closes and the stack adopts any replica chaos started again."""
    if stack.external:
        raise ValueError(f"chaos needs a stack this run started, not the external {stack.urls}")
    path = chaos_dir / f"target-{stack.name}.json"
    with NetProxy(stack.urls[0].split("://", 1)[1]) as proxy:  # entering starts it
        build = _zerolayer_target if stack.kind.client_routes else _baseline_target
        write_target(path, _with_credentials(build(stack, proxy), stack.credentials))
        try:
            yield path
        finally:
            adopt_restarted(stack, path)


def run_profile_d(
    stack: Stack, profile: Profile, run_dir: Path, phases: PhaseLog | None = None
) -> list[Recovery]:
    """Profile D: every chaos experiment, one after the other, on the given running stack.

    Chaos settings come from ``profile.chaos``; files go under ``run_dir/chaos/``; each
    experiment is a phase in ``phases`` when given. Returns the recovery rows (also written to
    ``recovery-<stack>.json``).
    """
    sc = for_engine(chaos_settings(profile), stack.spec.engine)
    profile = dataclasses.replace(profile, chaos=sc)
    chaos_dir = Path(run_dir) / CHAOS_DIR
    chaos_dir.mkdir(parents=True, exist_ok=True)
    tokens = kv_prompt_tokens(stack.spec, sc)
    rows = []
    name = f"{stack.name}/{profile.name}"
    tags = {"stack": stack.name.value, "profile": profile.name}
    with fault_target(stack, chaos_dir) as target_file:
        for path in experiment_paths():
            with phase(phases, name, **tags, experiment=path.stem):
                rows.append(run_one(path, stack.name, profile, target_file, chaos_dir, tokens))
                adopt_restarted(stack, target_file)
                wait_ready(sc.recover_timeout_s, {"target_file": str(target_file)})
    (chaos_dir / f"recovery-{stack.name}.json").write_text(json.dumps(to_data(rows), indent=2))
    return rows


def table(rows: Sequence[Recovery]) -> str:
    """The recovery table as aligned text."""
    head = ("stack", "experiment", "fault", "reqs", "failed", "lost", "TTD s", "TTR s",
            "SDK reroute s", "burn", "blast req", "blast repl", "hyp before/after",
            "rollbacks")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append((
            r.stack, r.experiment, r.fault, str(r.requests), str(r.failed), str(r.lost),
            fmt(r.time_to_detect_s, ".2f"), fmt(r.time_to_recover_s, ".2f"),
            fmt(r.sdk_reroute_s, ".2f"),
            fmt(r.error_budget_burn, ".1f"), fmt(r.blast_radius_requests, ".0%"),
            fmt(r.blast_radius_replicas, ".0%"), f"{r.hypothesis_before}/{r.hypothesis_after}",
            "ok" if r.rollbacks_ok else "FAILED",
        ))  # fmt: skip
    return text_table([Column(h, align=Align.LEFT) for h in head], lines[1:], gap=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench chaos``: stand a stack up, run every chaos experiment on it, print recovery."""
    parser.add_argument(
        "--stack", choices=STACKS, nargs="+", default=list(STACKS), help="stacks to run"
    )
    parser.add_argument("--engine", default="sim", choices=ENGINES, help="engine of every replica")
    add_engine_option(parser)
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas per stack")
    parser.add_argument("--scale", choices=SCALES, default="smoke", help="profile D's scale")
    parser.add_argument("--seed", type=int, default=None, help="schedule seed")
    parser.add_argument("--out", type=Path, default=Path("results/chaos"), help="results dir")
    parser.add_argument("--verbose", action="store_true", help="Chaos Toolkit's own log")


def _spec(name: str, args: argparse.Namespace) -> StackSpec:
    try:
        options = validate_engine_options(args.engine, dict(args.engine_options))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.replicas < 1:
        raise UsageError(f"--replicas must be at least 1, got {args.replicas}")
    return StackSpec(StackName(name), args.engine, options, args.replicas)


def run_command(args: argparse.Namespace) -> int:
    """Exit 0 when nothing was lost and every rollback succeeded, else 1."""
    logging.getLogger("chaostoolkit").setLevel(logging.INFO if args.verbose else logging.WARNING)
    specs = [_spec(name, args) for name in dict.fromkeys(args.stack)]
    profile = load_profile(PROFILE, args.scale, args.seed)
    rows: list[Recovery] = []
    for spec in specs:
        workdir = Path(args.out) / CHAOS_DIR / f"stack-{spec.name}"
        with stand_up(spec, workdir) as stack:
            rows += run_profile_d(stack, profile, Path(args.out))
    print(table(rows))
    lost = sum(r.lost for r in rows)
    return 1 if lost or not all(r.rollbacks_ok for r in rows) else 0
