"""``zl-bench fidelity --against vllm``: the sim checked end to end against vLLM's real scheduler.

The same seeded schedules of profiles A and C (at ``--scale``, optionally cut to their first
``--max-requests``) run open-loop through the native loader against two zero-layer replicas:
one serving the real vLLM (the tiny model on the CPU build), then one serving the sim loaded with
that vLLM's calibrated step times and the same limits: ``max_num_seqs``,
``max_num_batched_tokens``, ``block_size``, ``max_model_len``, and KV blocks as the vLLM replica
reports its real ``num_gpu_blocks``. TTFT, ITL and E2EL at p50/p90/p99 are set side by side with
each cell's error relative to vLLM; the command exits 1 when any cell is off by more than
``--tolerance`` (15 %), 0 when all are within. The table goes to ``fidelity.json`` and
``fidelity.md`` in ``--out``.

Calibration: ``--calibration P`` uses a profile ``zl-bench calibrate --engine vllm`` wrote. Without
one, the same measurement (``bench.calibrate_vllm.measure``) runs first, by default
through the vLLM replica itself (``--calibrate served``): on two shared cores the replica's front
end, the loader and vLLM's engine core take turns on the CPUs, and a decode step as served took
about 4 ms where ``vllm.LLM`` alone took about 2 ms, so an offline calibration makes the sim
about twice too fast. ``--calibrate offline`` times ``vllm.LLM`` alone, as ``calibrate`` does.

Token counts: profiles size prompts in bytes at four bytes a token, but the tiny model's BPE
tokenizer makes about 1.3 bytes a token. So each class's prompt is rescaled to give the profile's
token count under that tokenizer (``harness.promptfit.fit_classes``, as ``zl-bench run`` does;
clamped where prompt plus output would pass ``max_model_len``: profile C's large class at larger
scales), each vLLM prompt is counted with the model's tokenizer (``EngineKind.token_rule``),
and the sim gets a prompt of exactly that many tokens by its own four-bytes rule. With
``--engine-option skip_tokenizer_init=true`` both sides count four bytes a token instead.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import platform
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final

import uvloop

from bench.calibrate import CALIBRATORS, Grid, fit_grid, vllm_profile_name, write_profile
from bench.calibrate_vllm import EngineLimits, ModelFigures, StepTimes, measure
from bench.fidelity_cells import Cell, compare, table_markdown, verdict
from harness.errors import UsageError
from harness.loaders import LOADERS
from harness.outputs import output_dir
from harness.profile import PROFILES, Profile, load_profile, resolve_name
from harness.promptfit import ClassFit, apply_fits, class_fits, fit_profiles
from harness.stacks import StackName, StackSpec, stand_up
from harness.workload import PlannedRequest, build_schedule
from serving.engine import engine_kind
from serving.engine.tokenrules import TokenRule
from serving.wire.tokens import BYTES_PER_TOKEN

if TYPE_CHECKING:
    from harness.stacks import Stack

TOLERANCE: Final = 0.15
DEFAULT_PROFILES: Final = ("a_latency", "c_mixed")
# Engine settings for the vLLM side unless --engine-option says otherwise: CPU vLLM's block
# size, greedy sampling (the CPU build's seeded sampler fails on chunked prefills);
# ``max_model_len`` is the model's own (``EngineKind.fit_to_model``).
VLLM_DEFAULTS: Final[Mapping[str, Any]] = {
    "block_size": 128,
    "temperature": 0.0,
}
METRICS_TIMEOUT_S: Final = 5.0


# -- the sim's side of the load (pure) ----------------------------------------------------------


def sim_requests(requests: Sequence[PlannedRequest], counts: Sequence[int]) -> list[PlannedRequest]:
    """The same requests with synthetic prompts the sim counts (four bytes a token) as
    ``counts`` tokens."""
    return [
        dataclasses.replace(r, prompt_bytes=n * BYTES_PER_TOKEN, text="", tokens=0)
        for r, n in zip(requests, counts, strict=True)
    ]


# -- the run ----------------------------------------------------------------------------------


class Calibrate(StrEnum):
    """Where the step times come from when no ``--calibration`` file is given."""

    SERVED = "served"  # through the running vLLM replica
    OFFLINE = "offline"  # vllm.LLM alone, as ``zl-bench calibrate --engine vllm``


class Side(StrEnum):
    """The two replicas compared."""

    VLLM = "vllm"
    SIM = "sim"


@dataclass(frozen=True)
class Settings:
    """What ``zl-bench fidelity --against vllm`` was asked to do."""

    model: Path
    profiles: tuple[str, ...]
    scale: str
    out: Path
    calibration: Path | None
    max_requests: int | None
    tolerance: float
    calibrate: Calibrate
    engine_options: Mapping[str, Any]  # the vLLM side's, checked, defaults and model included
    fitted: tuple[str, ...] = ()  # what was read of the model and fitted to it, a line each


def sim_options(limits: EngineLimits, profile_path: Path, model_shape: str) -> dict[str, Any]:
    """The sim replica's engine options: the calibrated step times and the vLLM's own limits."""
    return {
        "profile_path": str(profile_path),
        "model_shape": model_shape,
        "max_num_seqs": limits.max_num_seqs,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "block_size": limits.block_size,
        "max_model_len": limits.max_model_len,
        "num_kv_blocks": limits.num_gpu_blocks,
    }


@dataclass(frozen=True)
class Planned:
    """One profile's load as each side gets it."""

    profile: Profile
    vllm: list[PlannedRequest]
    sim: list[PlannedRequest]
    fits: list[ClassFit]


