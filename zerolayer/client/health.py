"""Replica health with hysteresis: one slow ``/health`` poll neither evicts nor restores a replica.

Pure state (no IO): the SDK's poller feeds it one verdict per poll, and a lost connection forces
it down at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_DOWN_AFTER = 2
DEFAULT_UP_AFTER = 2
DEFAULT_MIN_SCORE = 0.05


@dataclass(slots=True)
class Hysteresis:
    """Up/down: ``down_after`` bad verdicts in a row mark it down, ``up_after`` good mark it up.

    Starts up, so a fresh client uses its replicas before the first poll has come back.
    """

    down_after: int = DEFAULT_DOWN_AFTER
    up_after: int = DEFAULT_UP_AFTER
    up: bool = True
    _bad: int = 0
    _good: int = 0

    def __post_init__(self) -> None:
        if self.down_after < 1 or self.up_after < 1:
            raise ValueError("down_after and up_after must be >= 1")

    def observe(self, ok: bool) -> bool:
        """Record one verdict; return whether the state changed."""
        if ok:
            self._bad = 0
            self._good += 1
            if not self.up and self._good >= self.up_after:
                self.up = True
                return True
        else:
            self._good = 0
            self._bad += 1
            if self.up and self._bad >= self.down_after:
                self.up = False
                return True
        return False

    def force_down(self) -> bool:
        """Mark down now (the connection died); it comes back only after ``up_after`` good polls."""
        changed = self.up
        self.up = False
        self._good = 0
        self._bad = self.down_after
        return changed


def healthy(
    status: int, payload: Mapping[str, Any] | None, min_score: float = DEFAULT_MIN_SCORE
) -> bool:
    """Judge one ``/health`` answer: a 200, not draining, and a health score above ``min_score``."""
    if status != 200 or payload is None:
        return False
    if payload.get("draining"):
        return False
    score = payload.get("score", payload.get("health", 1.0))
    return isinstance(score, int | float) and score >= min_score
