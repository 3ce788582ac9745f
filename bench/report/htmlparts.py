"""The HTML report's building blocks: a table, a cell; shared by its section modules."""

from __future__ import annotations

from html import escape
from typing import Any


def cell(value: Any, fmt: str) -> str:
    if isinstance(value, int | float):
        return fmt.format(value)
    return escape(str(value)) if value is not None else "-"


def table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    head = "".join(
        f"<th class='l'>{h}</th>" if i < left else f"<th>{h}</th>" for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class='l'>{c}</td>" if i < left else f"<td>{c}</td>" for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"
