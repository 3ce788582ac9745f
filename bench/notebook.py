"""``zl-bench notebook``: run ``notebooks/reproduce.ipynb`` against a results directory.

The researcher's path from a fresh clone is one command (``nox -s notebook -- results/<run-id>``
runs it): the run directory is resolved from where the user stands, not from the notebook's own
folder; with none named, the newest run under ``results/`` is taken and named. The run is handed
to the notebook the way papermill hands parameters: a cell injected after the one tagged
``parameters``. The executed notebook is written into the run directory beside ``report.html``
(``reproduce.ipynb``), with an HTML export of it (``reproduce.html``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Final

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config

from harness import schema
from harness.errors import UsageError

ROOT: Final = Path(__file__).resolve().parent.parent
NOTEBOOK: Final = ROOT / "notebooks" / "reproduce.ipynb"
EXECUTED: Final = "reproduce.ipynb"
EXPORTED: Final = "reproduce.html"
PARAMETERS_TAG: Final = "parameters"
CELL_TIMEOUT_S: Final = 600
KERNEL: Final = "python3"


def is_run(path: Path) -> bool:
    return (path / schema.RUN_META).is_file()


def newest_run(parent: Path) -> Path:
    """The most recently written run directory under ``parent``."""
    runs = [p for p in parent.glob("*/") if is_run(p)] if parent.is_dir() else []
    if not runs:
        raise UsageError(f"no results directory under {parent}: run `nox -s bench` first")
    return max(runs, key=lambda p: (p / schema.RUN_META).stat().st_mtime)


def resolve_run(given: str | None, results: str) -> Path:
    """The run directory as an absolute path, relative paths taken from the current directory."""
    if given is None:
        return newest_run(Path(results).expanduser().resolve())
    path = Path(given).expanduser().resolve()
    if not is_run(path):
        raise UsageError(f"{given}: not a results directory (no {schema.RUN_META} in {path})")
    return path


def with_parameters(nb: nbformat.NotebookNode, run_dir: Path) -> nbformat.NotebookNode:
    """The notebook with papermill's injected-parameters cell after its ``parameters`` cell."""
    cells = nb.cells
    tagged = [i for i, c in enumerate(cells) if PARAMETERS_TAG in c.metadata.get("tags", [])]
    if not tagged:
        raise RuntimeError(f"{NOTEBOOK} has no cell tagged {PARAMETERS_TAG!r}")
    injected = nbformat.v4.new_code_cell(
        f"# Parameters (zl-bench notebook)\nRESULTS = {str(run_dir)!r}\n",
        metadata={"tags": ["injected-parameters"]},
    )
    cells.insert(tagged[0] + 1, injected)
    return nb


def execute(run_dir: Path) -> nbformat.NotebookNode:
    """Run the notebook top to bottom in the repository root (where ``bench`` imports)."""
    nb = with_parameters(nbformat.read(NOTEBOOK, as_version=4), run_dir)
    # IPC sockets in a private temporary folder, not TCP ports: the kernel's channels stay this
    # user's (and the kernel does not warn about unencrypted TCP in the notebook's output)
    with tempfile.TemporaryDirectory(prefix="zl-kernel-") as sockets:
        ipc = Config({"KernelManager": {"transport": "ipc", "ip": f"{sockets}/kernel"}})
        client = NotebookClient(  # it owns the kernel it starts, so it shuts it down too
            nb,
            config=ipc,
            timeout=CELL_TIMEOUT_S,
            kernel_name=KERNEL,
            resources={"metadata": {"path": str(ROOT)}},
        )
        client.execute()
    return nb


def export_html(nb: nbformat.NotebookNode, path: Path) -> None:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)
    path.write_text(body)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run",
        nargs="?",
        help="results directory (relative to where you stand); default: the newest under --results",
    )
    parser.add_argument("--results", default="results", help="parent of the runs (default results)")


def run_command(args: argparse.Namespace) -> int:
    run_dir = resolve_run(args.run, args.results)
    if args.run is None:
        print(f"notebook: the newest run, {run_dir}", flush=True)
    try:
        nb = execute(run_dir)
    except CellExecutionError as exc:
        print(f"notebook: a cell failed against {run_dir}:\n{exc}", flush=True)
        return 1
    notebook = run_dir / EXECUTED
    nbformat.write(nb, notebook)
    export_html(nb, run_dir / EXPORTED)
    print(f"notebook: {notebook}\nnotebook: {run_dir / EXPORTED}", flush=True)
    return 0
