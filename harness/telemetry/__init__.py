"""Telemetry: one sampler, pluggable sources (NVML, engine stats, per-process CPU/RSS), JSONL out.

Every sample lands in ``telemetry.jsonl`` on an absolute schedule with the run phase it fell in,
so the report can line samples up with requests and faults without guessing.
"""

from harness.telemetry.engine import EngineSource, EngineTarget, parse_prometheus
from harness.telemetry.host import (
    HostCpu,
    cpu_speed,
    host_cpu_between,
    measure_host_cpu,
    speed_note,
)
from harness.telemetry.nvml import NvmlSource
from harness.telemetry.process import Component, ProcessSource
from harness.telemetry.sampler import Availability, PhaseLog, Sampler, Source

__all__ = [
    "Availability",
    "Component",
    "EngineSource",
    "EngineTarget",
    "HostCpu",
    "NvmlSource",
    "PhaseLog",
    "ProcessSource",
    "Sampler",
    "Source",
    "cpu_speed",
    "host_cpu_between",
    "measure_host_cpu",
    "parse_prometheus",
    "speed_note",
]
