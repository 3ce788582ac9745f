"""Engine source: load, KV occupancy, KV waste, allocator fragmentation and the prefix cache's
cumulative counters (``prefix_cache_queries``/``prefix_cache_hits``, tokens) per replica.

A replica is read either in-process (``Engine.stats()``) or over HTTP from its ``/metrics``
(Prometheus text, vLLM's metric names) or ``/health`` (JSON). In-process is exact; the HTTP forms
are what a run against separate replica processes, or a stack started elsewhere, can reach.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harness.schema import read_jsonl
from harness.telemetry.sampler import Availability
from serving.engine.settings import SETTINGS_INFO, EngineSettings, settings_from_labels
from serving.engine.types import Engine, EngineStats

# Prometheus names a replica exports -> row keys. vLLM's names first (kv_cache_usage_perc is a
# fraction in vLLM despite its name); the zl_ ones carry what vLLM has no name for.
SNAPSHOT_NS = "snapshot_ns"
PROMETHEUS_KEYS: dict[str, str] = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "zl_kv_waste_ratio": "kv_waste",
    "zl_kv_live_tokens": "live_tokens",
    "zl_kv_blocks_used": "kv_blocks_used",
    "zl_kv_blocks_total": "kv_blocks_total",
    "zl_engine_busy_seconds_total": "busy_time_s",
    "zl_allocator_inactive_split_bytes": "alloc_inactive_split_bytes",
    "zl_allocator_reserved_bytes": "alloc_reserved_bytes",
    "zl_requests_total": "requests_total",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}
# Info gauges (1, with what they say in their labels) that carry an engine's effective settings:
# the zero-layer replica's own, and vLLM's cache config (its label names -> the settings').
VLLM_CACHE_INFO = "vllm:cache_config_info"
VLLM_CACHE_LABELS: dict[str, str] = {
    "block_size": "block_size",
    "num_gpu_blocks": "kv_blocks",
    "enable_prefix_caching": "prefix_caching",
}
SETTINGS_KEY = "settings"
HEALTH_KEYS: dict[str, str] = {
    "kv_usage": "kv_usage",
    "kv_waste": "kv_waste",
    "running": "running",
    "waiting": "waiting",
    "queue_depth": "waiting",
    "preemptions": "preemptions",
}
_ALLOCATOR_KEYS = {
    "alloc_inactive_split_bytes": ("inactive_split_bytes", "inactive_split_bytes.all.current"),
    "alloc_reserved_bytes": ("reserved_bytes", "reserved_bytes.all.current"),
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value}, summing a name's labelled series."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):  # an unknown figure (NaN) is left out, never summed into a number
            continue
        out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"n": "\n", "\\": "\\", '"': '"'}


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), m.group(1)), value)


def parse_info(text: str, metric: str) -> list[dict[str, str]]:
    """The label sets of info gauge ``metric`` in Prometheus text, one per series."""
    found = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith(metric + "{"):
            labels = line[len(metric) + 1 :].rpartition("}")[0]
            found.append({k: _unescape(v) for k, v in _LABEL.findall(labels)})
    return found


def metrics_settings(text: str) -> EngineSettings:
    """The effective settings a ``/metrics`` page publishes: the zero-layer replica's info
    gauge, else vLLM's cache config (block size, KV blocks, prefix caching); nothing known
    where the page has neither."""
    ours = parse_info(text, SETTINGS_INFO)
    if ours:
        return settings_from_labels(ours[0])
    vllm = parse_info(text, VLLM_CACHE_INFO)
    if not vllm:
        return EngineSettings()
    return settings_from_labels(
        {VLLM_CACHE_LABELS[k]: v for k, v in vllm[0].items() if k in VLLM_CACHE_LABELS}
    )


def read_metrics_settings(
    url: str, timeout_s: float = 5.0, tls_ca: Path | None = None
) -> EngineSettings:
    """:func:`metrics_settings` of the ``/metrics`` page at ``url``."""
    return metrics_settings(http_get(url, timeout_s, tls_ca).decode())


def read_stats_file_settings(path: str | Path) -> EngineSettings:
    """The settings an engine replica published with its newest stats snapshot (nothing known
    where it published none)."""
    return EngineSettings(**_last_json_line(Path(path)).get(SETTINGS_KEY, {}))


def stats_row(stats: EngineStats) -> dict[str, Any]:
    """An EngineStats snapshot as a telemetry row (KV figures as fractions, allocator in bytes)."""
    row: dict[str, Any] = {
        "running": stats.running,
        "waiting": stats.waiting,
        "kv_usage": stats.kv_usage,
        "kv_waste": stats.kv_waste,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "live_tokens": stats.live_tokens,
        "preemptions": stats.preemptions,
        "busy_time_s": stats.busy_time_s,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
    }
    for key, names in _ALLOCATOR_KEYS.items():
        for name in names:
            if name in stats.allocator:
                row[key] = float(stats.allocator[name])
                break
    return row


def phase_rows(path: str | Path, stack: str, phase: str) -> list[dict[str, Any]]:
    """One stack's engine rows sampled during ``phase``, in time order, from telemetry.jsonl
    (the sampler may be appending: a torn last line is skipped)."""
    if not Path(path).exists():
        return []
    return [
        row
        for row in read_jsonl(path)
        if row.get("source") == EngineSource.kind
        and row.get("stack") == stack
        and row.get("phase") == phase
    ]


def named_reads(reads: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``{replica: row}`` (``Telemetry.last_reads``) as rows named like the sampler's."""
    return [{"name": name, **row} for name, row in reads.items()]


