"""``/health`` (JSON) and ``/metrics`` (Prometheus text) for one replica.

Metric names follow vLLM's where vLLM has the figure (``vllm:kv_cache_usage_perc``,
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:num_preemptions_total``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``), so dashboards built for vLLM
read a replica unchanged; what only the zero-layer replica has is under ``zl_``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sized
from typing import Final, Protocol

import orjson

from serving.engine.settings import (
    SETTINGS_INFO,
    EngineSettings,
    engine_settings,
    settings_labels,
)
from serving.engine.types import Engine, EngineStats
from zerolayer.accounting import Accounting
from zerolayer.scheduler import SchedulerConfig

METRICS_TYPE: Final = b"text/plain; version=0.0.4; charset=utf-8"
KV_PRESSURE_FROM: Final = 0.8
ALLOCATOR_METRICS: Final = {
    "inactive_split_bytes": "zl_allocator_inactive_split_bytes",
    "reserved_bytes": "zl_allocator_reserved_bytes",
}


class Observed(Protocol):
    """What ``/health`` and ``/metrics`` read of a replica (``core.ReplicaCore``, which calls
    them)."""

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def config(self) -> SchedulerConfig: ...
    @property
    def queue(self) -> Sized: ...
    @property
    def accounting(self) -> Accounting: ...
    @property
    def draining(self) -> bool: ...
    @property
    def active(self) -> int: ...
    @property
    def connections(self) -> int: ...
    @property
    def refused_connections(self) -> int: ...
    @property
    def prompt_tokens_total(self) -> int: ...
    @property
    def generation_tokens_total(self) -> int: ...
    @property
    def refusals(self) -> Counter[str]: ...
    @property
    def failures(self) -> Counter[str]: ...
    @property
    def outcomes(self) -> Counter[str]: ...


def health(replica: Observed) -> dict[str, object]:
    """The replica's published health.

    ``health`` (also as ``score``) is 1.0 for an idle replica and falls to 0 as KV usage climbs
    from 80 % to 100 % or the queue fills towards the ``normal`` class's bound; 0 while draining.
    """
    stats = replica.engine.stats()
    queued = len(replica.queue)
    depth = stats.waiting + queued
    kv = stats.kv_usage if replica.config.kv_watermarks is not None else 0.0
    kv_pressure = min(1.0, max(0.0, (kv - KV_PRESSURE_FROM) / (1.0 - KV_PRESSURE_FROM)))
    queue_pressure = min(1.0, depth / max(1, replica.config.max_queue[1]))
    score = 0.0 if replica.draining else round(1.0 - max(kv_pressure, queue_pressure), 4)
    return {
        "status": "draining" if replica.draining else "ok",
        "health": score,
        "score": score,
        "kv_usage": round(kv, 6),
        "queue_depth": depth,
        "queued": queued,
        "running": stats.running,
        "waiting": stats.waiting,
        "active": replica.active,
        "draining": replica.draining,
        "replica": replica.name,
        "model": replica.model,
        "engine": replica.engine.name,
    }


def health_body(replica: Observed) -> bytes:
    return orjson.dumps(health(replica))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_text(replica: Observed) -> bytes:
    """The Prometheus exposition of the replica's gauges and counters."""
    stats = replica.engine.stats()
    queued = len(replica.queue)
    lines = vllm_metrics(replica, stats, queued)
    lines += replica_metrics(replica, stats, queued)
    lines += outcome_metrics(replica)
    for key, name in ALLOCATOR_METRICS.items():
        if key in stats.allocator:
            lines += [f"# TYPE {name} gauge", f"{name} {stats.allocator[key]}"]
    lines += accounting_metrics(replica.accounting)
    lines += settings_metrics(engine_settings(replica.engine))
    return ("\n".join(lines) + "\n").encode()


def _metric(name: str, kind: str, text: str, value: object, labels: str = "") -> list[str]:
    """One metric's HELP, TYPE and sample lines; a figure the engine does not have is NaN, as
    Prometheus spells an unknown value."""
    shown = "NaN" if value is None else value
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{labels} {shown}"]


def vllm_metrics(replica: Observed, stats: EngineStats, queued: int) -> list[str]:
    """The figures vLLM has too, under its names and its ``model_name`` label."""
    model = f'{{model_name="{_escape(replica.model)}"}}'
    return [
        *_metric("vllm:kv_cache_usage_perc", "gauge",
                 "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage, model),
        *_metric("vllm:num_requests_running", "gauge",
                 "Number of requests in model execution batches.", stats.running, model),
        *_metric("vllm:num_requests_waiting", "gauge",
                 "Number of requests waiting to be processed.", stats.waiting + queued, model),
        *_metric("vllm:num_preemptions_total", "counter",
                 "Cumulative number of preemption from the engine.", stats.preemptions, model),
        *_metric("vllm:prefix_cache_queries_total", "counter",
                 "Prefix cache queries, in terms of number of queried tokens.",
                 stats.prefix_cache_queries, model),
        *_metric("vllm:prefix_cache_hits_total", "counter",
                 "Prefix cache hits, in terms of number of cached tokens.",
                 stats.prefix_cache_hits, model),
        *_metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                 replica.prompt_tokens_total, model),
        *_metric("vllm:generation_tokens_total", "counter",
                 "Number of generation tokens processed.", replica.generation_tokens_total, model),
    ]  # fmt: skip


