"""``zl-bench``: the suite's one command line.

Every program is a subcommand; each lives in its own module, which exposes
``add_arguments(parser)`` and ``run_command(args) -> int`` and is imported only when its
subcommand is built, so a broken or slow module does not tax the others. A user's mistake
(``harness.errors.UsageError``, a bad argument, a damaged results file) prints one line,
``zl-bench: error: ...``, on stderr and exits 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from harness.errors import ClusterError, UsageError
from harness.schema import ResultsError

PROG = "zl-bench"
EXIT_USAGE = 2
EXIT_CLUSTER = 1  # a node of the run's Ray cluster was lost: partial results saved


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One ``zl-bench`` subcommand: the module that implements it and what it is for."""

    name: str
    module: str
    summary: str
    value_errors_are_usage: bool = False


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "run", "bench.run", "stand up the stacks, run the profiles, write a results directory"
    ),
    Subcommand(
        "sweep",
        "bench.sweep",
        "run one profile at a series of offered rates: load curves, max goodput, knee",
    ),
    Subcommand("report", "bench.report.html", "re-render plots and report.html for a run"),
    Subcommand(
        "notebook",
        "bench.notebook",
        "run notebooks/reproduce.ipynb against a run; the executed notebook and its HTML go "
        "into the run directory",
    ),
    Subcommand(
        "compare",
        "bench.report.compare",
        "compare two runs (intervals over trials) or two sweeps (point by point and headline "
        "figures with intervals); exit 0 no regression, 1 regression, 2 incomparable",
    ),
    Subcommand(
        "index",
        "bench.history.index",
        "file results directories (any schema version; partial runs marked) in the results "
        "store and rewrite results/index.html",
    ),
    Subcommand(
        "history",
        "bench.history.command",
        "list the runs of the results store with their figures and intervals, filtered; "
        "--baseline TAG marks regressions by compare's rules; trend METRIC plots one metric",
    ),
    Subcommand("tag", "bench.history.tag", "name a run of the results store"),
    Subcommand(
        "aa",
        "bench.aa",
        "run one configuration in pairs and report how often compare flags a regression between "
        "two runs of it (the false-alarm rate)",
    ),
    Subcommand("chaos", "chaos.runner", "run the chaos experiments against a stack"),
    Subcommand(
        "fragmentation",
        "bench.fragmentation",
        "seed 003's fixed shapes against the engine's defaults on one stack, in paired trials: "
        "KV tail waste and P95 stability",
    ),
    Subcommand(
        "attack",
        "bench.attack",
        "run the attack suite against fresh replicas beside a healthy client; exit 1 if any "
        "attack breaks its bounds",
    ),
    Subcommand("overhead", "bench.overhead", "measure the serving layer's own overhead"),
    Subcommand("capacity", "bench.loader_capacity", "measure each load generator's own ceiling"),
    Subcommand(
        "fidelity",
        "bench.fidelity",
        "check the sim keeps its step model's time (--against vllm: its latencies vs vLLM's)",
    ),
    Subcommand(
        "calibrate",
        "bench.calibrate",
        "calibrate the sim engine's step model",
        value_errors_are_usage=True,
    ),
    Subcommand(
        "tiny-model",
        "bench.tinymodel",
        "write a tiny Llama model directory with a locally trained tokenizer (offline)",
        value_errors_are_usage=True,
    ),
)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``zl-bench: error: ...``, and exit 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog.removeprefix(PROG).strip()}: {message}".lstrip(": "))


def fail(message: str) -> NoReturn:
    """Print a user's mistake as one line and exit 2."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


Command = Callable[[argparse.Namespace], int]


def _unavailable(spec: Subcommand, why: str) -> Command:
    def run(_: argparse.Namespace) -> int:
        raise UsageError(f"{spec.name} is not available: {why}")

    return run


def _add(sub: argparse._SubParsersAction[Parser], spec: Subcommand) -> None:
    parser = sub.add_parser(
        spec.name,
        help=spec.summary,
        description=spec.summary,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    try:
        module = importlib.import_module(spec.module)
        module.add_arguments(parser)
        command: Command = module.run_command
    except (ImportError, AttributeError) as exc:
        command = _unavailable(spec, f"{spec.module}: {exc}")
    parser.set_defaults(command=command, spec=spec)


def build_parser(only: str | None = None) -> Parser:
    """The whole command line; ``only`` builds just that subcommand (and imports only it)."""
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    for spec in SUBCOMMANDS:
        if only is None or only == spec.name:
            _add(sub, spec)
        else:
            sub.add_parser(spec.name, help=spec.summary)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    spec: Subcommand = args.spec
    try:
        return int(args.command(args))
    except ValueError as exc:
        if spec.value_errors_are_usage:
            raise UsageError(str(exc)) from exc
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the subcommand, and turn a user's mistake into one error line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    known = {spec.name for spec in SUBCOMMANDS}
    args = build_parser(chosen if chosen in known else "").parse_args(argv)
    try:
        return _dispatch(args)
    except (UsageError, ResultsError) as exc:
        fail(str(exc))
    except ClusterError as exc:  # the run's cluster failed it: what it measured is saved
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_CLUSTER


if __name__ == "__main__":
    sys.exit(main())
