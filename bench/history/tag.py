"""``zl-bench tag RUN NAME``: name a run of the results store (``--baseline NAME`` and
``--tag NAME`` in ``zl-bench history`` then find it). A name is one run's: tagging another run
with it moves it, and says so. The index page, which shows the tags, is rewritten."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.history.page import write_page
from harness import store
from harness.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench tag``'s arguments."""
    parser.add_argument("run", help="the run: its id, or its results directory")
    parser.add_argument("name", help="the tag: a letter or digit, then letters, digits, . _ -")
    parser.add_argument("--results", default="results", help="the results directory")
    parser.add_argument(
        "--store", default=None, help=f"the store (default: ${store.STORE_ENV}, else RESULTS/store)"
    )


def run_command(args: argparse.Namespace) -> int:
    """Set the tag and rewrite RESULTS/index.html; UsageError for a run the store does not
    hold."""
    results = Path(args.results).expanduser()
    into = store.Store(store.store_path(results, args.store))
    with store.connect(into) as con:
        known = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY started").fetchall()]
        moved = con.execute("SELECT run_id FROM tags WHERE tag = ?", [args.name]).fetchall()
    run_id = Path(args.run).name
    if run_id not in known:
        recent = f"; the newest: {', '.join(known[-3:])}" if known else ""
        raise UsageError(f"unknown run {args.run!r}: not in the results store {into.root}{recent}")
    into.set_tag(args.name, run_id)
    was = f" (moved from {moved[0][0]})" if moved and moved[0][0] != run_id else ""
    print(f"tag {args.name} -> {run_id}{was}")
    if results.is_dir():
        write_page(into, results)
    return 0
