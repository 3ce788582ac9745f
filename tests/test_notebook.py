"""notebooks/reproduce.ipynb runs top to bottom against a real results directory (nbclient)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from simrun import Spec, fail_everything, make_run
from test_sweep_report import make_sweep
from test_turns import MULTI_TURN, with_turns

from bench.report import load_run
from bench.report.plots import plots_for

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "reproduce.ipynb"


@pytest.mark.parametrize("kind", ["served", "nothing-completed", "sweep", "multi-turn"])
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
        run_dir = make_run(tmp_path / "run", profiles={"a_latency": Spec(count=12, rate=40.0)})
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