def _say(text: str) -> None:
    print(f"fidelity: {text}", flush=True)


def plan(settings: Settings, rule: TokenRule, max_model_len: int) -> list[Planned]:
    """Each profile's schedule, resized for the vLLM replica's token rule, for both sides."""
    planned = []
    profiles, lines = fit_profiles(
        [load_profile(name, settings.scale) for name in settings.profiles], max_model_len
    )
    for line in lines:
        _say(line)
    for profile in profiles:
        name = profile.name
        fits = class_fits(profile, rule, max_model_len)
        fitted = apply_fits(profile, fits)
        requests = list(build_schedule(fitted, rule=rule))[: settings.max_requests]
        counts = [rule.count(r.prompt()) for r in requests]
        too_long = [
            r.request_id
            for r, n in zip(requests, counts, strict=True)
            if n + r.max_tokens > max_model_len
        ]
        if too_long:
            raise ValueError(f"{name}: prompts still too long for max_model_len: {too_long[:3]}")
        planned.append(Planned(fitted, requests, sim_requests(requests, counts), fits))
    return planned


def _offline_calibration(settings: Settings) -> Path:
    """``zl-bench calibrate --engine vllm``'s measurement (vllm.LLM alone), into ``--out``."""
    from bench.calibrate_vllm import calibrate_vllm
    from serving.engine.vllm_engine import VllmEngineConfig

    path = settings.out / "calibration.json"
    _say(f"calibrating vLLM offline (vllm.LLM) into {path}")
    config = VllmEngineConfig(**settings.engine_options)
    entry, meta = calibrate_vllm(config, _grid(config.max_model_len))
    write_profile(path, vllm_profile_name(str(settings.model)), entry, meta)
    return path


def _model_in(path: Path, preferred: str) -> str:
    """The model to use from a calibration file: ``preferred``, else its only model."""
    try:
        models = json.loads(path.read_text()).get("models", {})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--calibration {path} is not a profile: {exc}") from None
    if preferred in models:
        return preferred
    if len(models) == 1:
        return str(next(iter(models)))
    raise UsageError(f"--calibration {path} has no model {preferred!r} (has: {', '.join(models)})")


def _file_limits(profile_path: Path) -> EngineLimits:
    """The limits a vLLM calibration recorded (``calibration.limits``)."""
    limits = json.loads(profile_path.read_text()).get("calibration", {}).get("limits")
    if not limits:
        raise UsageError(
            f"--calibration {profile_path} has no vLLM limits; write it with "
            "zl-bench calibrate --engine vllm"
        )
    return EngineLimits(**limits)


def option_limits(options: Mapping[str, Any], num_gpu_blocks: int = 0) -> EngineLimits:
    """The limits the vLLM replica is started with (its engine options)."""
    from serving.engine.vllm_engine import VllmEngineConfig

    config = VllmEngineConfig(**options)
    if config.block_size is None or config.max_model_len is None:
        raise UsageError("the vLLM side needs block_size and max_model_len set")
    return EngineLimits(
        num_gpu_blocks=num_gpu_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
    )


