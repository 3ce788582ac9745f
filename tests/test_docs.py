"""The documentation stands on its own: every relative link in the README and docs/ resolves
inside the repository (nothing points at files a clone does not have), every figure the docs
show is what ``scripts/docs_measured.py`` draws from the run committed beside it, and every table
of measured figures is what it renders from the summaries under ``docs/measured/``: a figure
edited or typed by hand fails here."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import orjson
import pytest

from tests.support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.DOTALL)


def _measured() -> ModuleType:
    """``scripts/docs_measured.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "docs_measured", ROOT / "scripts" / "docs_measured.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


MEASURED = _measured()


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


def test_every_docs_figure_is_redrawn_from_its_committed_run() -> None:
    assert MEASURED.stale_figures() == [], "run python scripts/docs_measured.py render"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_measured_table_is_its_rendering_and_none_is_typed(page: Path) -> None:
    assert MEASURED.problems(page) == [], "run python scripts/docs_measured.py render"


def _first_figure_edited(text: str) -> str:
    """``text`` with a digit of the first table row inside its first marked block changed."""
    block = next(MEASURED.BLOCK.finditer(text))
    row = block[0].splitlines()[3]  # the marker, the header, the rule, then the first row
    digit = re.search(r"\d", row)
    assert digit is not None
    swapped = "7" if digit[0] != "7" else "8"
    return text.replace(row, row[: digit.start()] + swapped + row[digit.end() :], 1)


def test_a_figure_edited_by_hand_fails_the_check(tmp_path: Path) -> None:
    page = ROOT / "docs" / "measurements.md"
    copy = tmp_path / page.name
    copy.write_text(page.read_text(encoding="utf-8"), encoding="utf-8")
    assert MEASURED.problems(page, copy.read_text(encoding="utf-8")) == []
    copy.write_text(_first_figure_edited(copy.read_text(encoding="utf-8")), encoding="utf-8")
    found = MEASURED.problems(page, copy.read_text(encoding="utf-8"))
    assert len(found) == 1 and "differs from its rendering" in found[0]


def test_a_table_typed_outside_a_marked_block_fails_the_check() -> None:
    page = ROOT / "docs" / "measurements.md"
    typed = (
        page.read_text(encoding="utf-8") + "\n| what | figure |\n| --- | --- |\n| knee | 13.8 |\n"
    )
    found = MEASURED.problems(page, typed)
    assert found == ["measurements.md: a table outside any measured block: | what | figure |"]


def test_a_block_naming_no_table_fails_the_check() -> None:
    page = ROOT / "docs" / "measurements.md"
    text = "<!-- measured:nothing -->\n| a |\n| --- |\n<!-- /measured:nothing -->\n"
    assert MEASURED.problems(page, text) == [
        "measurements.md: measured:nothing names no table in TABLES"
    ]


def test_every_table_is_shown_once_and_every_summary_is_committed_and_used() -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in PAGES)
    shown = [m["name"] for m in MEASURED.BLOCK.finditer(text)]
    assert sorted(shown) == sorted(MEASURED.TABLES)
    used = {s for t in MEASURED.TABLES.values() for s in t.sources}
    committed = {p.stem for p in MEASURED.MEASURED.glob("*.json")}
    assert used == committed == set(MEASURED.SOURCES)


@pytest.mark.parametrize("name", sorted(MEASURED.SOURCES))
def test_every_summary_is_small_and_says_where_it_came_from(name: str) -> None:
    path = MEASURED.MEASURED / f"{name}.json"
    assert path.stat().st_size < 16_000, "a summary keeps the figures shown, not the records"
    summary = MEASURED.Measured.load(name)
    made = summary.provenance
    assert made.command and made.commit and re.fullmatch(r"\d{4}-\d{2}-\d{2}", made.date)
    assert made.host.cpus > 0 and made.cpu_speed_start and made.cpu_speed_end
    assert summary.rows and all(set(r) <= MEASURED.shown_keys(name) for r in summary.rows)


def _provenance() -> object:
    host = MEASURED.Host("test", 2)
    return MEASURED.Provenance("zl-bench capacity --out c.json", "abc", "2026-01-01", host, 1, 2)


def test_capture_keeps_only_the_figures_shown_and_the_table_follows_them(tmp_path: Path) -> None:
    run = {"loader": "native", "rate": 500.0, "protocol": "h2c", "p99_lag_ms": 0.25,
           "sustained": True, "achieved": 499.0, "median_e2el_ms": 1.0}  # fmt: skip
    results = tmp_path / "capacity.json"
    results.write_bytes(orjson.dumps([run, {**run, "p99_lag_ms": 0.5, "sustained": False}]))
    MEASURED.capture("capacity", results, _provenance(), tmp_path)
    rows = MEASURED.Measured.load("capacity", tmp_path).rows
    assert rows == [{"loader": "native (h2c)", "rate": 500.0, "best_lag": 0.25,
                     "worst_lag": 0.5, "sustained": "1/2"}]  # fmt: skip
    page = ROOT / "docs" / "measurements.md"
    block = MEASURED.render_block("capacity", page, tmp_path)
    assert "| native (h2c) | 500 | 0.250 | 0.500 | 1/2 |" in block
    assert "`zl-bench capacity --out c.json`; commit `abc`, 2026-01-01" in block


def test_a_sweep_row_shows_its_interval_or_the_reason_it_has_none() -> None:
    knee = {"value": 13.75, "low": 11.28, "high": 16.23, "n": 3, "note": ""}
    none = {"value": None, "low": None, "high": None, "n": 0, "note": "not reached"}
    row = {"rates": [2.0, 4.0, 8.0], "max_goodput": none, "knee": knee, "added_latency": None,
           "host_full": [8.0]}  # fmt: skip
    shown = MEASURED.sweep_cells(row)
    assert shown["knee"] == "13.8 [11.3, 16.2]"
    assert shown["max_goodput"] == "not reached"
    assert shown["rates"] == "2-8 (3)" and shown["host_full"] == "8"
    assert shown["added_latency"] is None
