"""The command-line options that stand the stacks up and drive them, shared by ``zl-bench run``
and ``zl-bench sweep``, and the RunConfig they make."""

from __future__ import annotations

import argparse
import urllib.parse

from baselines.rayserve.config import BASELINE_ROUTERS, BaselineRouter, parse_router
from harness.errors import UsageError
from harness.loaders import LOADERS
from harness.metrics import Slo, parse_slo_option
from harness.outputs import output_dir
from harness.profile import SCALES, WORKLOAD_OPTION_HELP, WorkloadChoice, parse_workload_option
from harness.runner.config import RunConfig, cpu_layout, fit_engine_to_model
from harness.slosets import SLO_SETS
from harness.stacks import ALL_STACKS, STACKS, StackName
from serving.cliargs import non_negative_float, positive_int
from serving.cpus import LAYOUT_HELP
from serving.engine import ENGINES
from serving.engine.options import add_engine_option, validate_engine_options


def comma_separated(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _stacks(text: str) -> tuple[StackName, ...]:
    names = comma_separated(text)
    unknown = [n for n in names if n not in ALL_STACKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown stack(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(ALL_STACKS)}"
        )
    return tuple(dict.fromkeys(StackName(n) for n in names))


def check_url(text: str) -> str:
    """An http(s) URL with a host and, if given, a port in 1-65535; the text without a
    trailing slash. Raises argparse.ArgumentTypeError naming what is wrong."""
    parts = urllib.parse.urlsplit(text.strip())
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r}: the scheme must be http or https")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: no host")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must lie in 1-65535")
    return text.strip().rstrip("/")


def _urls(text: str) -> tuple[str, ...]:
    return tuple(check_url(item) for item in comma_separated(text))