def replica_kv_blocks(url: str) -> int:
    """KV blocks the replica's engine has (``zl_kv_blocks_total`` on its ``/metrics``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=METRICS_TIMEOUT_S) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("zl_kv_blocks_total "):
            return int(float(line.split()[1]))
    raise RuntimeError(f"{url}/metrics reports no zl_kv_blocks_total")


class _PromptMaker:
    """Fresh prompts of ``length`` of the model's tokens, never more (a grid's longest prefill
    is the engine's whole context): each the rule's seeded text for a new seed, so no two share
    a block vLLM's prefix cache could reuse; where the tokenizer's merges make one a token or
    two long, asked again that much shorter."""

    TRIES: Final = 4

    def __init__(self, rule: TokenRule) -> None:
        self._rule = rule
        self._seeds = itertools.count(1)

    def __call__(self, length: int) -> str:
        seed, want = next(self._seeds), length
        for _ in range(self.TRIES):
            text = self._rule.text(want, seed)
            over = self._rule.count(text) - length
            if over <= 0:
                break
            want = max(1, want - over)
        return text


async def _served_times(stack: Stack, grid: Grid, prompt: _PromptMaker) -> StepTimes:
    """The grid timed through the replica: batches of streams sent together by the SDK."""
    loop = asyncio.get_running_loop()
    async with stack.open_client() as client:

        async def batch(count: int, length: int, tokens: int) -> float:
            prompts = [prompt(length) for _ in range(count)]
            started = time.perf_counter()
            await asyncio.gather(*(client.complete(prompt=p, max_tokens=tokens) for p in prompts))
            return time.perf_counter() - started

        def run(count: int, length: int, tokens: int) -> float:
            return asyncio.run_coroutine_threadsafe(batch(count, length, tokens), loop).result()

        return await asyncio.to_thread(measure, run, grid)


def _grid(max_model_len: int | None) -> Grid:
    """``calibrate --engine vllm``'s default grid fitted to the engine's context, said; a
    context too short for any grid is the user's mistake."""
    try:
        grid, lines = fit_grid(CALIBRATORS["vllm"].grid, max_model_len)
    except ValueError as exc:
        raise UsageError(f"the calibration grid: {exc}") from None
    for line in lines:
        _say(f"calibration grid: {line}")
    return grid


def model_figures(model: Path, options: Mapping[str, Any]) -> ModelFigures:
    """Parameters and KV bytes from the model's ``config.json`` at the engine's dtype."""
    from serving.engine.vllm_engine import VllmEngineConfig, vllm_cpu_build

    config = json.loads((model / "config.json").read_text())
    dtype = VllmEngineConfig(**options).engine_args(vllm_cpu_build()).get("dtype")
    dtype_bytes = 2 if dtype in ("bfloat16", "float16", "half") else 4
    return ModelFigures.of(SimpleNamespace(**config), dtype_bytes)


def served_calibration(
    settings: Settings, stack: Stack, limits: EngineLimits, rule: TokenRule, grid: Grid
) -> Path:
    """Calibrate through the running vLLM replica (same method, the serving stack around it) and
    write the profile into ``--out``; see the module docstring for why."""
    _say("calibrating through the vLLM replica (step times as served on this machine)")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        times = runner.run(_served_times(stack, grid, _PromptMaker(rule)))
    meta = {
        "device": platform.processor() or platform.machine() or "cpu",
        "calibration": {
            "engine": "vllm",
            "engine_args": {k: v for k, v in settings.engine_options.items() if k != "model"},
            "limits": dataclasses.asdict(limits),
            "statistic": f"median of {grid.repeats} after {grid.warmup} warmup",
            "method": "served: batches sent through a zero-layer vLLM replica; decode "
            "(k+1 tokens - 1 token) / k at mean context C; prefill: one request's first token",
        },
    }
    path = settings.out / "calibration.json"
    write_profile(
        path,
        vllm_profile_name(str(settings.model)),
        model_figures(settings.model, settings.engine_options).entry(times),
        meta,
    )
    return path


