"""notebooks/reproduce.ipynb runs top to bottom against a real results directory (nbclient)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from simrun import Spec, fail_everything, make_run
from test_sweep_report import make_sweep
from test_turns import MULTI_TURN, with_turns

from bench.report import load_run
from bench.report.plots import plots_for
from harness import schema

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "reproduce.ipynb"


@pytest.mark.parametrize(
    "kind", ["served", "nothing-completed", "incomplete", "sweep", "multi-turn"]
)
def test_notebook_redraws_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if kind == "sweep":
        run_dir = tmp_path / "run"
        make_sweep(run_dir)
    elif kind == "multi-turn":
        profiles = {"a_latency": Spec(count=12, rate=40.0), MULTI_TURN: Spec(count=16)}
        run_dir = with_turns(make_run(tmp_path / "run", profiles=profiles), {"zerolayer": (90, 60)})
    else:
        run_dir = make_run(
            tmp_path / "run",
            profiles={"a_latency": Spec(count=12, rate=40.0)},
            complete=kind != "incomplete",
        )
    if kind == "nothing-completed":
        fail_everything(run_dir)
    expected = plots_for(load_run(run_dir))
    monkeypatch.setenv("ZL_RESULTS", str(run_dir))
    monkeypatch.setenv("ZL_NOTEBOOK_OUT", str(tmp_path / "redrawn"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    images = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert len(images) == len(expected)
    assert sorted(p.stem for p in (tmp_path / "redrawn").glob("*.png")) == sorted(expected)
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "layer adds 80-150 ms" in text
    if kind == "sweep":
        assert "load_goodput" in expected and f"run {run_dir.name}: scale laptop" in text
    elif kind == "multi-turn":
        assert f"ttft_by_turn-{MULTI_TURN}" in expected
        assert "zerolayer: prefix-cache hit rate 66.7 %" in text
        assert "baseline: prefix-cache hit rate n/a," in text
    else:
        assert f"run {run_dir.name}: scale test" in text and "zerolayer  a_latency" in text
    if kind == "incomplete":
        assert "INCOMPLETE RUN:" in text


def _notebook(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``zl-bench notebook`` as a user runs it, from ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "bench.cli", "notebook", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_notebook_command_takes_a_run_relative_to_where_the_user_stands(
    tmp_path: Path,
) -> None:
    """The path is read from the user's directory, not the notebook's (the kernel runs in the
    repository root), and the executed notebook and its HTML land in the run directory."""
    run_dir = make_run(tmp_path / "results" / "r1", profiles={"a_latency": Spec(count=12)})
    proc = _notebook(tmp_path, "results/r1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    executed = nbformat.read(run_dir / "reproduce.ipynb", as_version=4)
    text = "".join(out.get("text", "") for c in executed.cells for out in c.get("outputs", []))
    assert "run r1: scale test" in text
    assert "<html" in (run_dir / "reproduce.html").read_text()[:2000].lower()


def test_the_notebook_command_takes_the_newest_run_and_says_which(tmp_path: Path) -> None:
    old = make_run(tmp_path / "results" / "old", profiles={"a_latency": Spec(count=4)})
    new = make_run(tmp_path / "results" / "new", profiles={"a_latency": Spec(count=4)})
    stamp = (old / schema.RUN_META).stat().st_mtime
    os.utime(new / schema.RUN_META, (stamp + 60, stamp + 60))
    proc = _notebook(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"the newest run, {new}" in proc.stdout
    assert (new / "reproduce.ipynb").is_file() and not (old / "reproduce.ipynb").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [(["nowhere"], "nowhere: not a results directory"), ([], "no results directory under")],
)
def test_notebook_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], says: str
) -> None:
    proc = _notebook(tmp_path, *args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("zl-bench: error: ") and proc.stderr.count("\n") == 1
    assert says in proc.stderr
