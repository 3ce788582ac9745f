"""``results/index.html``: every run of the results store on one static page, with its date,
commit, configuration and headline figures, sortable (click a heading) and filterable (type in
the box), linking each run's ``report.html``. Rewritten whenever a run is filed or the store is
indexed; it is a plain file with its script inline, so it opens from disk or any web server.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final
from urllib.parse import quote

import jinja2

from bench.history.listing import HEADINGS, Filters, Line, lines
from harness import store

PAGE: Final = "index.html"

TEMPLATE: Final = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>zl-bench results</title>
<style>
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 3px 5px; white-space: nowrap; }
th { white-space: normal; max-width: 7em; }
th { background: #eef; cursor: pointer; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.partial td { background: #fff4d6; }
#filter { width: 30em; padding: 4px; margin-bottom: 0.8em; }
.note { color: #555; }
</style></head><body>
<h1>zl-bench results</h1>
<p class="note">{{ runs }} runs in the store {{ store }}, as of {{ now }} UTC. A figure is the
mean over the trials that may decide a comparison (zl-bench compare's rule) with its 95 % interval
over them; * marks a run none of whose trials may, so its figures are over every trial. A sweep
shows its headline figures. Partial runs (killed, interrupted, damaged) are shaded; hover for
why.</p>
<input id="filter" placeholder="filter: words every row shown contains (or open #filter=words)"
 autofocus>
<table id="runs"><thead><tr>
{% for h in headings %}<th data-col="{{ loop.index0 }}">{{ h }}</th>{% endfor %}
</tr></thead><tbody>
{% for row in rows %}<tr{% if row.partial %} class="partial" title="{{ row.why }}"{% endif %}>
{% for c in row.cells %}<td
{%- if c.figure %} class="num"{% endif %}
{%- if c.number is not none %} data-sort="{{ c.number }}"{% endif %}
{%- if c.note %} title="{{ c.note }}"{% endif %}>
{%- if c.link %}<a href="{{ c.link }}">{{ c.text }}</a>{% else %}{{ c.text }}{% endif %}</td>
{% endfor %}</tr>
{% endfor %}</tbody></table>
<script>
const table = document.getElementById("runs");
const body = table.tBodies[0];
const box = document.getElementById("filter");
function filter() {
  const words = box.value.toLowerCase().split(/\\s+/).filter(Boolean);
  for (const row of body.rows) {
    const text = row.textContent.toLowerCase();
    row.style.display = words.every((w) => text.includes(w)) ? "" : "none";
  }
}
box.addEventListener("input", filter);
// index.html#filter=words opens filtered, so a filtered view can be linked
if (location.hash.startsWith("#filter=")) {
  box.value = decodeURIComponent(location.hash.slice(8)).replace(/\\+/g, " ");
  filter();
}
for (const th of table.tHead.rows[0].cells) {
  th.addEventListener("click", () => {
    const col = Number(th.dataset.col);
    const up = th.dataset.dir !== "up";
    th.dataset.dir = up ? "up" : "down";
    const key = (row) => {
      const cell = row.cells[col];
      return cell.dataset.sort !== undefined ? Number(cell.dataset.sort) : cell.textContent;
    };
    const sorted = [...body.rows].sort((a, b) => {
      const x = key(a), y = key(b);
      const numbers = typeof x === "number" && typeof y === "number";
      const order = numbers ? x - y : String(x).localeCompare(String(y));
      return up ? order : -order;
    });
    sorted.forEach((row) => body.appendChild(row));
  });
}
</script></body></html>
"""


@dataclass(frozen=True, slots=True)
class Cell:
    """One cell: its text, the number it sorts by (None: sorted as text), its link, what a
    reader sees on hovering (why a figure is missing), and whether it is a figure (right
    aligned)."""

    text: str
    number: float | None = None
    link: str = ""
    note: str = ""
    figure: bool = False


@dataclass(frozen=True, slots=True)
class PageRow:
    cells: list[Cell]
    partial: bool
    why: str


def _link(report: str | None, folder: Path) -> str:
    """The run's report relative to the page (so the folder can move), as a URL path."""
    if not report:
        return ""
    return quote(os.path.relpath(report, folder).replace(os.sep, "/"))


def _row(line: Line, folder: Path) -> PageRow:
    run = line.run
    mark = "*" if line.all_trials else ""
    trials = f"{line.deciding}/{line.trials}{mark}" if line.trials else ""
    figures = [
        Cell(line.figure_text(name), figure.value, note=figure.note, figure=True)
        if (figure := line.figures.get(name))
        else Cell("-", figure=True)
        for name in HEADINGS
    ]
    cells = [
        Cell(run.run_id, link=_link(run.report, folder)),
        Cell(f"{run.started:%Y-%m-%d %H:%M}"),
        Cell(run.kind),
        Cell(run.state),
        Cell(run.git_revision),
        Cell(run.host),
        Cell(run.scale),
        Cell(run.engine),
        Cell(run.model),
        Cell(line.stack),
        Cell(line.profile),
        Cell(trials, line.deciding if line.trials else None, figure=True),
        *figures,
        Cell(", ".join(run.tags)),
    ]
    return PageRow(cells, run.partial, "; ".join(run.partial_reasons))


def render(into: store.Store, folder: Path) -> str:
    """The page for every run in the store, its links relative to ``folder``."""
    with store.connect(into) as con:
        shown = lines(con, Filters())
    headings = [
        "run", "started (UTC)", "kind", "state", "commit", "host", "scale", "engine", "model",
        "stack", "profile", "trials deciding / all",
        *HEADINGS.values(), "tags",
    ]  # fmt: skip
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return environment.from_string(TEMPLATE).render(
        headings=headings,
        rows=[_row(line, folder) for line in reversed(shown)],
        runs=len({line.run.run_id for line in shown}),
        store=into.root,
        now=f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S}",
    )


def write_page(into: store.Store, folder: Path) -> Path:
    """``folder/index.html``, replaced whole (two runs ending at once each write a whole page)."""
    path = folder / PAGE
    tmp = folder / f".{PAGE}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(render(into, folder), encoding="utf-8")
    os.replace(tmp, path)
    return path