def _run_profiles(
    side: Side, stack: Stack, planned: Sequence[Planned], out: Path, workdir: Path
) -> dict[str, dict[str, Any]]:
    """Every profile's schedule through the native loader; the summaries by profile name."""
    summaries = {}
    for item in planned:
        requests = item.vllm if side is Side.VLLM else item.sim
        _say(f"{side}: {item.profile.name}, {len(requests)} requests")
        result = LOADERS["native"].run(
            requests, stack, item.profile, out / f"{item.profile.name}-{side}.jsonl", workdir
        )
        summary = result.summary
        summary["host_load_1m"] = os.getloadavg()[0]
        _say(
            f"{side}: {item.profile.name} completed {summary['completed']}/"
            f"{summary['num_requests']} valid={summary['valid']} "
            f"host load {summary['host_load_1m']:.1f}"
        )
        summaries[item.profile.name] = summary
    return summaries


def _stack(side: Side, spec: StackSpec, out: Path) -> tuple[Stack, Path]:
    _say(f"starting the {side} replica ({spec.engine} engine)")
    workdir = out / f"stack-{side}"
    workdir.mkdir(parents=True, exist_ok=True)
    return stand_up(spec, workdir), workdir


def _planned(settings: Settings, max_model_len: int) -> tuple[TokenRule, list[Planned]]:
    """The rule vLLM counts prompts by and the profiles planned under it, checked before any
    replica starts; says how each synthetic class's prompt was resized for it."""
    try:
        rule = engine_kind("vllm").token_rule(settings.engine_options)
        planned = plan(settings, rule, max_model_len)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for item in planned:
        for fit in item.fits:
            _say(fit.line())
    return rule, planned


def run_fidelity(settings: Settings) -> int:
    """Calibrate if needed, run both sides, print and write the table; 0 within, 1 outside."""
    options = settings.engine_options
    for line in settings.fitted:
        _say(line)
    settings.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    profile_path = settings.calibration
    if profile_path is None and settings.calibrate is Calibrate.OFFLINE:
        profile_path = _offline_calibration(settings)
    name = vllm_profile_name(str(settings.model))
    if profile_path is not None:
        name = _model_in(profile_path, name)
        limits = _file_limits(profile_path)
    else:
        limits = option_limits(options)
    rule, planned = _planned(settings, limits.max_model_len)
    grid = _grid(limits.max_model_len) if profile_path is None else CALIBRATORS["vllm"].grid
    spec = StackSpec(StackName.ZEROLAYER, engine="vllm", engine_options=options, replicas=1)
    stack, workdir = _stack(Side.VLLM, spec, settings.out)
    with stack:
        limits = dataclasses.replace(limits, num_gpu_blocks=replica_kv_blocks(stack.urls[0]))
        if profile_path is None:
            profile_path = served_calibration(settings, stack, limits, rule, grid)
        vllm_summaries = _run_profiles(Side.VLLM, stack, planned, settings.out, workdir)
    spec = StackSpec(
        StackName.ZEROLAYER,
        engine="sim",
        engine_options=sim_options(limits, profile_path, name),
        replicas=1,
    )
    stack, workdir = _stack(Side.SIM, spec, settings.out)
    with stack:
        sim_summaries = _run_profiles(Side.SIM, stack, planned, settings.out, workdir)
    cells = [
        cell
        for item in planned
        for cell in compare(
            item.profile.name, vllm_summaries[item.profile.name], sim_summaries[item.profile.name]
        )
    ]
    ok = verdict(cells, settings.tolerance)
    table = table_markdown(cells, settings.tolerance)
    notes = [fit.line() for item in planned for fit in item.fits]
    notes.append(f"calibration: {profile_path} ({_method(profile_path)})")
    notes.append(f"sim limits: {dataclasses.asdict(limits)} (KV blocks as vLLM reports them)")
    notes.append(host_load_note(vllm_summaries, sim_summaries, os.cpu_count() or 1))
    _write(settings, cells, table, notes, profile_path, vllm_summaries, sim_summaries)
    print(table, end="")
    for note in notes:
        print(note)
    print(
        f"fidelity: {'OK' if ok else 'OUT OF TOLERANCE'} (each cell within "
        f"{settings.tolerance * 100:.0f} %), {time.monotonic() - started:.0f} s; "
        f"table in {settings.out}"
    )
    return 0 if ok else 1


