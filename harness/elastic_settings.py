"""Profile G's settings (``[elasticity]`` in its TOML, read by ``harness.profile``): apart, so
that the profile module stays one readable file."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ElasticSettings:
    """How profile G changes each stack's replica count at one scale, under the profile's load.

    The load runs ``warmup_s`` (the steady band is measured over it), then one replica joins;
    ``hold_s`` after it took part, one leaves; ``settle_s`` after, the steady-state hypothesis
    is checked again and ``tail_s`` of load follows. ``window_s`` is the rolling window of the
    SLI (``slo_ttft_ms``, ``sli_target``) and of the latency band: the steady median E2EL
    +/- ``band_pct`` percent. ``deadline_ms`` replaces the requests' deadline; ``load_max_s``
    bounds the load; ``ready_timeout_s`` bounds a replica's start and stop. The zero-layer SDK
    reads its discovery file every ``discovery_interval_s`` and a leaving replica is stopped
    ``leave_grace_s`` after it was withdrawn from it (clients stop sending first, as a
    deployment drains an endpoint before it stops the pod).
    """

    warmup_s: float
    hold_s: float
    settle_s: float
    tail_s: float
    window_s: float
    slo_ttft_ms: float
    sli_target: float
    band_pct: float
    deadline_ms: int
    ready_timeout_s: float
    load_max_s: float
    discovery_interval_s: float
    leave_grace_s: float
    health_interval_s: float
    health_timeout_s: float
