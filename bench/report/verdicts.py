"""A verdict from an interval over trials: held, not held, or undecided with its reason.

One rule for every claim (``harness.validity.RULE``): held or not held only when the whole
interval lies on one side of the threshold; an interval across a threshold, or too few valid
trials, is undecided; a claim with nothing measured at all is not measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from harness.curves import Interval

SPANS: Final = "the interval over trials spans the threshold"


class Status(StrEnum):
    """A claim's verdict; ``css`` is its class name in the HTML report."""

    HELD = "held"
    NOT_HELD = "not held"
    UNDECIDED = "undecided"
    NOT_MEASURED = "not measured"

    @property
    def css(self) -> str:
        return self.name.lower().replace("_", "-")


@dataclass(frozen=True, slots=True)
class Band:
    """The held side of a rule's threshold: figures from ``low`` to ``high`` (None: no upper
    bound; None rather than infinity so that ``claims.json`` holds it as JSON)."""

    low: float
    high: float | None = None

    def text(self) -> str:
        return f">= {self.low:g}" if self.high is None else f"{self.low:g} to {self.high:g}"


def decide(figure: Interval, band: Band) -> Status:
    """Held when the whole interval lies in the band, not held when it lies wholly outside on
    one side, undecided when it crosses a threshold; not measured without a figure."""
    if figure.value is None or figure.low is None or figure.high is None:
        return Status.NOT_MEASURED
    high = math.inf if band.high is None else band.high
    if band.low <= figure.low and figure.high <= high:
        return Status.HELD
    if figure.high < band.low or figure.low > high:
        return Status.NOT_HELD
    return Status.UNDECIDED


def combine(statuses: Sequence[Status]) -> Status:
    """A rule that needs every part held: one part surely short decides it; any part not
    measured leaves it not measured; otherwise held only when every part is."""
    if Status.NOT_HELD in statuses:
        return Status.NOT_HELD
    if Status.NOT_MEASURED in statuses:
        return Status.NOT_MEASURED
    return Status.HELD if all(s is Status.HELD for s in statuses) else Status.UNDECIDED