def host_load_note(
    vllm_summaries: Mapping[str, Mapping[str, Any]],
    sim_summaries: Mapping[str, Mapping[str, Any]],
    cores: int,
) -> str:
    """The host's 1-minute load after each run: above the core count, other work shared the
    CPUs with the real engine, and its timings are not its own."""
    loads = {
        f"{side} {name}": float(summary["host_load_1m"])
        for side, summaries in ((Side.VLLM, vllm_summaries), (Side.SIM, sim_summaries))
        for name, summary in summaries.items()
    }
    text = ", ".join(f"{k} {v:.1f}" for k, v in loads.items())
    busy = max(loads.values(), default=0.0) > cores
    verdict = "BUSY: other work shared the CPUs" if busy else "not oversubscribed"
    return f"host load (1-min average) after each run on {cores} cores: {text} ({verdict})"


def _method(profile_path: Path) -> str:
    calibration = json.loads(profile_path.read_text()).get("calibration", {})
    return str(calibration.get("method", "unknown method"))


def _write(
    settings: Settings,
    cells: Sequence[Cell],
    table: str,
    notes: Sequence[str],
    profile_path: Path,
    vllm_summaries: Mapping[str, Mapping[str, Any]],
    sim_summaries: Mapping[str, Mapping[str, Any]],
) -> None:
    def validity(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        return {
            k: {"valid": s["valid"], "reasons": s["invalid_reasons"]} for k, s in summaries.items()
        }

    doc = {
        "model": str(settings.model),
        "scale": settings.scale,
        "max_requests": settings.max_requests,
        "tolerance": settings.tolerance,
        "calibration": str(profile_path),
        "within": verdict(cells, settings.tolerance),
        "cells": [c.as_dict(settings.tolerance) for c in cells],
        "notes": list(notes),
        "loader_validity": {"vllm": validity(vllm_summaries), "sim": validity(sim_summaries)},
    }
    (settings.out / "fidelity.json").write_text(json.dumps(doc, indent=2) + "\n")
    (settings.out / "fidelity.md").write_text(
        table + "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    )


# -- the command line ---------------------------------------------------------------------------


def _profiles(text: str) -> tuple[str, ...]:
    try:
        return tuple(dict.fromkeys(resolve_name(p) for p in text.split(",") if p.strip()))
    except ValueError as exc:
        raise UsageError(f"--profiles: {exc}") from None


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Check ``--against vllm``'s arguments; UsageError (exit 2, one line) for a mistake."""
    model = dict(args.engine_options).get("model")
    if not model:
        raise UsageError(
            "--against vllm needs --engine-option model=DIR (zl-bench tiny-model writes one)"
        )
    profiles = _profiles(args.profiles)
    if not profiles:
        raise UsageError(f"--profiles: name at least one of {', '.join(PROFILES)}")
    if not 0 < args.tolerance < 1:
        raise UsageError(f"--tolerance must be between 0 and 1, got {args.tolerance}")
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise UsageError(f"--calibration {args.calibration} is not a file")
    from serving.engine.options import validate_engine_options

    try:
        options = validate_engine_options(
            "vllm", {**VLLM_DEFAULTS, **dict(args.engine_options), "model": str(model)}
        )
    except ValueError as exc:
        raise UsageError(f"--engine-option: {exc}") from None
    try:
        fit = engine_kind("vllm").fit_to_model(options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out = output_dir(
        Path(args.out)
        if args.out
        else Path("results") / time.strftime("fidelity-vllm-%Y%m%d-%H%M%S")
    )
    return Settings(
        model=Path(model),
        profiles=profiles,
        scale=args.scale,
        out=out,
        calibration=None if args.calibration is None else Path(args.calibration),
        max_requests=args.max_requests,
        tolerance=args.tolerance,
        calibrate=Calibrate(args.calibrate),
        engine_options=fit.options,
        fitted=fit.notes,
    )


def run_command(args: argparse.Namespace) -> int:
    """``zl-bench fidelity --against vllm``: settings checked, vLLM present, then the run."""
    settings = settings_from_args(args)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("vllm is not installed (the CPU build installs with: nox -s vllm)")
    return run_fidelity(settings)
