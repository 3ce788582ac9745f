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
from harness.outputs import output_file
from harness.tables import Align, Column, text_table
from serving.cliargs import positive_float
from serving.engine import ENGINE_KINDS

# The engines an attack runs on: those with no real model, so the attack loads the serving layer.
ENGINES = tuple(name for name, kind in ENGINE_KINDS.items() if not kind.runs_model)


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
    if args.out is not None:
        output_file(args.out)
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


TABLE_COLUMNS = (
    Column("attack", align=Align.LEFT, width=20),
    Column("item", width=4),
    Column("verdict", align=Align.LEFT, width=7),
    Column("healthy", width=9),
    Column("RSS growth", width=11),
    Column("bound", width=10),
    Column("active", width=6),
    Column("skipped", align=Align.LEFT),
)


def _table_row(o: Outcome) -> list[str]:
    """An attack's cells: its numbers, or dashes and the reason where it was skipped."""
    if o.skipped:
        return [o.attack, str(o.item), "skip", "-", "-", "-", "-", o.skipped]
    active = "gone" if o.active_after is None else str(o.active_after)
    healthy = f"{o.healthy_ok}/{o.healthy_total}"
    return [o.attack, str(o.item), o.verdict, healthy, mib(o.rss_peak - o.rss_before),
            mib(o.rss_bound), active, ""]  # fmt: skip


def table(outcomes: list[Outcome]) -> str:
    """The summary: one row per attack, its verdict and the numbers it was judged on."""
    rows = [text_table(TABLE_COLUMNS, [_table_row(o) for o in outcomes], rule=True)]
    failed = sum(1 for o in outcomes if not o.passed and not o.skipped)
    rows.append(f"{failed} of {len(outcomes)} attacks failed their bounds")
    return "\n".join(rows)
