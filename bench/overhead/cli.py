"""``zl-bench overhead``'s command line: its flags, the settings they resolve to (the engine's
defaults for what is not given), and the run that prints the report."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import uvloop

from bench.overhead.measure import (
    AUTHORIZE_CALLS,
    authorize_us,
    fixed_rates,
    fixed_source,
    measure,
    replica_rss,
)
from bench.overhead.model import DEFAULTS, ENGINES, Defaults, Level, Role, Settings, Workload
from bench.overhead.render import auth_costs, header, table, verdict, warnings, write_out
from bench.overhead.targets import TARGET_KINDS, TargetKind, choose_targets
from harness.errors import UsageError
from harness.outputs import output_dir
from harness.promptfit import context_length
from harness.runner.config import cpu_layout
from harness.runner.priority import loader_cores
from harness.workload import make_prompt
from serving.cpus import LAYOUT_HELP
from serving.engine import kinds
from serving.engine.options import add_engine_option, validate_engine_options


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--engine-option``s, checked against the engine's config and fitted to the model
    they name (each thing fitted said once)."""
    options = dict(args.engine_options)
    if kinds.engine_kind(args.engine).config_class is None:
        if options:
            raise UsageError(f"the {args.engine} engine takes no options, got {', '.join(options)}")
        return options
    try:
        fit = kinds.engine_kind(args.engine).fit_to_model(
            validate_engine_options(args.engine, options)
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for note in fit.notes:
        print(f"overhead: {note}", flush=True)
    return fit.options


def check_request_fits(workload: Workload) -> None:
    """The one request every target serves must fit the engine's context: its prompt, as the
    engine counts it, and its output within ``max_model_len``; UsageError otherwise (an output
    that leaves no room is refused before the engine or its tokenizer is needed)."""
    context = context_length(workload.engine_options)
    if context is None:
        return
    if workload.max_tokens >= context:
        raise UsageError(
            f"--max-tokens {workload.max_tokens} leaves no room for a prompt in max_model_len "
            f"{context}"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UsageError(f"--engine {workload.engine} needs vLLM installed (see nox -s vllm)")
    try:
        rule = workload.kind.token_rule(workload.engine_options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tokens = rule.count(make_prompt("ovh-0", workload.prompt_bytes))
    if tokens + workload.max_tokens > context:
        raise UsageError(
            f"--prompt-bytes {workload.prompt_bytes} is {tokens} tokens ({rule.name}); with "
            f"--max-tokens {workload.max_tokens} that passes max_model_len {context}"
        )


def resolve(args: argparse.Namespace) -> Settings:
    """The run's settings: what the command line gave, the engine's defaults for the rest."""
    d = DEFAULTS[args.engine]

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    out = None if args.out is None else output_dir(args.out)
    workload = Workload(
        given(args.prompt_bytes, d.prompt_bytes),
        given(args.max_tokens, d.max_tokens),
        args.engine,
        engine_options(args),
        cpu_layout(args.engine, 1, args.cpu_layout),
    )
    check_request_fits(workload)
    return Settings(
        workload=workload,
        targets=given(args.targets, d.targets),
        levels=tuple(given(args.levels, d.levels)),
        rate=args.rate,
        duration_s=given(args.duration, d.duration_s),
        warmup_s=given(args.warmup, d.warmup_s),
        burst=given(args.burst, d.burst),
        rss_streams=given(args.rss_streams, d.rss_streams),
        rss_max_tokens=args.rss_max_tokens,
        out=out,
        auth=args.auth,
        repeats=given(args.repeats, d.repeats),
    )


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,64, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"in-flight counts must be >= 1, got {text!r}")
    return levels


def _number(kind: type[float] | type[int], least: float) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` at least ``least``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        return value

    return parse


_positive = _number(float, 1e-9)
_count = _number(int, 1)


def _default_help(what: Callable[[Defaults], Any]) -> str:
    return "default: " + "; ".join(f"{what(d)} ({e})" for e, d in DEFAULTS.items())


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="null", help="engine behind all")
    add_engine_option(parser)
    parser.add_argument(
        "--cpu-layout",
        metavar="ENGINE/REST",
        help=LAYOUT_HELP + " (vllm only; one engine replica: every target's engine computes "
        "on the same cores)",
    )


def _add_schedule_flags(parser: argparse.ArgumentParser) -> None:
    """How long, how many in flight, at what rate, evenly or in bursts."""
    parser.add_argument(
        "--duration",
        type=_positive,
        help="seconds per level; " + _default_help(lambda d: d.duration_s),
    )
    parser.add_argument(
        "--warmup",
        type=_positive,
        help="warm-up seconds per level; " + _default_help(lambda d: d.warmup_s),
    )
    parser.add_argument(
        "--levels",
        type=_levels,
        help="in-flight levels; " + _default_help(lambda d: ",".join(map(str, d.levels))),
    )
    parser.add_argument(
        "--rate",
        type=_number(float, 0.0),
        default=0.0,
        help="req/s for every level (0: 50 at 1, 160 at 16, else 10 per slot, for null; for "
        "vllm a quarter of the in-process throughput measured at each level)",
    )
    parser.add_argument(
        "--repeats",
        type=_count,
        help="times every target is measured at every level, in a balanced order (A B C, "
        "C B A, ...): figures are intervals over the valid repeats; "
        + _default_help(lambda d: d.repeats),
    )
    parser.add_argument(
        "--burst",
        action=argparse.BooleanOptionalAction,
        help="send each level's requests in-flight at a time (so 16 in flight are 16 open "
        "streams, not a rate); " + _default_help(lambda d: d.burst),
    )


def _add_target_and_request_flags(parser: argparse.ArgumentParser) -> None:
    """Which targets, and the request each serves."""
    parser.add_argument(
        "--targets",
        help=f"built in: {','.join(TARGET_KINDS)}; " + _default_help(lambda d: d.targets),
    )
    parser.add_argument(
        "--target", action="append", default=[], help="plug-in NAME=module:function, repeatable"
    )
    parser.add_argument(
        "--prompt-bytes",
        type=_count,
        help="prompt size; " + _default_help(lambda d: d.prompt_bytes),
    )
    parser.add_argument(
        "--max-tokens", type=_count, help="output tokens; " + _default_help(lambda d: d.max_tokens)
    )


def _add_output_and_extra_flags(parser: argparse.ArgumentParser) -> None:
    """Where the report goes, and the measurements beside the tables (RSS, authentication)."""
    parser.add_argument(
        "--out", type=Path, help="write overhead.json, overhead.md and work/ (records, logs) here"
    )
    parser.add_argument(
        "--rss-streams",
        type=_number(int, 0),
        help="0 skips the RSS check; " + _default_help(lambda d: d.rss_streams),
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="also run each stack that checks API keys with authentication on (NAME+auth) and "
        "report what it costs per request",
    )
    parser.add_argument(
        "--rss-max-tokens",
        type=_count,
        default=1024,
        help="long enough to stay open, short enough that 1000 fit under the KV watermarks",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench overhead``'s options; those left unset take the engine's defaults."""
    _add_engine_flags(parser)
    _add_schedule_flags(parser)
    _add_target_and_request_flags(parser)
    _add_output_and_extra_flags(parser)


def _workdir(out: Path | None) -> contextlib.AbstractContextManager[str]:
    """Where records and stack logs go: kept under ``out/work`` when there is an ``out``."""
    if out is None:
        return tempfile.TemporaryDirectory(prefix="zl-overhead-")
    (out / "work").mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(out / "work"))


def _print_report(settings: Settings, levels: Sequence[Level]) -> None:
    """The tables, the notes, the verdict and authentication's cost."""
    max_tokens = settings.workload.max_tokens
    print()
    print(table(levels, max_tokens))
    over_reference = settings.workload.kind.is_reference
    for line in [*warnings(levels, max_tokens), *verdict(levels, over_reference),
                 *auth_costs(levels)]:  # fmt: skip
        print(line)


async def _print_replica_rss(settings: Settings) -> None:
    rss = await replica_rss(settings.rss_streams, settings.rss_max_tokens, hold_s=1.0)
    print()
    print(
        f"replica RSS (sim engine): idle {rss['rss_idle_mb']:.1f} MB; with "
        f"{rss['streams_open']} open streams {rss['rss_open_mb']:.1f} MB "
        f"({rss['rss_held_mb']:.1f} MB after 1 s held); refused {rss['streams_refused']}"
    )


async def main_async(settings: Settings, chosen: Sequence[TargetKind]) -> None:
    """Measure every chosen target, print the report, write it under ``--out``, then the RSS."""
    rates = fixed_rates(settings, any(kind.role is Role.FLOOR for kind in chosen))
    source = fixed_source(settings) if rates else "measured in-process first"
    print(header(settings, rates or {}, source), flush=True)
    layout = settings.workload.cpu_layout
    if layout is not None:
        print(f"cpu layout: {layout.text()}", flush=True)
    with _workdir(settings.out) as work, loader_cores(layout):
        levels, rates, source = await measure(settings, chosen, Path(work))
    if levels:
        _print_report(settings, levels)
    if settings.auth:
        print(f"authorize(): {authorize_us():.2f} us per request in-process ({AUTHORIZE_CALLS} "
              "calls: one SHA-256 of the key, one dict lookup)", flush=True)  # fmt: skip
    if settings.out is not None:
        write_out(settings.out, settings, levels, rates, source)
        print(f"wrote {settings.out / 'overhead.json'} and overhead.md", flush=True)
    if settings.rss_streams:
        await _print_replica_rss(settings)


def run_command(args: argparse.Namespace) -> int:
    """Run the benchmark and print its tables; mistakes in the arguments are UsageErrors."""
    settings = resolve(args)
    chosen = choose_targets(settings, args.target)
    uvloop.run(main_async(settings, chosen))
    return 0
