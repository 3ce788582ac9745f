"""The store read through DuckDB: an in-memory database with one view per table over the
store's Parquet files, evaluated at each query (a run filed meanwhile shows in the next one).

A table with no file yet is an empty table of its schema, so every query of the docs runs on a
new store too. ``union_by_name`` reads files written with fewer columns (a later version of a
table adds columns; the old files read them as null).
"""

from __future__ import annotations

import duckdb

from harness.store.layout import Store
from harness.store.tables import TABLES


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def connect(store: Store) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection on ``store`` (UsageError where there is none)."""
    store.check()
    con = duckdb.connect()
    for table in TABLES:
        if store.files(table):
            pattern = _quoted(str(store.folder(table) / "*.parquet"))
            con.execute(
                f"CREATE VIEW {table.name} AS SELECT * FROM "
                f"read_parquet({pattern}, union_by_name = true)"
            )
        else:
            con.register(table.name, table.schema.empty_table())
    return con
