"""What ``zl-bench compare`` needs for plain runs and sweeps alike: a compared metric, B - A and
the relative change, and the plain-text table both print. Its own module so that compare
(plain runs) and compare_sweep (sweeps) share one copy with no import cycle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final

from pydantic import PlainSerializer

from harness import tables


def _name(member: Enum) -> str:
    return member.name.lower()


# compare's JSON names a flag or verdict by its lower-case name ("regression", "unmeasured").
BY_NAME: Final = PlainSerializer(_name, return_type=str)


@dataclass(frozen=True, slots=True)
class Metric:
    """A compared metric: its summary key, the series it is a statistic of, and its direction."""

    key: str
    series: str
    higher_is_better: bool = False
    min_abs_change: float = 0.0


def difference(a: float | None, b: float | None) -> float | None:
    """B - A; None when either was not measured."""
    return None if a is None or b is None else b - a


def relative_change(a: float | None, b: float | None) -> float | None:
    """Relative change B vs A (inf when A is 0 and B is not; None when not measured)."""
    diff = difference(a, b)
    if diff is None or a is None:
        return None
    if a:
        return diff / abs(a)
    return 0.0 if not diff else math.inf


def format_value(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def change_text(change: float | None) -> str:
    return "n/a" if change is None or math.isinf(change) else f"{change:+.1%}"


def text_table(lines: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart; the first line is the header."""
    columns = [tables.Column(h, align=tables.Align.LEFT) for h in lines[0]]
    return tables.text_table(columns, lines[1:], gap=2)