def replica_metrics(replica: Observed, stats: EngineStats, queued: int) -> list[str]:
    """The zero-layer replica's own gauges: its queue, connections, drain and KV detail."""
    return [
        *_metric("zl_queue_depth", "gauge",
                 "Requests admitted by the replica and waiting for engine room.", queued),
        *_metric("zl_active_requests", "gauge", "Requests admitted and not finished.",
                 replica.active),
        *_metric("zl_connections", "gauge", "Open client connections.", replica.connections),
        *_metric("zl_refused_connections_total", "counter",
                 "Connections closed at once for being past the cap.",
                 replica.refused_connections),
        *_metric("zl_draining", "gauge", "1 while the replica drains.", int(replica.draining)),
        *_metric("zl_kv_waste_ratio", "gauge",
                 "KV internal fragmentation: 1 - live tokens / used capacity.", stats.kv_waste),
        *_metric("zl_kv_live_tokens", "gauge", "Tokens held in the KV cache.",
                 stats.live_tokens),
        *_metric("zl_kv_blocks_used", "gauge", "KV blocks in use.", stats.kv_blocks_used),
        *_metric("zl_kv_blocks_total", "gauge", "KV blocks the engine has.",
                 stats.kv_blocks_total),
        *_metric("zl_engine_busy_seconds_total", "counter",
                 "Time the engine spent running steps.", stats.busy_time_s),
    ]  # fmt: skip


def settings_metrics(settings: EngineSettings) -> list[str]:
    """The engine's effective settings as one info gauge; nothing for an engine with none."""
    labels = settings_labels(settings)
    if not labels:
        return []
    text = ",".join(f'{name}="{_escape(value)}"' for name, value in labels.items())
    return _metric(
        SETTINGS_INFO, "gauge", "The engine's effective settings (in the labels).", 1, f"{{{text}}}"
    )


def outcome_metrics(replica: Observed) -> list[str]:
    """Refusals and failures by error code, and generation requests by outcome."""
    lines = [
        "# HELP zl_refusals_total Requests answered with an error before any output, by code.",
        "# TYPE zl_refusals_total counter",
    ]
    lines += [f'zl_refusals_total{{code="{c}"}} {n}' for c, n in sorted(replica.refusals.items())]
    lines += [
        "# HELP zl_failures_total Streams ended by an error after output started, by code.",
        "# TYPE zl_failures_total counter",
    ]
    lines += [f'zl_failures_total{{code="{c}"}} {n}' for c, n in sorted(replica.failures.items())]
    lines += [
        "# HELP zl_requests_total Generation requests by outcome.",
        "# TYPE zl_requests_total counter",
    ]
    lines += [
        f'zl_requests_total{{outcome="{o}"}} {n}' for o, n in sorted(replica.outcomes.items())
    ]
    return lines


def accounting_metrics(accounting: Accounting) -> list[str]:
    """Where the accounting rows are (written, queued, lost) and how many tenants it tracks."""
    return [
        "# HELP zl_accounting_rows_written_total Accounting rows written to the file.",
        "# TYPE zl_accounting_rows_written_total counter",
        f"zl_accounting_rows_written_total {accounting.flushed}",
        "# HELP zl_accounting_rows_queued Accounting rows not written yet (a SIGKILL loses them).",
        "# TYPE zl_accounting_rows_queued gauge",
        f"zl_accounting_rows_queued {accounting.queued}",
        "# HELP zl_accounting_dropped_total Accounting rows lost: pushed out of a full ring "
        "buffer, or unwritable at exit.",
        "# TYPE zl_accounting_dropped_total counter",
        f"zl_accounting_dropped_total {accounting.dropped}",
        "# HELP zl_accounting_write_errors_total Failed writes of the accounting file (each "
        "retried).",
        "# TYPE zl_accounting_write_errors_total counter",
        f"zl_accounting_write_errors_total {accounting.write_errors}",
        "# HELP zl_accounting_fsync_errors_total Failed fsyncs of the accounting file.",
        "# TYPE zl_accounting_fsync_errors_total counter",
        f"zl_accounting_fsync_errors_total {accounting.fsync_errors}",
        "# HELP zl_accounting_tenants Tenants with their own running totals (at most max_tenants).",
        "# TYPE zl_accounting_tenants gauge",
        f"zl_accounting_tenants {len(accounting.totals)}",
        "# HELP zl_accounting_tenants_folded_total Least recently seen tenants whose totals "
        "were folded into one 'other' row.",
        "# TYPE zl_accounting_tenants_folded_total counter",
        f"zl_accounting_tenants_folded_total {accounting.folded}",
    ]
