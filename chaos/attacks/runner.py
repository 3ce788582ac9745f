"""The standing attack suite: every attack of issue 14 against a fresh replica, judged.

For each attack: start a ``zl-replica`` (the suite's limits, :data:`target.SUITE_LIMITS`, plus
the attack's own), start the healthy client beside it and wait for its first answer, sample RSS,
run the attack for its budget, stop the healthy client, wait for ``active`` to return to 0, and
judge (``outcome.judge``). Every process started here is stopped in a ``finally``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from chaos.attacks import connections, floods, streams, tenancy
from chaos.attacks.context import Context, Setup
from chaos.attacks.healthy import HealthyClient, HealthyResult
from chaos.attacks.outcome import SETTLE_TIMEOUT_S, Observed, Outcome, RssBound, judge
from chaos.attacks.target import SUITE_LIMITS, RssSampler, Target

DEFAULT_SECONDS: Final = 3.0


def _no_setup(_: Path) -> Setup:
    return Setup()


@dataclass(frozen=True, slots=True)
class Attack:
    """One attack: its issue item, what it does, and what the replica may hold for it.

    ``connections``: how many connections it keeps open (protocol state each);
    ``buffered``: how many of them it makes the replica buffer for (a connection budget each);
    ``healthy``: whether the healthy client runs beside it (not when the attack kills the
    replica: its lost requests would be the attack's doing, and the attack checks its own).
    """

    name: str
    item: int
    run: Callable[[Context], Observed]
    connections: int = 1
    buffered: int = 1
    limits: Mapping[str, str] = field(default_factory=dict)
    engine: str | None = None
    setup: Callable[[Path], Setup] = _no_setup
    healthy: bool = True

    @property
    def summary(self) -> str:
        return (self.run.__doc__ or "").split("\n\n")[0].replace("\n", " ").strip()


ATTACKS: Final = (
    Attack("rapid-reset", 1, floods.rapid_reset),
    Attack("zero-window", 2, streams.zero_window),
    Attack("ping-ack-blind", 2, streams.ping_ack_blind),
    Attack("h1-pipeline", 2, connections.h1_pipeline),
    Attack("malformed-stream", 3, streams.malformed_stream),
    Attack("excess-streams", 3, streams.excess_streams),
    Attack(
        "continuation-flood",
        4,
        floods.continuation_flood,
        floods.CONTINUATION_CONNECTIONS,
        floods.CONTINUATION_CONNECTIONS,
    ),
    Attack("unfinished-bodies", 4, streams.unfinished_bodies),
    Attack("long-request-ids", 5, streams.long_request_ids),
    Attack("many-tenants", 5, streams.many_tenants),
    Attack("settings-flood", 6, floods.settings_flood),
    Attack("ping-flood", 6, floods.ping_flood),
    Attack("slowloris", 7, connections.slowloris, connections.SLOW_CONNECTIONS, 0),
    Attack(
        "idle-connections",
        7,
        connections.idle_connections,
        connections.SLOW_CONNECTIONS + 8,
        0,
        limits={"max_connections": str(connections.IDLE_CONNECTION_CAP)},
    ),
    Attack(
        "priority-spoof",
        8,
        tenancy.priority_spoof,
        2,
        0,
        engine="sim",
        setup=tenancy.priority_setup,
    ),
    Attack(
        "accounting-sigkill",
        9,
        tenancy.accounting_sigkill,
        engine="null",
        setup=tenancy.accounting_setup,
        healthy=False,
    ),
    Attack("cl-te", 11, connections.cl_te, buffered=0),
    Attack("header-block-70k", 11, connections.header_block_70k, buffered=0),
    Attack("unknown-model", 11, connections.unknown_model, buffered=0),
)
NAMES: Final = tuple(attack.name for attack in ATTACKS)


def select(names: Iterable[str]) -> tuple[Attack, ...]:
    """The attacks named (all when none), in the suite's order; ValueError for an unknown one."""
    wanted = list(names)
    unknown = [name for name in wanted if name not in NAMES]
    if unknown:
        raise ValueError(f"unknown attack {unknown[0]!r}; choose from {', '.join(NAMES)}")
    return tuple(a for a in ATTACKS if not wanted or a.name in wanted)


def run_attack(attack: Attack, seconds: float = DEFAULT_SECONDS, engine: str = "null") -> Outcome:
    """Run one attack against a replica of its own (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix=f"zl-attack-{attack.name}-") as folder:
        workdir = Path(folder)
        setup = attack.setup(workdir)
        if setup.skipped:
            return _skipped(attack, setup.skipped)
        limits = {**SUITE_LIMITS, **attack.limits}
        target = Target(attack.engine or engine, limits, setup.args)
        healthy: HealthyClient | None = None
        try:
            with RssSampler(target.pid) as rss:
                if attack.healthy:
                    healthy = HealthyClient(target.url, api_key=setup.healthy_api_key)
                    healthy.wait_ready()
                before = rss.restart_peak()
                started = time.monotonic()
                observed = attack.run(Context(target, seconds, workdir, setup))
                elapsed = time.monotonic() - started
                result = healthy.stop() if healthy else HealthyResult(0, 0, {})
                active = None if target.killed else target.settle(SETTLE_TIMEOUT_S)
                after = rss.sample()
                peak = rss.peak
            log_tail = target.log_tail()
        finally:
            if healthy is not None:
                healthy.kill()
            target.stop()
    bound = RssBound(attack.connections, attack.buffered, target.limits.connection_buffer_bytes)
    failures = judge(observed, result.ok, result.total, (before, peak, after), bound, active,
                     replica_killed=target.killed, healthy_errors=result.errors)  # fmt: skip
    return Outcome(
        attack=attack.name,
        item=attack.item,
        did=observed.did,
        healthy_ok=result.ok,
        healthy_total=result.total,
        healthy_errors=result.errors,
        rss_before=before,
        rss_peak=peak,
        rss_after=after,
        rss_bound=bound.bytes,
        active_after=active,
        problems=observed.problems,
        seconds=round(elapsed, 2),
        failures=failures,
        replica_log=log_tail if failures else (),
    )


def _skipped(attack: Attack, why: str) -> Outcome:
    return Outcome(attack.name, attack.item, "", 0, 0, {}, 0, 0, 0, 0, None, skipped=why)


def run_suite(
    attacks: Iterable[Attack],
    seconds: float = DEFAULT_SECONDS,
    engine: str = "null",
    progress: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Every attack in turn, each against its own replica; ``progress`` sees each outcome."""
    outcomes = []
    for attack in attacks:
        outcome = run_attack(attack, seconds, engine)
        if progress is not None:
            progress(outcome)
        outcomes.append(outcome)
    return outcomes
