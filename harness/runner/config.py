"""What a run is asked to do, and everything about it checked before anything is started.

A user's mistake (an unknown profile, a tokenizer that does not load, a stack that cannot be
served or an external one that does not answer) is a ``UsageError`` raised here, before the
results directory exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from baselines.rayserve.config import BaselineRouter
from harness.capacity import Capacity, preflight
from harness.datasets import describe_workload
from harness.errors import UsageError
from harness.loaders import needs_tls
from harness.metrics import Slo, override_slos
from harness.profile import DEFAULT_PROFILES, Profile, WorkloadChoice, load_profile
from harness.promptfit import class_fits, context_length, fit_profiles
from harness.runner.console import say
from harness.schema import to_data
from harness.stacks import (
    STACKS,
    Credentials,
    StackName,
    StackSpec,
    StackUnreachable,
    check_spec,
    stand_up,
)
from serving.cpus import CpuLayout, LayoutError, choose_layout
from serving.engine.kinds import engine_kind
from serving.engine.tokenrules import BYTES_RULE, TokenRule

# Verdicts need at least harness.validity.MIN_TRIALS paired trials: a plain run gives them.
DEFAULT_REPEATS: Final = 3


@dataclass(frozen=True)
class RunConfig:
    """What a run was asked to do; saved verbatim in run.json."""

    scale: str = "laptop"
    profiles: tuple[str, ...] = DEFAULT_PROFILES
    stacks: tuple[StackName, ...] = tuple(StackName(s) for s in STACKS)
    engine: str = "sim"
    engine_options: dict[str, Any] = field(default_factory=dict)
    replicas: int = 2
    loader: str = "native"
    out: str = "results"
    seed: int | None = None
    zerolayer_urls: tuple[str, ...] = ()
    baseline_url: str = ""
    ray_address: str | None = None
    baseline_router: BaselineRouter | None = None  # None: each baseline's own default
    baseline_stream_batching_ms: float | None = None  # None: Ray Serve LLM's own default
    telemetry_interval_s: float = 0.25
    slos: tuple[Slo, ...] = ()
    quiet: bool = False
    auth: bool = False
    workload: WorkloadChoice | None = None  # --workload: every profile's source replaced
    allow_mismatch: bool = False  # --allow-mismatch: stacks' engine settings may differ
    repeats: int | None = None  # --repeats; None: DEFAULT_REPEATS (a sweep: the profile's)
    slo_set: str | None = None  # --slo-set: a named set the report judges every trial against
    placement: str | None = None  # --placement: which nodes host what (with --ray-address)
    loader_workers: int | None = None  # --loader-workers: the loader as N Ray actors
    experiments: tuple[str, ...] = ()  # --experiments: profile D's (default: all that apply)
    cpu_layout: CpuLayout | None = None  # vLLM engines' cores and the rest's (serving.cpus)

    @property
    def trials(self) -> int:
        """Trials per stack and profile of a plain run."""
        return self.repeats if self.repeats is not None else DEFAULT_REPEATS

    def spec(self, name: StackName, credentials: Credentials | None = None) -> StackSpec:
        """The stack to stand up for ``name``: external when URLs were given for it; with
        ``credentials`` (``--auth``) started with their key file."""
        urls = self.zerolayer_urls if name is StackName.ZEROLAYER else ()
        if name is StackName.BASELINE and self.baseline_url:
            urls = (self.baseline_url,)
        return StackSpec(
            name=name,
            engine=self.engine,
            engine_options=self.engine_options,
            replicas=self.replicas,
            tls=needs_tls(self.loader, name),
            urls=tuple(urls),
            ray_address=self.ray_address,
            baseline_router=self.baseline_router,
            credentials=credentials,
            baseline_stream_batching_ms=self.baseline_stream_batching_ms,
            cpu_layout=None if urls else self.cpu_layout,
        )


def load_profiles(config: RunConfig) -> list[Profile]:
    """The profiles asked for, at the run's scale and seed, with the command line's SLOs over
    each profile's own, inside the engine's context where it is known
    (``harness.promptfit.fit_profiles``: a class whose output leaves no room refused, sessions
    cut to the turns that fit, each said in a line; none left is the user's mistake)."""
    try:
        profiles = [load_profile(name, config.scale, config.seed) for name in config.profiles]
        if config.workload is not None:
            profiles = [p.with_workload(config.workload) for p in profiles]
        profiles, lines = fit_profiles(profiles, context_length(config.engine_options))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for line in lines:
        say(line)
    return [p.with_slos(override_slos(p.slos, config.slos)) for p in profiles]


def fit_engine_to_model(config: RunConfig) -> RunConfig:
    """``config`` with its engine options fitted to the model they name (the engine kind's
    ``fit_to_model``: ``max_model_len`` the model's own unless given, capped to the KV cache),
    each thing read or adapted said once; a model the engine cannot serve is the user's
    mistake. Stacks already running keep their own settings: nothing is fitted when every
    stack is one."""
    if all(config.spec(name).urls for name in config.stacks):
        return config
    try:
        fit = engine_kind(config.engine).fit_to_model(config.engine_options)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for note in fit.notes:
        say(note)
    return dataclasses.replace(config, engine_options=fit.options)


def check_external(config: RunConfig) -> None:
    """Every stack's spec must be one it can serve (vllm-serve needs the vllm engine) and every
    external stack must answer, before anything is started or any load is sent."""
    if config.auth and (config.zerolayer_urls or config.baseline_url):
        raise UsageError("--auth starts the stacks with a fresh key file: not for running stacks")
    for name in config.stacks:
        spec = config.spec(name)
        try:
            check_spec(spec)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        if not spec.urls:
            continue
        try:
            stand_up(spec, Path(config.out)).close()
        except StackUnreachable as exc:
            raise UsageError(str(exc)) from exc


def capacity_preflight(profiles: Sequence[Profile], config: RunConfig) -> dict[str, Capacity]:
    """The capacity preflight per profile; external stacks' capacity is unknown."""
    external = bool(config.zerolayer_urls or config.baseline_url)
    return {
        p.name: preflight(p, config.engine, config.replicas, config.engine_options, external)
        for p in profiles
    }


def choose_token_rule(config: RunConfig, profiles: Sequence[Profile]) -> TokenRule:
    """The rule the run's engine counts prompts by (``EngineKind.token_rule``), checked
    before the run starts: a tokenizer that does not load, or a class whose output leaves its
    prompt no room in the engine's context, is the user's mistake. Under a tokenizer, says how
    each synthetic class's prompt is resized to keep its token count."""
    try:
        rule = engine_kind(config.engine).token_rule(config.engine_options)
        if rule is not BYTES_RULE:
            context = context_length(config.engine_options)
            fits = [fit for p in profiles for fit in class_fits(p, rule, context)]
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if rule is not BYTES_RULE:
        for fit in fits:
            say(fit.line())
    return rule


def workload_stats(profile: Profile, rule: TokenRule) -> dict[str, Any]:
    """run.json's ``workload_stats`` for a profile replaying a file: the file's own input and
    output length distribution under the run's rule, so the report can set the replayed
    requests' beside it (nothing for a generated workload)."""
    try:
        stats = describe_workload(profile, rule)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if stats is None:
        return {}
    return {
        "workload_stats": {
            "source": stats.source,
            "path": stats.path,
            "sha256": stats.sha256,
            "rule": stats.rule,
            "input": to_data(stats.input_tokens),
            "output": to_data(stats.output_tokens),
        }
    }


def cpu_layout(engine: str, replicas: int, given: str | None) -> CpuLayout | None:
    """The run's CPU layout: for an engine with compute threads of its own to place (vLLM), the
    ``--cpu-layout`` given or the split of the cores available, one core list per engine
    replica; None for the others (nothing of theirs is pinned). A layout that cannot be made is
    the user's mistake, said in one line."""
    if not engine_kind(engine).serves_vllm:
        if given:
            raise UsageError(f"--cpu-layout places vLLM's engines; the {engine} engine has none")
        return None
    try:
        return choose_layout(given, replicas)
    except LayoutError as exc:
        raise UsageError(str(exc)) from None
