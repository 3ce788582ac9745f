"""The results store on disk: a directory of Parquet files that DuckDB reads in place.

::

    <store>/store.json                    {"store_version": 1}
    <store>/<table>/<run-id>.parquet      one file per run for each table but tags
    <store>/tags/<name>.parquet           one file per tag
    <store>/locks/<run-id>.lock           held while that run's files are replaced

Why files and not one database file: the store may sit on shared storage with several people's
runs writing into it at once, and a DuckDB database file has one writer at a time. Here no two
runs ever write the same file; each file is written beside its place under a name of its own and
renamed over it (``os.replace``: a reader sees the old file or the new one, never a torn one);
two writers of one run (a run's own hook and ``zl-bench index``) take that run's lock
(``fcntl.flock``) in turn, so a run's tables are all one writer's. Readers take no lock. A store
of an older layout is rebuilt by ``zl-bench index``, since the run directories stay the source
of truth.
"""

from __future__ import annotations

import fcntl
import getpass
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from harness.errors import UsageError
from harness.store.tables import CLAIMS, PER_RUN, REQUESTS, RUNS, SWEEPS, TAGS, TELEMETRY, TRIALS
from harness.store.tables import Table as TableSpec

STORE_ENV: Final = "ZL_BENCH_STORE"
STORE_DIR: Final = "store"
STORE_VERSION: Final = 1
VERSION_FILE: Final = "store.json"
LOCKS: Final = "locks"
_TAG_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def store_path(results: str | Path, given: str | Path | None = None) -> Path:
    """Where the store is: ``given`` (``--store``), else ``$ZL_BENCH_STORE`` (a store shared by
    several results directories), else ``<results>/store``."""
    chosen = given or os.environ.get(STORE_ENV) or Path(results) / STORE_DIR
    return Path(chosen).expanduser().resolve()


@dataclass(frozen=True, slots=True)
class RunTables:
    """One run's rows of every per-run table, each with its table's schema."""

    runs: pa.Table
    trials: pa.Table
    requests: pa.Table
    claims: pa.Table
    sweeps: pa.Table
    telemetry: pa.Table

    def of(self, table: TableSpec) -> pa.Table:
        return {
            RUNS.name: self.runs,
            TRIALS.name: self.trials,
            REQUESTS.name: self.requests,
            CLAIMS.name: self.claims,
            SWEEPS.name: self.sweeps,
            TELEMETRY.name: self.telemetry,
        }[table.name]


def table_of(spec: TableSpec, rows: list[dict[str, object]]) -> pa.Table:
    """``rows`` as a table of ``spec``'s schema; a row whose keys are not exactly the schema's
    is a bug in whoever built it (arrow would fill a misspelt column with nulls in silence)."""
    names = set(spec.schema.names)
    for row in rows:
        if set(row) != names:
            wrong = sorted(set(row) ^ names)
            raise ValueError(f"{spec.name}: columns {wrong} do not match the table's schema")
    return pa.Table.from_pylist(rows, schema=spec.schema)


def _write_atomic(path: Path, table: pa.Table) -> None:
    """``table`` at ``path`` whole or not at all: written under a name no other writer uses,
    synced, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _user() -> str:
    """Who is setting a tag ('' where the system cannot say)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def _file_name(key: str, suffix: str = ".parquet") -> str:
    """A run id or tag as a file name; one that could escape its folder is refused."""
    if not key or "/" in key or key.startswith(".") or "\0" in key:
        raise ValueError(f"{key!r} cannot name a file in the results store")
    return key + suffix


@dataclass(frozen=True, slots=True)
class Store:
    """A results store at ``root`` (see the module docstring for the layout)."""

    root: Path

    def folder(self, table: TableSpec) -> Path:
        return self.root / table.name

    def files(self, table: TableSpec) -> list[Path]:
        folder = self.folder(table)
        return sorted(folder.glob("*.parquet")) if folder.is_dir() else []

    def exists(self) -> bool:
        return (self.root / VERSION_FILE).is_file()

    def check(self) -> None:
        """UsageError unless a store of this version is here."""
        if not self.exists():
            raise UsageError(
                f"no results store at {self.root}: run zl-bench index RESULTS_DIR to build one"
            )
        try:
            found = orjson.loads((self.root / VERSION_FILE).read_bytes()).get("store_version")
        except (orjson.JSONDecodeError, AttributeError):
            found = "unreadable"
        if found != STORE_VERSION:
            raise UsageError(
                f"{self.root}: results store version {found!r}, but this zl-bench reads version "
                f"{STORE_VERSION}: rebuild it with zl-bench index RESULTS_DIR --store {self.root}"
            )

    def create(self) -> None:
        """The store's folder and version file, if not there yet (two creators agree)."""
        self.root.mkdir(parents=True, exist_ok=True)
        version = self.root / VERSION_FILE
        if not version.exists():
            tmp = version.with_name(f".{VERSION_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_bytes(orjson.dumps({"store_version": STORE_VERSION}))
            os.replace(tmp, version)

    @contextmanager
    def run_lock(self, run_id: str) -> Iterator[None]:
        """This run's lock, held while its files are replaced (``fcntl.flock``; on NFS the
        kernel maps it to a POSIX lock the server keeps)."""
        path = self.root / LOCKS / _file_name(run_id, ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def write_run(self, run_id: str, tables: RunTables) -> None:
        """Every per-run table's file of ``run_id``, replaced under the run's lock."""
        self.create()
        name = _file_name(run_id)
        with self.run_lock(run_id):
            for spec in PER_RUN:
                _write_atomic(self.folder(spec) / name, tables.of(spec))

    def run_ids(self) -> list[str]:
        return [p.stem for p in self.files(RUNS)]

    def set_tag(self, tag: str, run_id: str) -> None:
        """Name ``run_id`` ``tag`` (a tag names one run: setting it again moves it)."""
        if not _TAG_NAME.match(tag):
            raise UsageError(
                f"tag {tag!r}: a tag is a letter or digit, then letters, digits, '.', '_' or '-'"
            )
        row: dict[str, object] = {
            "tag": tag,
            "run_id": run_id,
            "tagged": datetime.now(UTC).replace(tzinfo=None),
            "user": _user(),
        }
        _write_atomic(self.folder(TAGS) / _file_name(tag), table_of(TAGS, [row]))