def _last_json_line(path: Path, tail_bytes: int = 8192) -> dict[str, Any]:
    """The newest complete JSON line of an append-only file, without reading all of it."""
    with open(path, "rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - tail_bytes))
        lines = fh.read().splitlines()
    for line in reversed(lines):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        return data
    raise ValueError(f"no stats snapshot in {path} yet")


def http_get(url: str, timeout_s: float, tls_ca: Path | None = None) -> bytes:
    """GET over HTTP/1.1; over TLS it trusts ``tls_ca`` (a stack's own certificate) if given."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        ctx = ssl.create_default_context(cafile=None if tls_ca is None else str(tls_ca))
        conn = http.client.HTTPSConnection(host, parts.port, timeout=timeout_s, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path or "/")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"GET {url} answered {resp.status}")
        return body
    finally:
        conn.close()


@dataclass
class EngineTarget:
    """One replica to read: its name, the stack it belongs to, and how to read it."""

    name: str
    stack: str
    read: Callable[[], dict[str, Any]]
    how: str = "in-process"

    @classmethod
    def in_process(cls, name: str, stack: str, engine: Engine) -> EngineTarget:
        return cls(name, stack, lambda: stats_row(engine.stats()), "in-process")

    @classmethod
    def metrics(
        cls,
        name: str,
        stack: str,
        url: str,
        timeout_s: float = 1.0,
        tls_ca: Path | None = None,
    ) -> EngineTarget:
        """Scrape a Prometheus ``/metrics`` URL (over TLS trusting ``tls_ca`` when given)."""

        def read() -> dict[str, Any]:
            values = parse_prometheus(http_get(url, timeout_s, tls_ca).decode())
            return {key: values[prom] for prom, key in PROMETHEUS_KEYS.items() if prom in values}

        return cls(name, stack, read, url)

    @classmethod
    def stats_file(cls, name: str, stack: str, path: str | Path) -> EngineTarget:
        """The last snapshot a replica published to its stats JSONL (the Ray Serve baseline's
        engine replicas publish at every health check, about once a second)."""
        path = Path(path)

        def read() -> dict[str, Any]:
            data = _last_json_line(path)
            data.pop(SETTINGS_KEY, None)
            t_ns = data.pop("t_ns")
            return {**stats_row(EngineStats(**data)), SNAPSHOT_NS: t_ns}

        return cls(name, stack, read, str(path))

    @classmethod
    def health(cls, name: str, stack: str, url: str, timeout_s: float = 1.0) -> EngineTarget:
        """Read a JSON ``/health`` URL (fewer figures than /metrics, but every replica has it)."""

        def read() -> dict[str, Any]:
            body = json.loads(http_get(url, timeout_s))
            return {key: body[name] for name, key in HEALTH_KEYS.items() if name in body}

        return cls(name, stack, read, url)


@dataclass
class EngineSource:
    """Rows per replica with KV occupancy, KV waste, the allocator's split ratio and busy share.

    ``engine_busy`` (the fraction of wall time the engine was stepping since the last sample) is
    the sim engine's stand-in for GPU utilisation when NVML has nothing to say.
    """

    targets: list[EngineTarget] = field(default_factory=list)
    kind: str = "engine"
    _last_busy: dict[int, tuple[int, float]] = field(default_factory=dict)

    def add(self, target: EngineTarget) -> None:
        """Register a replica started after sampling began."""
        self.targets = [*self.targets, target]

    def drop_stack(self, stack: str) -> None:
        """Stop reading a stack's replicas (it was torn down; its ports may be reused)."""
        self.targets = [t for t in self.targets if t.stack != stack]

    def open(self) -> Availability:
        return Availability(True)

    def read(self) -> list[dict[str, Any]]:
        rows = []
        for target in list(self.targets):
            base = {"name": target.name, "stack": target.stack}
            try:
                row = target.read()
            except Exception as exc:  # one replica's bad answer must not hide the others'
                rows.append({**base, "up": 0, "error": f"{type(exc).__name__}: {exc}"})
                continue
            # a published snapshot carries its own time; a scraped one is taken now
            now = row.pop(SNAPSHOT_NS, None) or time.monotonic_ns()
            if "busy_time_s" in row:
                last = self._last_busy.get(id(target))
                # a counter that went backwards is a restarted engine: start a new baseline
                if last is not None and now > last[0] and row["busy_time_s"] >= last[1]:
                    row["engine_busy"] = (row["busy_time_s"] - last[1]) / ((now - last[0]) / 1e9)
                if last is None or now > last[0]:
                    self._last_busy[id(target)] = (now, row["busy_time_s"])
            inactive = row.get("alloc_inactive_split_bytes")
            reserved = row.get("alloc_reserved_bytes")
            if inactive is not None and reserved:
                row["alloc_split_ratio"] = inactive / reserved
            rows.append({**base, "up": 1, **row})
        return rows

    def describe(self) -> dict[str, Any]:
        return {"targets": [{"name": t.name, "stack": t.stack, "how": t.how} for t in self.targets]}

    def close(self) -> None:
        self._last_busy.clear()
