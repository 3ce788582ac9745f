"""The project's one table renderer: aligned text for the console and markdown for files.

Every command that prints or writes a table of figures (the bench's, chaos's) renders it here, so
they all align the same way and show a missing figure the same way: a dash, never 0. The text
layout is rich's (no borders, no styling), so a wide cell widens its column instead of breaking
the alignment by hand.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

MISSING = "-"
# Wide enough that no table here ever wraps (rich wraps to the console's width).
_CONSOLE_WIDTH = 10_000


class Align(Enum):
    """Where a column's cells sit: text usually left, figures right."""

    LEFT = "left"
    RIGHT = "right"


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its header, the row key it shows (for ``cells``), the decimals of a float
    cell, its alignment and its least width (cells are padded to it)."""

    header: str
    key: str = ""
    digits: int = 0
    align: Align = Align.RIGHT
    width: int = 0


def fmt(value: Any, spec: str = ".1f") -> str:
    """A number as text by a format ``spec``, a missing one (None) a dash."""
    return MISSING if value is None else format(value, spec)


def cell(value: Any, digits: int = 0) -> str:
    """A value as a cell: a float to ``digits`` decimals, a missing one (None) a dash."""
    if isinstance(value, float):
        return fmt(value, f".{digits}f")
    return MISSING if value is None else str(value)


def cells(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> list[list[str]]:
    """Each row's cells, the value under each column's ``key`` formatted as it says."""
    return [[cell(row[c.key], c.digits) for c in columns] for row in rows]


def text_table(
    columns: Sequence[Column],
    body: Sequence[Sequence[str]],
    gap: int = 1,
    header: bool = True,
    rule: bool = False,
) -> str:
    """The cells aligned in columns ``gap`` spaces apart, with a header line unless ``header``
    is False (and under it a line of dashes as long, with ``rule``); no borders, no trailing
    spaces."""
    table = Table(
        box=None,
        show_header=header,
        show_edge=False,
        pad_edge=False,
        padding=(0, gap, 0, 0),
        header_style=None,
    )
    for c in columns:
        table.add_column(c.header, justify=c.align.value, min_width=c.width, no_wrap=True)
    for line in body:
        table.add_row(*(Text(v) for v in line))
    out = io.StringIO()
    console = Console(
        file=out, width=_CONSOLE_WIDTH, color_system=None, force_terminal=False, highlight=False
    )
    console.print(table)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    if header and rule:
        lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


_RULES = {Align.LEFT: "---", Align.RIGHT: "---:"}


def _markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(columns: Sequence[Column], body: Sequence[Sequence[str]]) -> str:
    """The cells as a GitHub markdown table under the columns' headers, each column aligned as
    it says."""
    head = [
        _markdown_line([c.header for c in columns]),
        _markdown_line([_RULES[c.align] for c in columns]),
    ]
    return "\n".join(head + [_markdown_line(line) for line in body])
