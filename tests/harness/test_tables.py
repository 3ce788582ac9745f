"""The one table renderer: aligned text (rich, no borders) and markdown, a dash for a missing
figure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from harness.tables import MISSING, Align, Column, cell, cells, fmt, markdown_table, text_table

COLUMNS = (
    Column("target", "target", align=Align.LEFT),
    Column("n", "n"),
    Column("p50", "p50", 3),
)


def test_cells_format_floats_to_their_digits_and_missing_as_a_dash() -> None:
    rows = [{"target": "inproc", "n": 20, "p50": 1.23456}, {"target": "x", "n": 0, "p50": None}]
    assert cells(rows, COLUMNS) == [["inproc", "20", "1.235"], ["x", "0", "-"]]
    assert cell(0.0, 1) == "0.0" and cell(None) == "-" and cell("yes") == "yes"


def test_text_is_aligned_first_column_left_figures_right_one_space_apart() -> None:
    body = [["inproc", "20", "1.235"], ["zerolayer+auth", "1", "-"]]
    assert text_table(COLUMNS, body).splitlines() == [
        "target          n   p50",
        "inproc         20 1.235",
        "zerolayer+auth  1     -",
    ]


def test_gap_least_width_no_header_and_no_markup() -> None:
    columns = (Column("a", align=Align.LEFT), Column("b", align=Align.LEFT, width=4), Column("c"))
    text = text_table(columns, [["[bold]x", "y", ""]], gap=2, header=False)
    assert text == "[bold]x  y"
    assert text_table(columns, [], gap=2) == "a  b     c"
    assert text_table(columns, [["x", "y", "z"]], rule=True).splitlines() == [
        "a b    c",
        "--------",
        "x y    z",
    ]


@given(st.lists(st.tuples(st.text("abc", min_size=1, max_size=12), st.integers(0, 10**6))))
def test_every_line_puts_each_column_at_the_same_place(pairs: list[tuple[str, int]]) -> None:
    columns = (Column("name", align=Align.LEFT), Column("value"))
    lines = text_table(columns, [[name, str(v)] for name, v in pairs]).splitlines()
    assert len(lines) == len(pairs) + 1
    assert len({len(line) for line in lines}) == 1, "the right-aligned column ends together"
    for line, (name, v) in zip(lines[1:], pairs, strict=True):
        assert line.startswith(name + " ") and line.endswith(str(v))


def test_markdown_has_a_header_a_rule_and_a_line_per_row() -> None:
    assert markdown_table(COLUMNS, [["inproc", "20", "-"]]).splitlines() == [
        "| target | n | p50 |",
        "| --- | ---: | ---: |",
        "| inproc | 20 | - |",
    ]


def test_fmt_formats_by_spec_and_shows_a_missing_value_as_the_cells_dash() -> None:
    assert fmt(None) == MISSING == cell(None)
    assert fmt(1.25) == "1.2" and fmt(1.234, ".2f") == "1.23" and fmt(0.5, ".0%") == "50%"
    assert fmt(600, ".1f") == "600.0"  # an int read from JSON formats as the float it stands for
