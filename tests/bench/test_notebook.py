"""notebooks/reproduce.ipynb runs top to bottom against a real results directory (nbclient)."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

from bench.report import claims, load_run
from bench.report.plots import PLOTS, TTFT_BY_TURN, plots_absent, plots_for
from harness import schema
from tests.support import readme
from tests.support.paths import ROOT
from tests.support.simrun import Spec, fail_everything, make_run
from tests.support.sweeps import make_sweep
from tests.support.turns import MULTI_TURN, with_turns

NOTEBOOK = ROOT / "notebooks" / "reproduce.ipynb"
# pip installs the notebook session's venv (about 2 minutes here) before the notebook runs
README_LIMIT_S = 900
THREE_STACKS: dict[str, int | None] = {"zerolayer": None, "baseline": 2, "vllm-serve": None}


@pytest.mark.parametrize(
    "kind", ["served", "nothing-completed", "incomplete", "sweep", "multi-turn", "three-stacks"]
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
            stacks=THREE_STACKS if kind == "three-stacks" else None,
            complete=kind != "incomplete",
        )
    if kind == "nothing-completed":
        fail_everything(run_dir)
    if kind != "incomplete":  # the report writes claims.json; the notebook reads it
        claims.write(run_dir, claims.evaluate(load_run(run_dir)))
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
    if kind == "incomplete":
        assert "no claims.json in this run" in text and "layer adds 80-150 ms" not in text
    else:
        assert "layer adds 80-150 ms" in text and "validity rule: a figure is decided" in text
    absent = plots_absent(load_run(run_dir))
    for name, why in absent.items():
        assert f"{name}: not drawn: {why}" in text
    assert len(absent) + len(expected) >= len(PLOTS)
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
    if kind == "nothing-completed":
        assert "latency_cdf: no completed requests in profile a_latency: no latency" in text
        assert "where_time_goes: no completed requests in this run" in text
        assert "no request got a first token: no TTFT to show" in text
    if kind == "three-stacks":
        assert "vllm-serve a_latency" in " ".join(text.split())
        assert "stacks ['zerolayer', 'baseline', 'vllm-serve']" in text


def test_the_first_cell_explains_every_figure_by_a_definition_that_exists() -> None:
    """The first cell names each figure the report can draw and the definition behind it; a
    renamed figure or metric function fails here rather than leaving the cell wrong."""
    first = nbformat.read(NOTEBOOK, as_version=4).cells[0]
    assert first.cell_type == "markdown"
    for name in [*PLOTS, f"{TTFT_BY_TURN}-<profile>"]:
        assert f"`{name}`" in first.source
    cited = re.findall(r"`((?:harness|bench|zerolayer)\.[\w.]+)`", first.source)
    assert "harness.metrics.series" in cited
    for dotted in cited:
        module, _, attr = dotted.rpartition(".")
        while module not in sys.modules:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError:
                module, _, outer = module.rpartition(".")
                attr = f"{outer}.{attr}"
        target = sys.modules[module]
        for part in attr.split("."):
            target = getattr(target, part)


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


def _fresh_venv(where: Path) -> dict[str, str]:
    """The environment of a shell in a new virtual environment: its ``bin`` first on PATH and
    nothing of this test session's own environment (nox must build its own, as for a user)."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    path = [p for p in env["PATH"].split(os.pathsep) if Path(sys.prefix) not in Path(p).parents]
    env["PATH"] = os.pathsep.join([str(where / "bin"), *path])
    return env


@pytest.mark.slow
@pytest.mark.timeout(README_LIMIT_S)
def test_the_readme_notebook_lines_work_as_written_from_the_repository_root(
    tmp_path: Path,
) -> None:
    """As a newcomer runs them: ``pip install nox`` in a fresh virtual environment, then the
    README's notebook line verbatim in the repository root, on a run under ``results/``. The
    bench line's run itself is the smoke test's (``test_readme_bench``, from the same README line);
    here a small real run stands in for it. The path is read from where the user stands, and
    the executed notebook and its HTML land in the run directory."""
    bench_line, notebook_line = readme.commands(readme.NOTEBOOK_SECTION)
    install = bench_line.split("&&")[0].strip()
    assert install == "pip install nox" and "<run-id>" in notebook_line
    run_id = f"readme-test-{uuid.uuid4().hex[:8]}"
    run_dir = ROOT / "results" / run_id
    env = _fresh_venv(tmp_path / "venv")
    try:
        make_run(run_dir, profiles={"a_latency": Spec(count=12)})
        for line in (install, notebook_line.replace("<run-id>", run_id)):
            proc = subprocess.run(
                ["bash", "-c", line],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=README_LIMIT_S,
                check=False,
            )
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        executed = nbformat.read(run_dir / "reproduce.ipynb", as_version=4)
        text = "".join(out.get("text", "") for c in executed.cells for out in c.get("outputs", []))
        assert f"run {run_id}: scale test" in text
        assert "<html" in (run_dir / "reproduce.html").read_text()[:2000].lower()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_the_notebook_command_takes_the_newest_run_and_says_which(tmp_path: Path) -> None:
    old = make_run(tmp_path / "results" / "old", profiles={"a_latency": Spec(count=4)})
    new = make_run(tmp_path / "results" / "new", profiles={"a_latency": Spec(count=4)})
    stamp = (old / schema.RUN_META).stat().st_mtime
    os.utime(new / schema.RUN_META, (stamp + 60, stamp + 60))
    started = time.time()
    proc = _notebook(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"the newest run, {new}" in proc.stdout
    assert (new / "reproduce.ipynb").is_file() and not (old / "reproduce.ipynb").exists()
    assert not _kernels_since(started), "the command left its kernel running"


def _kernels_since(started: float) -> list[psutil.Process]:
    """IPython kernels started since ``started`` that are still running."""
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["create_time"] >= started and any("ipykernel" in a for a in cmdline):
            found.append(proc)
    return found


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
