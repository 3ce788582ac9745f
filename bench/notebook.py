"""``zl-bench notebook``: run ``notebooks/reproduce.ipynb`` against a results directory, or
``notebooks/history.ipynb`` (``--notebook history``) against the results store.

The researcher's path from a fresh clone is one command (``nox -s notebook -- results/<run-id>``
runs it): the run directory is resolved from where the user stands, not from the notebook's own
folder; with none named, the newest run under ``results/`` is taken and named. The run is handed
to the notebook the way papermill hands parameters: a cell injected after the one tagged
``parameters``. The executed notebook is written into the run directory beside ``report.html``
(``reproduce.ipynb``), with an HTML export of it (``reproduce.html``). The history notebook is
handed the store (``--store``, else ``$ZL_BENCH_STORE``, else ``RESULTS/store``) and written
into the results directory beside ``index.html`` (``history.ipynb``, ``history.html``).
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

from harness import schema, store
from harness.errors import UsageError

ROOT: Final = Path(__file__).resolve().parent.parent
NOTEBOOKS: Final = ("reproduce", "history")
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
    schema.read_run_meta(path)  # a run.json cut off mid-write: ResultsError, one line
    return path


def notebook_path(name: str) -> Path:
    return ROOT / "notebooks" / f"{name}.ipynb"


def with_parameters(nb: nbformat.NotebookNode, name: str, value: Path) -> nbformat.NotebookNode:
    """The notebook with papermill's injected-parameters cell after its ``parameters`` cell."""
    cells = nb.cells
    tagged = [i for i, c in enumerate(cells) if PARAMETERS_TAG in c.metadata.get("tags", [])]
    if not tagged:
        raise RuntimeError(f"the notebook has no cell tagged {PARAMETERS_TAG!r}")
    injected = nbformat.v4.new_code_cell(
        f"# Parameters (zl-bench notebook)\n{name} = {str(value)!r}\n",
        metadata={"tags": ["injected-parameters"]},
    )
    cells.insert(tagged[0] + 1, injected)
    return nb


def execute(notebook: Path, name: str, value: Path) -> nbformat.NotebookNode:
    """Run ``notebook`` top to bottom with the parameter ``name`` set to ``value``, in the
    repository root (where ``bench`` imports)."""
    nb = with_parameters(nbformat.read(notebook, as_version=4), name, value)
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
    parser.add_argument(
        "--notebook",
        choices=NOTEBOOKS,
        default=NOTEBOOKS[0],
        help="reproduce: a run's figures; history: the results store's runs and trends",
    )
    parser.add_argument(
        "--store",
        default=None,
        help=f"--notebook history: the store (default: ${store.STORE_ENV}, else RESULTS/store)",
    )


def _target(args: argparse.Namespace) -> tuple[str, Path, Path]:
    """The parameter the notebook is handed, its value, and the folder its output goes to."""
    if args.notebook == "history":
        if args.run is not None:
            raise UsageError("--notebook history reads the results store, not one run")
        results = Path(args.results).expanduser().resolve()
        where = store.Store(store.store_path(results, args.store))
        where.check()
        return "STORE", where.root, results
    run_dir = resolve_run(args.run, args.results)
    if args.run is None:
        print(f"notebook: the newest run, {run_dir}", flush=True)
    return "RESULTS", run_dir, run_dir


def run_command(args: argparse.Namespace) -> int:
    name, value, out = _target(args)
    try:
        nb = execute(notebook_path(args.notebook), name, value)
    except CellExecutionError as exc:
        print(f"notebook: a cell failed against {value}:\n{exc}", flush=True)
        return 1
    notebook, exported = out / f"{args.notebook}.ipynb", out / f"{args.notebook}.html"
    nbformat.write(nb, notebook)
    export_html(nb, exported)
    print(f"notebook: {notebook}\nnotebook: {exported}", flush=True)
    return 0
