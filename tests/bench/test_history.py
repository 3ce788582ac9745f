"""The results store end to end: a real smoke run files itself, ``zl-bench index`` files what
earlier versions and cut-short runs left, ``zl-bench history`` lists, compares and plots them,
the docs' queries run as written, two processes file runs at once, and the notebook runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import nbformat
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import cli
from bench.history import file_run
from bench.history.index import index_run
from harness import schema, store
from tests.support.paths import DOCS, ROOT
from tests.support.simrun import Spec, make_run
from tests.support.sweeps import make_sweep

SMOKE = ["run", "--scale", "smoke", "--profiles", "a", "--stacks", "zerolayer", "--repeats", "1"]
SMOKE_LIMIT_S = 300
SWEEP_ID = "20260101-000000-laptop-sweep"
PARTIAL_ID = "20260101-000100-test"
DOUBLE_ID = "20260101-000200-test"
ONE_PROFILE = {"a_latency": Spec(count=8)}
ZEROLAYER: dict[str, int | None] = {"zerolayer": None}
SQL = re.compile(r"```sql\n(.*?)```", re.DOTALL)


def _env() -> dict[str, str]:
    """This environment without a store of the user's own."""
    return {k: v for k, v in os.environ.items() if k != store.STORE_ENV}


@pytest.fixture
def zl(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[int, str]]:
    """``zl-bench`` in this process (no interpreter to start): its exit status and output."""
    monkeypatch.delenv(store.STORE_ENV, raising=False)

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        status = cli.main(list(args))
        return status, capsys.readouterr().out

    return run


