"""The results store's tables: every column with its type, unit and meaning, in one place.

The Parquet files are written with these schemas and read by DuckDB (``harness.store.query``);
``docs/history.md`` shows ``markdown()`` of them (a test keeps the two equal), so the documented
schema is the one written. Metric columns keep vLLM's names (``median_e2el_ms``,
``request_throughput``, ...) as ``summary.json`` does; their definitions are
``harness.metrics``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import pyarrow as pa

from harness.metrics import PERCENTILES, SERIES, percentile_key

STRINGS: Final = pa.list_(pa.string())
UTC_TIME: Final = pa.timestamp("us")  # naive, in UTC

STATS: Final = ("mean", "median", "std", *(percentile_key(p) for p in PERCENTILES))
STAT_COLUMNS: Final = tuple(f"{stat}_{series}_ms" for series in SERIES for stat in STATS)


@dataclass(frozen=True, slots=True)
class Column:
    """One column, or a family of columns of one type and meaning (``names``: the statistics
    of every latency series), shown in the docs as one line under ``name``."""

    name: str
    type: pa.DataType
    unit: str
    doc: str
    names: tuple[str, ...] = ()

    def fields(self) -> list[pa.Field]:
        return [pa.field(name, self.type) for name in self.names or (self.name,)]


@dataclass(frozen=True, slots=True)
class Table:
    """One table: a folder of Parquet files, one per run, all with this schema."""

    name: str
    row: str
    columns: tuple[Column, ...]

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([f for column in self.columns for f in column.fields()])


def _col(name: str, kind: pa.DataType, unit: str, doc: str) -> Column:
    return Column(name, kind, unit, doc)


RUN_ID = _col("run_id", pa.string(), "", "the run's id: its directory's name")

RUNS = Table(
    "runs",
    "run or sweep",
    (
        RUN_ID,
        _col("kind", pa.string(), "", "`run` (zl-bench run) or `sweep` (zl-bench sweep)"),
        _col("path", pa.string(), "", "the run directory, absolute, as indexed"),
        _col("report", pa.string(), "", "its `report.html`, absolute; null where none was written"),
        _col("started", UTC_TIME, "UTC", "when the run started"),
        _col("finished", UTC_TIME, "UTC", "when it recorded its end; null where it never did"),
        _col(
            "end_state",
            pa.string(),
            "",
            "`complete`, `sigint`, `sigterm`, `error` or "
            "`running` (killed, or still going when indexed)",
        ),
        _col("partial", pa.bool_(), "", "not complete, or a file of it could not be read"),
        _col("partial_reasons", STRINGS, "", "why it is partial, in words"),
        _col("scale", pa.string(), "", "`smoke`, `laptop`, `seed` (or a test's own)"),
        _col("engine", pa.string(), "", "the engine kind: `sim`, `null`, `torch`, `vllm`"),
        _col("engine_options", pa.string(), "", "the `--engine-option`s, as a JSON object"),
        _col(
            "model",
            pa.string(),
            "",
            "engine option `model` or `model_shape`, else the model "
            "the capacity preflight named (`llama-3.1-8b` for the sim's default)",
        ),
        _col("profiles", STRINGS, "", "the profiles it ran (a sweep: its one profile)"),
        _col("stacks", STRINGS, "", "the stacks it ran"),
        _col("loader", pa.string(), "", "`native`, `k6` or `locust`"),
        _col("seed", pa.int64(), "", "`--seed`; null: each profile's own"),
        _col("repeats", pa.int64(), "", "`--repeats` asked for; null: the default"),
        _col("git_revision", pa.string(), "", "the suite's commit (`-dirty`: with local edits)"),
        _col("host", pa.string(), "", "the host's name"),
        _col("platform", pa.string(), "", "the host's OS and architecture"),
        _col("cpus", pa.int64(), "", "the host's CPU count"),
        _col(
            "cpu_speed_start",
            pa.int64(),
            "SHA-256 digests/s",
            "one core's speed as the run started (`harness.telemetry.cpu_speed`)",
        ),
        _col("cpu_speed_end", pa.int64(), "SHA-256 digests/s", "the same, as it ended"),
        _col("schema_version", pa.int64(), "", "the results schema version its files were read in"),
        _col("indexed", UTC_TIME, "UTC", "when this row was written"),
        _col("meta_json", pa.string(), "", "`run.json` as read (`harness.schema.RunMeta`)"),
        _col(
            "sweep_json",
            pa.string(),
            "",
            "a sweep's section of `summary.json` without its "
            "points (they are in `trials`); null for a plain run",
        ),
    ),
)

TRIALS = Table(
    "trials",
    "trial: a row of `summary.json` (a stack on a profile in one repeat, or a sweep point)",
    (
        RUN_ID,
        _col("stack", pa.string(), "", "`zerolayer`, `baseline`, `vllm-serve`"),
        _col("profile", pa.string(), "", "the profile's name (`a_latency`, ...)"),
        _col("loader", pa.string(), "", "the loader that drove it"),
        _col("repeat", pa.int64(), "", "the repeat (seed + repeat)"),
        _col("sweep_point", pa.int64(), "", "a sweep point's index; null in a plain run"),
        _col("offered_rate", pa.float64(), "req/s", "the rate the schedule was built for"),
        _col("num_requests", pa.int64(), "requests", "requests sent"),
        _col("completed", pa.int64(), "requests", "requests completed"),
        _col("errors", pa.int64(), "requests", "requests that ended in an error"),
        _col("lost", pa.int64(), "requests", "requests with no answer by deadline + grace"),
        _col("duration", pa.float64(), "s", "first intended send to the last end"),
        _col("request_throughput", pa.float64(), "req/s", "completed requests per second"),
        _col("request_goodput", pa.float64(), "req/s", "completed within every SLO, per second"),
        _col("output_throughput", pa.float64(), "tokens/s", "output tokens per second"),
        _col("total_token_throughput", pa.float64(), "tokens/s", "prompt + output tokens/s"),
        Column(
            "{stat}_{series}_ms",
            pa.float64(),
            "ms",
            "vLLM's statistics of each latency "
            "series: stat `mean`, `median`, `std`, `p50`, `p90`, `p95`, `p99`, `p99.9` "
            '(quote it: `"p99.9_e2el_ms"`); series `ttft`, `tpot`, `itl`, `e2el`, '
            "`ttft_intended`, `e2el_intended`, `client_queue`, `lag`; null where the series "
            "is empty",
            STAT_COLUMNS,
        ),
        _col("slo_met", pa.bool_(), "", "every SLO's percentile within its bound; null: no SLOs"),
        _col("saturated", pa.bool_(), "", "the load was past what the stack serves"),
        _col("valid", pa.bool_(), "", "the row's own verdict: loader on schedule, nothing lost"),
        _col("invalid_reasons", STRINGS, "", "why not valid"),
        _col("host_cpu_pct", pa.float64(), "%", "the host's mean CPU over the trial, all cores"),
        _col("host_busiest_cpu_pct", pa.float64(), "%", "its busiest core"),
        _col("host_speed", pa.float64(), "SHA-256 digests/s", "one core's speed before the trial"),
        _col(
            "decides",
            pa.bool_(),
            "",
            "the trial may decide a comparison: in a plain run, what `zl-bench compare` keeps "
            "(`harness.validity.harness_problems`: loader on schedule, host measured, "
            "unsaturated and steady); in a sweep, a point whose loader kept to its schedule "
            "(`harness.curves.usable`), as its headline figures require",
        ),
        _col("problems", STRINGS, "", "why it may not"),
        _col(
            "records_file",
            pa.string(),
            "",
            "its per-request file, relative to the run directory (`requests.file`)",
        ),
        _col("row_json", pa.string(), "", "the row as `summary.json` holds it, every key"),
    ),
)

REQUESTS = Table(
    "requests",
    "request, as the loader recorded it (`harness.schema.RequestRecord`)",
    (
        RUN_ID,
        _col("file", pa.string(), "", "the records file, relative to the run directory"),
        _col("request_id", pa.string(), "", "the request's id"),
        _col("stack", pa.string(), "", "the stack"),
        _col("profile", pa.string(), "", "the profile"),
        _col("loader", pa.string(), "", "the loader"),
        _col("outcome", pa.string(), "", "`completed`, `error` or `lost`"),
        _col("error_code", pa.string(), "", "the `zl-error` code of an error"),
        _col("http_status", pa.int64(), "", "the HTTP status"),
        _col("intended_start_ns", pa.int64(), "ns since the epoch", "when the schedule said send"),
        _col("dispatch_ns", pa.int64(), "ns since the epoch", "when the loader dispatched it"),
        _col("sent_ns", pa.int64(), "ns since the epoch", "when it went out"),
        _col(
            "first_token_ns", pa.int64(), "ns since the epoch", "its first content chunk; 0: none"
        ),
        _col("end_ns", pa.int64(), "ns since the epoch", "its last byte"),
        _col("chunk_ns", pa.list_(pa.int64()), "ns since the epoch", "every content chunk"),
        _col("prompt_tokens", pa.int64(), "tokens", "prompt length"),
        _col("output_tokens", pa.int64(), "tokens", "tokens received"),
        _col("prompt_bytes", pa.int64(), "bytes", "prompt size"),
        _col("request_class", pa.string(), "", "the workload class"),
        _col("session", pa.string(), "", "`zl-session`"),
        _col("tenant", pa.string(), "", "`zl-tenant`"),
        _col("priority", pa.string(), "", "`zl-priority`"),
        _col("replica", pa.string(), "", "the replica that answered"),
        _col("retries", pa.int64(), "", "client retries before the first token"),
        _col("deadline_ms", pa.int64(), "ms", "`zl-deadline-ms`"),
        _col("engine_ns", pa.int64(), "ns", "time inside the engine, by the stack's accounting"),
        _col("turn", pa.int64(), "", "turn in its session; 0: no turns"),
        _col("attempts", pa.int64(), "", "attempts a retrying layer reported; 0: none"),
        _col(
            "refused_ns",
            pa.int64(),
            "ns since the epoch",
            "its refusal seen; 0: none",
        ),
    ),
)

CLAIMS = Table(
    "claims",
    "seed claim as `claims.json` decided it",
    (
        RUN_ID,
        _col("key", pa.string(), "", "the claim's function (`layer_overhead`, ...)"),
        _col("claim", pa.string(), "", "the claim, in words"),
        _col("claimed", pa.string(), "", "the seed's figure"),
        _col("measured", pa.string(), "", "the measured figure, in words"),
        _col("status", pa.string(), "", "`held`, `not held`, `undecided`, `not measured`"),
        _col("reason", pa.string(), "", "why undecided"),
        _col("trials", pa.int64(), "", "trials it was decided on"),
        _col("figures_json", pa.string(), "", "its intervals (`harness.curves.Interval`), JSON"),
        _col("rule", pa.string(), "", "the rule it was judged by"),
    ),
)

SWEEPS = Table(
    "sweeps",
    "headline figure of one stack in a sweep",
    (
        RUN_ID,
        _col("profile", pa.string(), "", "the profile swept"),
        _col("stack", pa.string(), "", "the stack (`baseline-zerolayer` for the added latency)"),
        _col(
            "figure",
            pa.string(),
            "",
            "`max_goodput`, `knee`, `highest_within_slos` or "
            "`added_latency_rate` (`harness.curves`)",
        ),
        _col("value", pa.float64(), "req/s", "the mean over repeats; null: not measured"),
        _col("low", pa.float64(), "req/s", "its 95 % Student-t interval's low end"),
        _col("high", pa.float64(), "req/s", "its high end"),
        _col("n", pa.int64(), "", "repeats with a value"),
        _col("note", pa.string(), "", "why it is missing or only bounded"),
        _col("stopped", pa.string(), "", "why the stack's sweep stopped"),
    ),
)

TELEMETRY = Table(
    "telemetry",
    "figure of one telemetry source over one phase (from `telemetry.jsonl`)",
    (
        RUN_ID,
        _col("phase", pa.string(), "", "the run phase (`zerolayer/a_latency#1`, `idle`, ...)"),
        _col("source", pa.string(), "", "`engine`, `process`, `nvml`, `host`"),
        _col("stack", pa.string(), "", "the stack it watched ('' for the loader)"),
        _col("name", pa.string(), "", "the engine replica or process"),
        _col("role", pa.string(), "", "a process's role (`replica`, `proxy`, `loader`, ...)"),
        _col(
            "metric",
            pa.string(),
            "",
            "the sample's key (`kv_usage`, `kv_waste`, "
            "`engine_busy`, `gpu_util_pct`, `cpu_pct`, `rss_bytes`, ...)",
        ),
        _col("samples", pa.int64(), "", "samples with a value"),
        _col("mean", pa.float64(), "the metric's", "mean over the phase"),
        _col("max", pa.float64(), "the metric's", "highest"),
        _col("last", pa.float64(), "the metric's", "the phase's last (a counter's total)"),
    ),
)

TAGS = Table(
    "tags",
    "tag (`zl-bench tag RUN NAME`)",
    (
        _col("tag", pa.string(), "", "the name"),
        RUN_ID,
        _col("tagged", UTC_TIME, "UTC", "when it was set"),
        _col("user", pa.string(), "", "who set it"),
    ),
)

TABLES: Final = (RUNS, TRIALS, REQUESTS, CLAIMS, SWEEPS, TELEMETRY, TAGS)
PER_RUN: Final = tuple(t for t in TABLES if t is not TAGS)


def sql_type(kind: pa.DataType) -> str:
    """The type as DuckDB names it when it reads the Parquet file."""
    if pa.types.is_list(kind):
        return sql_type(kind.value_type) + "[]"
    names = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.float64(): "DOUBLE"}
    names |= {pa.bool_(): "BOOLEAN", UTC_TIME: "TIMESTAMP"}
    return names[kind]


def markdown() -> str:
    """The schema as ``docs/history.md`` shows it: a table of tables, then each one's columns."""
    lines = ["| table | one row per |", "|---|---|"]
    lines += [f"| `{t.name}` | {t.row} |" for t in TABLES]
    for table in TABLES:
        lines += [
            "",
            f"**`{table.name}`**",
            "",
            "| column | type | unit | meaning |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{c.name}` | {sql_type(c.type)} | {c.unit} | {c.doc} |" for c in table.columns
        ]
    return "\n".join(lines) + "\n"
