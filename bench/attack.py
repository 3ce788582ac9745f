"""``zl-bench attack``: the standing attack suite (``chaos.attacks``) from the command line.

One progress line per attack as it ends, then a table; ``--out FILE`` writes every outcome as
JSON too. Exit 0 when every attack that ran kept within its bounds, 1 when any did not.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

from chaos.attacks.outcome import Outcome, mib
from chaos.attacks.runner import DEFAULT_SECONDS, NAMES, run_suite, select
from harness.errors import UsageError
from serving.cliargs import positive_float

ENGINES = ("null", "sim")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only this attack (repeatable): {', '.join(NAMES)}",
    )
    parser.add_argument(
        "--seconds",
        type=positive_float,
        default=DEFAULT_SECONDS,
        help="how long each attack runs (each also stops at its own count bound)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="null",
        help="the replica's engine (an attack that needs one engine uses it regardless)",
    )
    parser.add_argument("--out", type=Path, help="write every outcome to this JSON file")


def run_command(args: argparse.Namespace) -> int:
    try:
        attacks = select(args.only)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.out is not None and not args.out.parent.is_dir():
        raise UsageError(f"--out: no such directory: {args.out.parent}")
    outcomes = run_suite(attacks, args.seconds, args.engine, progress=_print_line)
    print()
    print(table(outcomes))
    if args.out is not None:
        document = {"seconds": args.seconds, "engine": args.engine,
                    "outcomes": [o.to_dict() for o in outcomes]}  # fmt: skip
        args.out.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return 1 if any(not o.passed and not o.skipped for o in outcomes) else 0


def _print_line(outcome: Outcome) -> None:
    print(outcome.line(), flush=True)


def table(outcomes: list[Outcome]) -> str:
    """The summary: one row per attack, its verdict and the numbers it was judged on."""
    header = f"{'attack':<20} {'item':>4} {'verdict':<7} {'healthy':>9} {'RSS growth':>11} " \
             f"{'bound':>10} {'active':>6}"  # fmt: skip
    rows = [header, "-" * len(header)]
    for o in outcomes:
        if o.skipped:
            rows.append(f"{o.attack:<20} {o.item:>4} {'skip':<7} {o.skipped}")
            continue
        active = "gone" if o.active_after is None else str(o.active_after)
        rows.append(
            f"{o.attack:<20} {o.item:>4} {o.verdict:<7} {o.healthy_ok:>4}/{o.healthy_total:<4} "
            f"{mib(o.rss_peak - o.rss_before):>11} {mib(o.rss_bound):>10} {active:>6}"
        )
    failed = sum(1 for o in outcomes if not o.passed and not o.skipped)
    rows.append(f"{failed} of {len(outcomes)} attacks failed their bounds")
    return "\n".join(rows)
