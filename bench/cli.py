"""``zl-bench``: the suite's command line.

``report RUN`` re-renders plots and report.html from saved results; ``compare A B`` puts two runs
side by side. Other subcommands live in their own modules and register themselves: any module
named in SUBCOMMAND_MODULES that exists must define ``register(subparsers)``, which adds its parser
and sets ``func`` (taking the parsed args, returning the exit status) as a default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

SUBCOMMAND_MODULES: tuple[str, ...] = ("bench.run",)


def _report(args: argparse.Namespace) -> int:
    from bench.report import html

    path = html.render(args.run)
    print(f"wrote {path}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from bench.report import compare

    return compare.main(
        args.a, args.b, n_boot=args.bootstrap, threshold=args.threshold, confidence=args.confidence
    )


def _add_builtin(sub: Any) -> None:
    report = sub.add_parser("report", help="re-render plots and report.html from a results dir")
    report.add_argument("run", help="results directory, e.g. results/<run-id>")
    report.set_defaults(func=_report)
    comp = sub.add_parser(
        "compare", help="compare two runs with bootstrap CIs; exit 1 on a flagged regression"
    )
    comp.add_argument("a", help="baseline results directory")
    comp.add_argument("b", help="candidate results directory")
    comp.add_argument("--bootstrap", type=int, default=1000, help="resamples (default 1000)")
    comp.add_argument(
        "--threshold",
        type=float,
        default=0.10,
        help="relative change that counts as a regression (default 0.10)",
    )
    comp.add_argument("--confidence", type=float, default=0.95, help="CI level (default 0.95)")
    comp.set_defaults(func=_compare)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zl-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_builtin(sub)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
