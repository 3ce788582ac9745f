"""The results store's files: each written whole under its run's lock, read back by DuckDB with
the documented schema, empty tables where nothing is written yet."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from harness import store
from harness.errors import UsageError
from tests.support.paths import DOCS, ROOT


def _empty_tables() -> store.RunTables:
    return store.RunTables(*(t.schema.empty_table() for t in store.PER_RUN))


def _runs_row(run_id: str) -> dict[str, object]:
    row: dict[str, object] = dict.fromkeys(store.RUNS.schema.names)
    return row | {"run_id": run_id, "partial": False, "profiles": [], "stacks": []}


def _tables(run_id: str) -> store.RunTables:
    tables = _empty_tables()
    runs = store.table_of(store.RUNS, [_runs_row(run_id)])
    return store.RunTables(runs, *(tables.of(t) for t in store.PER_RUN[1:]))


def test_the_docs_show_the_schema_the_store_writes() -> None:
    assert store.markdown() in (DOCS / "history.md").read_text(encoding="utf-8")


def test_a_row_whose_columns_are_not_the_schemas_is_refused() -> None:
    row = _runs_row("r1")
    row["run"] = row.pop("run_id")
    with pytest.raises(ValueError, match=r"\['run', 'run_id'\]"):
        store.table_of(store.RUNS, [row])


def test_a_new_store_reads_every_table_empty_and_a_missing_one_is_a_usage_error(
    tmp_path: Path,
) -> None:
    where = store.Store(tmp_path / "store")
    with pytest.raises(UsageError, match="no results store at"):
        store.connect(where)
    where.create()
    with store.connect(where) as con:
        for table in store.TABLES:
            assert con.execute(f"SELECT count(*) FROM {table.name}").fetchone() == (0,)


@pytest.mark.parametrize(
    ("written", "says"), [(orjson.dumps({"store_version": 99}), "99"), (b"{torn", "'unreadable'")]
)
def test_a_store_of_another_version_is_refused_in_one_line(
    tmp_path: Path, written: bytes, says: str
) -> None:
    (tmp_path / "store.json").write_bytes(written)
    with pytest.raises(UsageError, match=f"version {says}, but this zl-bench reads version 1"):
        store.Store(tmp_path).check()


def test_writing_a_run_again_replaces_its_files_and_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    where = store.Store(tmp_path)
    for _ in range(3):
        where.write_run("r1", _tables("r1"))
    where.write_run("r2", _tables("r2"))
    with store.connect(where) as con:
        found = con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()
    assert found == [("r1",), ("r2",)]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_a_tag_names_one_run_and_a_bad_name_is_refused(tmp_path: Path) -> None:
    where = store.Store(tmp_path)
    where.create()
    where.set_tag("base", "r1")
    where.set_tag("base", "r2")
    with store.connect(where) as con:
        assert con.execute("SELECT tag, run_id FROM tags").fetchall() == [("base", "r2")]
    with pytest.raises(UsageError, match="a tag is a letter or digit"):
        where.set_tag("../x", "r1")


def test_a_second_writer_of_a_run_waits_for_the_first(tmp_path: Path) -> None:
    """While one process holds a run's lock, another writing that run waits; it writes once the
    lock is let go, so a run's files are always one writer's."""
    where = store.Store(tmp_path / "store")
    where.write_run("r1", _tables("r1"))
    first = (where.folder(store.RUNS) / "r1.parquet").stat().st_mtime_ns
    script = (
        "import sys; from pathlib import Path; from harness import store; "
        "from tests.harness.test_store import _tables; tables = _tables('r1'); "
        "print('ready', flush=True); store.Store(Path(sys.argv[1])).write_run('r1', tables)"
    )
    with where.run_lock("r1"):
        writer = subprocess.Popen(
            [sys.executable, "-c", script, str(where.root)], cwd=ROOT, stdout=subprocess.PIPE
        )
        assert writer.stdout is not None and writer.stdout.readline() == b"ready\n"
        time.sleep(1.0)
        assert writer.poll() is None, "the writer did not wait for the lock"
        assert (where.folder(store.RUNS) / "r1.parquet").stat().st_mtime_ns == first
    assert writer.wait(timeout=60) == 0
    assert (where.folder(store.RUNS) / "r1.parquet").stat().st_mtime_ns > first


def test_the_requests_table_has_a_column_for_every_field_of_a_record() -> None:
    """A field added to RequestRecord without its column would make every filing fail."""
    import dataclasses

    from harness.schema import RequestRecord
    from harness.store import tables

    record_fields = {f.name for f in dataclasses.fields(RequestRecord)}
    assert record_fields <= set(tables.REQUESTS.schema.names)