def _zl(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``zl-bench`` as a user runs it, in its own process (``env`` added to this one's)."""
    return subprocess.run(
        [sys.executable, "-m", "bench.cli", *args],
        cwd=cwd,
        env=_env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=SMOKE_LIMIT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``results/`` with one real smoke run (filed by its own hook), then, made by the test
    doubles and filed by ``zl-bench index``: a sweep, a run cut short, and a run whose trials
    may decide a comparison whatever this host's load (the smoke run's one trial may not)."""
    root = tmp_path_factory.mktemp("history")
    results = root / "results"
    proc = _zl(*SMOKE, "--quiet", "--out", str(results))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "filed in the results store" in proc.stdout, proc.stdout[-3000:]
    make_sweep(results / SWEEP_ID)
    make_run(results / PARTIAL_ID, profiles=ONE_PROFILE, stacks=ZEROLAYER, complete=False)
    make_run(results / DOUBLE_ID, profiles=ONE_PROFILE, stacks=ZEROLAYER)
    indexed = _zl("index", str(results))
    assert indexed.returncode == 0, indexed.stdout + indexed.stderr
    return root


def _smoke_run(root: Path) -> Path:
    return next(p for p in (root / "results").glob("*-smoke"))


def _query(root: Path, sql: str) -> list[tuple[object, ...]]:
    with store.connect(store.Store(root / "results" / "store")) as con:
        return con.execute(sql).fetchall()


def test_a_run_files_itself_and_every_record_once(root: Path) -> None:
    run = _smoke_run(root)
    where = f"WHERE run_id = '{run.name}'"
    assert _query(root, f"SELECT end_state, report FROM runs {where}") == [
        ("complete", str(run / schema.REPORT))
    ]
    trials = _query(root, f"SELECT count(*) FROM trials {where}")
    assert trials == [(len(schema.read_summary(run)),)]
    lines = sum(len(schema.read_requests(p)) for p in run.glob("requests-*.jsonl"))
    assert _query(root, f"SELECT count(*) FROM requests {where}") == [(lines,)]
    page = (root / "results" / "index.html").read_text()
    assert f'<a href="{run.name}/report.html">{run.name}</a>' in page
    assert SWEEP_ID in page and "partial" in page


def test_history_lists_every_run_and_says_which_is_partial(
    root: Path, zl: Callable[..., tuple[int, str]]
) -> None:
    status, out = zl("history", "--results", str(root / "results"))
    assert status == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line[:2] == "20"}
    assert set(rows) == {_smoke_run(root).name, SWEEP_ID, PARTIAL_ID, DOUBLE_ID}
    assert " partial " in rows[PARTIAL_ID] and " complete " in rows[_smoke_run(root).name]
    assert f"note: {PARTIAL_ID} is partial:" in out


def test_trend_writes_its_plot(root: Path, zl: Callable[..., tuple[int, str]]) -> None:
    png, results = root / "trend.png", str(root / "results")
    filters = ["--profile", "a", "--stack", "zerolayer"]
    status, out = zl(
        "history", "trend", "median_e2el_ms", *filters, "--results", results, "--out", str(png)
    )
    assert status == 0
    assert f"trend: {png} (median_e2el_ms, 3 run(s)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_query_in_the_docs_runs_as_written_and_returns_rows(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.Store(root / "results" / "store").set_tag("docs", _smoke_run(root).name)
    queries = SQL.findall((DOCS / "history.md").read_text(encoding="utf-8"))
    assert len(queries) >= 6
    monkeypatch.chdir(root)
    trials = "'results/store/trials/*.parquet'"
    (deciding,) = duckdb.sql(f"SELECT count(*) FROM {trials} WHERE decides").fetchone() or (0,)
    for query in queries:
        # Each returns rows; one that keeps deciding trials only may not, where the host was too
        # busy for any trial of the smoke run to decide (tests-under-load: all flagged).
        assert duckdb.sql(query).fetchall() or ("decides" in query and not deciding), query


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["tag", "19990101-000000-smoke", "x"], "unknown run '19990101-000000-smoke'"),
        (["tag", "RUN", "../x"], "a tag is a letter or digit"),
        (["history", "--since", "last tuesday"], "'last tuesday' is not a date"),
        (["history", "trend", "speed"], "unknown metric 'speed'"),
        (["history", "--baseline", "nobody"], "unknown tag 'nobody'"),
        (["history", "trend"], "expected nothing or trend METRIC"),
        (["history", "--store", "STORE"], "no results store at"),
        (["index", "nowhere"], "no results directory at nowhere"),
        (["notebook", "--notebook", "history", "RUN"], "reads the results store, not one run"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(
    root: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("RUN", _smoke_run(root).name).replace("STORE", str(root)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, *(["--results", str(root / "results")] if argv[0] != "index" else [])])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zl-bench: error: ") and err.count("\n") == 1 and says in err, err


def test_baseline_flags_a_starved_engine_by_compares_rules(
    tmp_path: Path, zl: Callable[..., tuple[int, str]]
) -> None:
    """A run at max_num_seqs 64, one alike and one starved at 1, four trials each (compare's own
    test's load: a lagged trial on a busy host leaves three): against the first, tagged, only
    the starved one regresses, and the exit status says so."""
    results = tmp_path / "results"
    spec = {"a_latency": Spec(count=40, rate=80.0, max_tokens=16)}
    for name, seqs in (
        ("20260101-000001-test", 64),
        ("20260101-000002-test", 64),
        ("20260101-000003-test", 1),
    ):
        make_run(results / name, max_num_seqs=seqs, profiles=spec, stacks=ZEROLAYER, repeats=4)
    assert zl("index", str(results))[0] == 0
    assert zl("tag", "20260101-000001-test", "base", "--results", str(results))[0] == 0
    status, out = zl("history", "--baseline", "base", "--results", str(results))
    assert status == 1, out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:2] == "20"}
    assert rows["20260101-000001-test"].endswith("baseline")
    assert rows["20260101-000002-test"].endswith("no regression")
    assert re.search(r"REGRESSION \(\d+\)$", rows["20260101-000003-test"])
    assert "20260101-000003-test against base: zerolayer/a_latency median_e2el_ms" in out


def test_runs_of_earlier_versions_and_damaged_runs_are_filed(
    tmp_path: Path, zl: Callable[..., tuple[int, str]]
) -> None:
    """The committed run (written by an earlier commit) files whole; a run whose records file
    is damaged mid-way, and its claims.json, files as partial, its other files kept, and the
    index goes on."""
    results = tmp_path / "results"
    shutil.copytree(DOCS / "runs" / "20261202-024041-smoke", results / "20261202-024041-smoke")
    damaged = make_run(results / "20260101-000200-test", profiles=ONE_PROFILE, stacks=ZEROLAYER)
    records = damaged / schema.requests_file("zerolayer", "a_latency")
    lines = records.read_bytes().splitlines()
    records.write_bytes(b"\n".join([lines[0], b"{torn", *lines[1:]]) + b"\n")
    (damaged / "claims.json").write_text("{torn")
    status, out = zl("index", str(results))
    assert status == 0
    assert "filed 20261202-024041-smoke: complete" in out
    assert "filed 20260101-000200-test: partial (" in out and "line 2 is not JSON" in out
    assert "claims.json: not JSON" in out
    trials = _query(tmp_path, "SELECT run_id, count(*) FROM trials GROUP BY ALL ORDER BY 1")
    assert trials == [("20260101-000200-test", 1), ("20261202-024041-smoke", 2)]


def test_a_store_that_cannot_be_written_is_a_warning_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "results" / "run", profiles=ONE_PROFILE, stacks=ZEROLAYER)
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv(store.STORE_ENV, str(tmp_path / "file" / "store"))
    file_run(run)
    out = capsys.readouterr().out
    assert "warning: the run was not filed in the results store" in out
    assert (run / schema.RUN_META).is_file()


WRITER = """
import sys, time
from pathlib import Path
from bench.history.index import index_run
from harness.store import Store
into, go, runs = Store(Path(sys.argv[1])), Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]]
while not go.exists():
    time.sleep(0.01)
for _ in range(3):
    for run in runs:
        index_run(into, run)
"""


def test_two_processes_file_runs_at_once_and_the_store_stays_whole(tmp_path: Path) -> None:
    """Two writers, each filing its own runs and one they share, three times over, while this
    process reads: every read succeeds, and at the end every run is there once with every
    record once."""
    results, go = tmp_path / "results", tmp_path / "go"
    runs = [
        make_run(results / f"20260101-00000{i}-test", profiles=ONE_PROFILE, stacks=ZEROLAYER)
        for i in range(5)
    ]
    into = store.Store(results / "store")
    into.create()
    shares = ([runs[0], runs[1], runs[4]], [runs[2], runs[3], runs[4]])
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(into.root), str(go), *map(str, mine)],
            cwd=ROOT,
            env=_env(),
        )
        for mine in shares
    ]
    time.sleep(2.0)  # the writers import; then they start together
    go.touch()
    reads = 0
    while any(w.poll() is None for w in writers):
        with store.connect(into) as con:
            con.execute("SELECT count(*) FROM runs JOIN requests USING (run_id)").fetchall()
        reads += 1
        time.sleep(0.05)
    assert [w.returncode for w in writers] == [0, 0] and reads > 0
    expected = {r.name: len(schema.read_requests(next(r.glob("requests-*.jsonl")))) for r in runs}
    with store.connect(into) as con:
        filed = sorted(r for (r,) in con.execute("SELECT run_id FROM runs").fetchall())
        counted = dict(con.execute("SELECT run_id, count(*) FROM requests GROUP BY 1").fetchall())
        distinct = con.execute(
            "SELECT count(DISTINCT (run_id, request_id)) FROM requests"
        ).fetchone()
    assert filed == sorted(expected) and counted == expected
    assert distinct == (sum(expected.values()),)
    assert not [p for p in into.root.rglob("*.tmp")]


_RECORD = st.fixed_dictionaries(
    {
        "outcome": st.sampled_from(schema.OUTCOMES),
        "intended_start_ns": st.integers(1_700_000_000 * 10**9, 1_800_000_000 * 10**9),
        "latency_ns": st.integers(1, 10**10),
        "output_tokens": st.integers(0, 64),
    }
)


def _write_run(path: Path, drafts: list[dict[str, int | str]]) -> list[schema.RequestRecord]:
    records = []
    for i, d in enumerate(drafts):
        start, latency = int(d["intended_start_ns"]), int(d["latency_ns"])
        done = d["outcome"] == "completed"
        records.append(
            schema.RequestRecord(
                f"r{i}",
                "zerolayer",
                "a_latency",
                "native",
                start,
                dispatch_ns=start,
                sent_ns=start,
                first_token_ns=start + latency // 2 if done else 0,
                end_ns=start + latency,
                chunk_ns=[start + latency // 2] if done else [],
                outcome=d["outcome"],  # type: ignore[arg-type]
                output_tokens=int(d["output_tokens"]),
            )
        )
    path.mkdir(parents=True)
    with schema.JsonlWriter(path / schema.requests_file("zerolayer", "a_latency")) as writer:
        writer.write_many(records)
    meta = schema.RunMeta(run_id=path.name, scale="test", end=schema.RunEnd.COMPLETE)
    schema.write_run_meta(path, meta)
    return records


def _everything(table: store.tables.Table) -> str:
    """A table's rows in a fixed order, less when they were written."""
    columns = "* EXCLUDE (indexed)" if table is store.RUNS else "*"
    return f"SELECT {columns} FROM {table.name} ORDER BY ALL"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drafts=st.lists(_RECORD, max_size=25), times=st.integers(1, 3))