def _slo(text: str) -> Slo:
    try:
        return parse_slo_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _workload(text: str) -> WorkloadChoice:
    try:
        return parse_workload_option(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _experiments(text: str) -> list[str]:
    from chaos.runner import check_experiments

    names = comma_separated(text)
    try:
        check_experiments(names)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _router(text: str) -> BaselineRouter:
    try:
        return parse_router(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_stack_choice(parser: argparse.ArgumentParser) -> None:
    """Which stacks, over which engine, how many replicas."""
    parser.add_argument("--scale", choices=SCALES, default="laptop", help="load scale")
    parser.add_argument(
        "--stacks",
        type=_stacks,
        default=",".join(STACKS),
        help=f"comma-separated, from {', '.join(ALL_STACKS)} (vllm-serve: vLLM's own server, "
        "--engine vllm only)",
    )
    parser.add_argument("--engine", choices=ENGINES, default="sim", help="engine of every replica")
    add_engine_option(parser)
    parser.add_argument(
        "--replicas", type=positive_int, default=2, help="engine replicas per stack"
    )
    parser.add_argument("--cpu-layout", metavar="ENGINES/REST", help=LAYOUT_HELP + " (vllm only)")
    parser.add_argument("--loader", choices=tuple(LOADERS), default="native", help="load tool")
    parser.add_argument("--out", default="results", help="parent of results/<run-id>/")
    parser.add_argument("--seed", type=int, help="override every profile's seed")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="trials per stack: of each profile in a run (default 3), of each rate in a sweep "
        "(default the profile's sweep_repeats at the scale: 3, 1 at smoke); repeat k is seeded "
        "seed + k and runs the stacks in a balanced order",
    )
    parser.add_argument(
        "--slo-set",
        choices=sorted(SLO_SETS),
        help="also judge every stack and profile against a named SLO set (seed000: seed 000's "
        "five SLOs); the report shows it and writes slo-<set>.json",
    )
    parser.add_argument(
        "--slo",
        type=_slo,
        action="append",
        default=[],
        metavar="NAME:MS",
        help="an SLO over the profile's own for that series, as vLLM's --goodput spells it: "
        "ttft:500, tpot:50, e2el:2000 (p99), or ttft_p90:300 for another percentile; repeatable",
    )


def _add_stack_setup(parser: argparse.ArgumentParser) -> None:
    """Stacks already running, the baseline's cluster and router, authentication, workload."""
    parser.add_argument(
        "--zerolayer-urls",
        type=_urls,
        default="",
        help="comma-separated replica URLs of a zero-layer stack already running",
    )
    parser.add_argument(
        "--baseline-url", type=check_url, default=None, help="front door of a running baseline"
    )
    _add_cluster(parser)
    parser.add_argument(
        "--baseline-router",
        type=_router,
        metavar="{" + ",".join(BASELINE_ROUTERS) + "}",
        help="the baseline's request router: pow2 (power of two choices), consistent-hash (on "
        "zl-session) or prefix-aware (Ray Serve LLM's, --engine vllm only); default: "
        "consistent-hash for our orchestrator, pow2 (Serve's default) for Ray Serve LLM",
    )
    parser.add_argument(
        "--baseline-stream-batching-ms",
        type=non_negative_float,
        metavar="MS",
        help="how long the baseline's engine replicas gather their engine's chunks before "
        "streaming them on as one item (Ray Serve LLM's stream_batching_interval_ms, for both "
        "baselines; 0: every engine step); default: Ray Serve LLM's own (50 ms)",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="production-like: the stacks authenticate tenants (a fresh key file in the run "
        "directory, one key per tenant of the profiles) and every loader sends each tenant's key",
    )
    parser.add_argument(
        "--workload", type=_workload, metavar="SOURCE[:PATH]", help=WORKLOAD_OPTION_HELP
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars or lines (CI logs)")
    parser.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="run even when the stacks' engines report different settings (max_num_seqs, KV "
        "blocks, ...): the difference is recorded in run.json and marked in the report; "
        "without it a difference stops the run before the stack's load",
    )


def _add_cluster(parser: argparse.ArgumentParser) -> None:
    """Placing the run on a Ray cluster: the address, the placement file, loader workers."""
    parser.add_argument(
        "--ray-address",
        help="place every stack's processes on this Ray cluster (zero-layer replicas and vLLM's "
        "servers by a node agent, the baseline by Serve); docs/cluster.md",
    )
    parser.add_argument(
        "--placement",
        metavar="FILE",
        help="TOML saying which nodes host each stack's replicas and the loader workers "
        "([stacks.NAME] nodes = [...], [loaders] nodes = [...]); default: spread over every "
        "node (needs --ray-address)",
    )
    parser.add_argument(
        "--loader-workers",
        type=positive_int,
        metavar="N",
        help="run the native loader as N Ray actors, each a shard of the schedule (by "
        "session), one start time for all (needs --ray-address)",
    )
    parser.add_argument(
        "--experiments",
        type=_experiments,
        default=[],
        metavar="NAME,...",
        help="profile D's chaos experiments, by name (default: every one that applies; "
        "node-loss only on a cluster of more than one node)",
    )


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """What stands the stacks up and drives them: shared by ``run`` and ``sweep``."""
    _add_stack_choice(parser)
    _add_stack_setup(parser)


def config_from(args: argparse.Namespace, profiles: tuple[str, ...]) -> RunConfig:
    """The RunConfig of a command line (``run`` or ``sweep``): engine options validated and
    fitted to the model they name (said once), ``--out`` a directory it can write."""
    try:
        options = validate_engine_options(args.engine, dict(args.engine_options))
    except ValueError as exc:
        raise UsageError(f"--engine-option: {exc}") from exc
    output_dir(args.out)
    external = bool(args.zerolayer_urls or args.baseline_url)
    # On a cluster the nodes are not this host: its cores are no layout for them.
    placed_here = not (external or args.ray_address)
    layout = cpu_layout(args.engine, args.replicas, args.cpu_layout) if placed_here else None
    config = RunConfig(
        scale=args.scale,
        profiles=profiles,
        stacks=tuple(args.stacks),
        engine=args.engine,
        engine_options=options,
        replicas=args.replicas,
        loader=args.loader,
        out=args.out,
        seed=args.seed,
        zerolayer_urls=tuple(args.zerolayer_urls),
        baseline_url=args.baseline_url or "",
        ray_address=args.ray_address,
        baseline_router=args.baseline_router,
        baseline_stream_batching_ms=args.baseline_stream_batching_ms,
        slo_set=args.slo_set,
        slos=tuple(args.slo),
        quiet=args.quiet,
        auth=args.auth,
        workload=args.workload,
        repeats=args.repeats,
        allow_mismatch=args.allow_mismatch,
        placement=args.placement,
        loader_workers=args.loader_workers,
        experiments=tuple(args.experiments),
        cpu_layout=layout,
    )
    return fit_engine_to_model(config)
