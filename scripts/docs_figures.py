"""Redraw the documentation's figures from the runs committed under ``docs/runs/``.

Every figure in the README and ``docs/`` is drawn by the report's own plot functions
(``bench.report.plots``) from a real run's saved files, never by hand, so a figure can always be
traced to the run and command that made it. Run from the repository root:

    python scripts/docs_figures.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from bench.report.data import load_run
from bench.report.plots import RUN_PLOTS

ROOT: Final = Path(__file__).resolve().parent.parent
RUNS: Final = ROOT / "docs" / "runs"
FIGURES: Final = ROOT / "docs" / "figures"
DPI: Final = 110  # the report's own (bench.report.plots.render_all)
# figure file -> (run id under docs/runs/, plot name in bench.report.plots.RUN_PLOTS)
DRAWN: Final = {
    "latency_variance.png": ("20261202-024041-smoke", "latency_variance"),
}


def redraw(name: str, out: Path = FIGURES) -> Path:
    """The figure ``name`` of ``DRAWN`` from its committed run, written to ``out/<name>``."""
    run_id, plot = DRAWN[name]
    figure = RUN_PLOTS[plot](load_run(RUNS / run_id))
    path = out / name
    figure.savefig(path, dpi=DPI)
    return path


def main() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name in DRAWN:
        print(redraw(name).relative_to(ROOT))


if __name__ == "__main__":
    main()