def test_filing_is_idempotent_and_files_every_record_once(
    drafts: list[dict[str, int | str]], times: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "results" / "20260101-000000-test"
        records = _write_run(run, drafts)
        into = store.Store(Path(tmp) / "results" / "store")
        snapshots = []
        for _ in range(times):
            index_run(into, run)
            with store.connect(into) as con:
                snapshots.append([con.execute(_everything(t)).fetchall() for t in store.PER_RUN])
                filed = con.execute("SELECT request_id, outcome, end_ns FROM requests").fetchall()
        assert all(s == snapshots[0] for s in snapshots)
        assert sorted(filed) == sorted((r.request_id, r.outcome, r.end_ns) for r in records)


def test_the_history_notebook_redraws_the_trends(root: Path, tmp_path: Path) -> None:
    """``zl-bench notebook --notebook history`` runs notebooks/history.ipynb on the store and
    writes it, executed, beside index.html: a figure for every trend it says it drew."""
    results = root / "results"
    proc = _zl(
        "notebook",
        "--notebook",
        "history",
        "--results",
        str(results),
        cwd=tmp_path,
        env={"ZL_NOTEBOOK_OUT": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"notebook: {results / 'history.ipynb'}" in proc.stdout
    nb = nbformat.read(results / "history.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    drawn = re.findall(r"^trend-(\S+): \d+ runs", text, re.MULTILINE)
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert "median_e2el_ms" in drawn and "max_goodput" in drawn and len(images) == len(drawn)
    assert sorted(p.stem for p in tmp_path.glob("*.png")) == sorted(f"trend-{m}" for m in drawn)
    assert "4 runs in" in text and "1 partial" in text
    assert "<html" in (results / "history.html").read_text()[:2000].lower()
