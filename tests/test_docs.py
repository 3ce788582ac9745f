"""The documentation stands on its own: every relative link in the README and docs/ resolves
inside the repository (nothing points at files a clone does not have), and every figure the docs
show is what ``scripts/docs_figures.py`` draws from the run committed beside it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.DOTALL)


def _figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_figures", ROOT / "scripts" / "docs_figures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def _relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    for link in _relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_relative_to(ROOT), f"{link} points outside the repository"
        assert target.exists(), f"{link}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{link}: no such heading"


def test_the_anchor_rule_matches_githubs() -> None:
    assert _anchor(" Load curves: `zl-bench sweep`") == "load-curves-zl-bench-sweep"
    assert _anchor(" Redraw a run's figures in the notebook") == (
        "redraw-a-runs-figures-in-the-notebook"
    )


def test_every_docs_figure_is_redrawn_from_its_committed_run(tmp_path: Path) -> None:
    figures = _figures()
    for name in figures.DRAWN:
        committed = figures.FIGURES / name
        drawn = figures.redraw(name, tmp_path)
        assert drawn.read_bytes() == committed.read_bytes(), (
            f"docs/figures/{name} is not what its run draws: run python scripts/docs_figures.py"
        )
