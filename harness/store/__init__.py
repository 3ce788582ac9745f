"""The results store: every run's records, trials, claims, sweep figures and telemetry
summaries as Parquet files that DuckDB queries in place (``zl-bench history``, the notebook,
researchers' own SQL). The layout and how concurrent writers are kept apart: ``layout``; the
tables and their columns: ``tables``; reading: ``query``."""

from harness.store.layout import (
    STORE_ENV,
    RunTables,
    Store,
    store_path,
    table_of,
)
from harness.store.query import connect
from harness.store.tables import (
    CLAIMS,
    PER_RUN,
    REQUESTS,
    RUNS,
    SWEEPS,
    TABLES,
    TAGS,
    TELEMETRY,
    TRIALS,
    markdown,
)

__all__ = [
    "CLAIMS",
    "PER_RUN",
    "REQUESTS",
    "RUNS",
    "STORE_ENV",
    "SWEEPS",
    "TABLES",
    "TAGS",
    "TELEMETRY",
    "TRIALS",
    "RunTables",
    "Store",
    "connect",
    "markdown",
    "store_path",
    "table_of",
]
