"""What one attack found: what the replica did, how the healthy client fared, memory, ``active``.

The bounds an attack is judged by are derived here, in one place:

- healthy success ratio 1.0: every request of the well-behaved client beside the attack
  completes (the issue's bar: one client's abuse costs another client nothing);
- ``active`` back to 0 after the attack's sockets are closed (a reset or abandoned request must
  free its call): waited for as an event, :data:`SETTLE_TIMEOUT_S` only guards against a leak
  that never returns (the attacker's requests ask for an hour's deadline, far past it);
- RSS growth (peak during the attack over the sample just before it) under
  ``RSS_SLACK_BYTES + connections * CONNECTION_STATE_BYTES + buffered * connection_buffer_bytes``:
  what the replica may legitimately hold for the attacker's open connections (protocol state,
  and the per-connection memory budget ``Limits.connection_buffer_bytes`` for each connection
  the attack makes it buffer for), plus the allocator's and interpreter's own noise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

SETTLE_TIMEOUT_S: Final = 60.0
"""How long the suite waits for ``active`` to return to 0 before judging it leaked: a hang guard
(a loaded host makes the replica's timers late, not absent), far past every suite timeout
(:data:`chaos.attacks.target.SUITE_LIMITS`) and the healthy client's deadline, far short of the
hour an attacker's request asks for."""
RSS_SLACK_BYTES: Final = 24 << 20
"""Growth allowed with no attack at all: pymalloc arenas, uvloop buffers and the healthy client's
own requests move a replica's RSS by a few MiB over seconds of steady load."""
CONNECTION_STATE_BYTES: Final = 64 << 10
"""What one open connection may hold without a request: the h2 state machine, two 4 KiB HPACK
tables, and the transport's 64 KiB read buffer at most."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What an attack itself saw: the replica's answer in words, and any attack-specific check
    that failed (a healthy stream on the attacker's connection cut, a slow connection never
    closed, rows lost past the stated bound). ``skipped``: why the attack could not run."""

    did: str
    problems: tuple[str, ...] = ()
    skipped: str = ""


@dataclass(frozen=True, slots=True)
class RssBound:
    """The growth an attack may cause: see the module docstring."""

    connections: int
    buffered: int
    connection_buffer_bytes: int

    @property
    def bytes(self) -> int:
        return (
            RSS_SLACK_BYTES
            + self.connections * CONNECTION_STATE_BYTES
            + self.buffered * self.connection_buffer_bytes
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """One attack's result: see the module docstring for what passes."""

    attack: str
    item: int
    did: str
    healthy_ok: int
    healthy_total: int
    healthy_errors: dict[str, int]
    rss_before: int
    rss_peak: int
    rss_after: int
    rss_bound: int
    active_after: int | None
    problems: tuple[str, ...] = ()
    skipped: str = ""
    seconds: float = 0.0
    failures: tuple[str, ...] = field(default=())
    replica_log: tuple[str, ...] = ()
    """The replica's last log lines, kept only when the attack failed: why a connection went."""

    @property
    def passed(self) -> bool:
        return not self.skipped and not self.failures

    @property
    def verdict(self) -> str:
        return "skip" if self.skipped else ("pass" if self.passed else "FAIL")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "verdict": self.verdict}

    def line(self) -> str:
        """One progress line: the verdict, what the replica did, and the numbers judged."""
        if self.skipped:
            return f"{self.attack:<20} skip  {self.skipped}"
        active = "gone" if self.active_after is None else str(self.active_after)
        text = (
            f"{self.attack:<20} {self.verdict:<4}  {self.did}; healthy "
            f"{self.healthy_ok}/{self.healthy_total}; RSS {mib(self.rss_before)} -> "
            f"{mib(self.rss_after)} (peak {mib(self.rss_peak)}, bound "
            f"+{mib(self.rss_bound)}); active {active}"
        )
        text += "".join(f"\n{'':<26}- {failure}" for failure in self.failures)
        if self.replica_log:
            text += f"\n{'':<26}replica's log, last lines:"
            text += "".join(f"\n{'':<28}{line}" for line in self.replica_log)
        return text


def judge(
    observed: Observed,
    healthy_ok: int,
    healthy_total: int,
    rss: tuple[int, int, int],
    bound: RssBound,
    active_after: int | None,
    *,
    replica_killed: bool = False,
    healthy_errors: Mapping[str, int] | None = None,
) -> tuple[str, ...]:
    """Every bound the outcome misses, in words (empty: it passes)."""
    before, peak, _ = rss
    failures = list(observed.problems)
    if healthy_ok != healthy_total:
        why = ", ".join(f"{count} x {code}" for code, count in (healthy_errors or {}).items())
        failures.append(
            f"healthy client: {healthy_ok} of {healthy_total} requests completed"
            + (f" ({why})" if why else "")
        )
    if peak - before > bound.bytes:
        failures.append(f"RSS grew {mib(peak - before)}, bound {mib(bound.bytes)}")
    if not replica_killed and active_after != 0:
        failures.append(f"active is {active_after}, not 0, {SETTLE_TIMEOUT_S:g} s after the attack")
    return tuple(failures)


def mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
