"""The results store seen from ``zl-bench``: filing runs (``index``: ``zl-bench index`` and the
hook every run and sweep calls at its end), listing and comparing them (``command``:
``zl-bench history``), naming them (``tag``), their trends (``trend``) and the index page
(``page``). The store itself is ``harness.store``.
"""

from __future__ import annotations

from pathlib import Path

from harness.runner.console import say


def file_run(run_dir: Path) -> None:
    """File a run that has just ended in its results store and rewrite the index page beside
    it. The run's own files stay the source of truth: a store that cannot be written is one
    warning line, never a failed run (``zl-bench index`` can file it later)."""
    try:
        from bench.history.index import index_run
        from bench.history.page import write_page
        from harness import store

        into = store.Store(store.store_path(run_dir.parent))
        filed = index_run(into, run_dir)
        page = write_page(into, run_dir.parent)
        state = "partial" if filed.partial else "complete"
        say(f"filed in the results store {into.root} ({state}); index: {page}")
    except Exception as exc:  # whatever went wrong, the run itself is kept
        say(f"warning: the run was not filed in the results store: {exc}")
