"""Every measured figure in the README and ``docs/``, drawn or rendered from committed results.

A figure (``docs/figures/``) is redrawn by the report's own plot function from a run committed
under ``docs/runs/``; a table of figures sits in its page between ``<!-- measured:NAME -->`` and
``<!-- /measured:NAME -->`` and is rendered, with the project's table helper, from the small
summaries under ``docs/measured/`` that it names. A summary keeps only the figures its tables
show, with the command that measured them, the commit, the date, the host and one core's speed
(SHA-256 digests/s) as it started and ended, so that nobody types a figure and every figure can
be traced and re-measured. Run from the repository root:

    python scripts/docs_measured.py probe --record P.json -- zl-bench capacity --out R.json
    python scripts/docs_measured.py capture NAME RESULTS [--probe P.json | --command CMD]
    python scripts/docs_measured.py render    # rewrite every marked block, redraw the figures
    python scripts/docs_measured.py check     # exit 1 naming every block that differs

``probe`` runs a command between two speed probes, for the commands whose results do not record
the host (overhead, capacity, attack, pytest-benchmark); a run or sweep directory's ``run.json``
records its own (``machine``), so ``--command`` is enough for those.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from harness.tables import Align, Column, cells, fmt, markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from docs_sources import (
    attack_rows,
    benchmark_rows,
    capacity_rows,
    overhead_rows,
    run_dir,
    session_rows,
    sweep_cells,
    sweep_rows,
)

ROOT: Final = Path(__file__).resolve().parent.parent
DOCS: Final = ROOT / "docs"
MEASURED: Final = DOCS / "measured"
RUNS: Final = DOCS / "runs"
FIGURES: Final = DOCS / "figures"
DPI: Final = 110  # the report's own (bench.report.plots.render_all)
# figure file -> (run id under docs/runs/, plot name in bench.report.plots.RUN_PLOTS)
DRAWN: Final = {
    "latency_variance.png": ("20261202-024041-smoke", "latency_variance"),
}
BLOCK: Final = re.compile(
    r"<!-- measured:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /measured:(?P=name) -->", re.DOTALL
)
FENCE: Final = re.compile(r"```.*?```", re.DOTALL)

Row = dict[str, Any]


def pages() -> list[Path]:
    """The pages whose tables are checked: the README and every page under ``docs/``."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


# --- provenance: where a measurement came from -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Host:
    """The machine a measurement ran on, as run.json's ``machine`` names it."""

    hostname: str
    cpus: int


@dataclass(frozen=True, slots=True)
class Provenance:
    """What a reader needs to trust and repeat a figure: the exact command, the code (commit,
    ``-dirty`` when the tree had changes), the date, the host and one core's speed around it."""

    command: str
    commit: str
    date: str
    host: Host
    cpu_speed_start: int | None
    cpu_speed_end: int | None


def git_commit() -> str:
    """HEAD's short hash, ``-dirty`` when the tree has changes (as run.json records it)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("-dirty" if dirty.stdout.strip() else "")


def probe(command: Sequence[str]) -> tuple[Provenance, int]:
    """Run ``command`` between two probes of one core's speed; its provenance and exit code."""
    from harness.telemetry import cpu_speed  # the suite's own yardstick, as run.json's

    start = round(cpu_speed())
    date = time.strftime("%Y-%m-%d", time.gmtime())
    rc = subprocess.run(list(command), check=False).returncode
    host = Host(socket.gethostname(), os.cpu_count() or 0)
    made = Provenance(" ".join(command), git_commit(), date, host, start, round(cpu_speed()))
    return made, rc


def read_provenance(path: Path) -> Provenance:
    """A provenance written by ``probe --record``."""
    data = orjson.loads(path.read_bytes())
    return Provenance(**{**data, "host": Host(**data["host"])})


def run_provenance(run: Path, command: str) -> Provenance:
    """A run's provenance from its ``run.json``: revision, start date, host and speeds."""
    meta = orjson.loads((run / "run.json").read_bytes())
    machine = meta.get("machine", {})
    date = time.strftime("%Y-%m-%d", time.gmtime(meta.get("started_ns", 0) / 1e9))
    host = Host(str(machine.get("hostname", "?")), int(machine.get("cpus") or 0))
    speeds = machine.get("cpu_speed_start"), machine.get("cpu_speed_end")
    return Provenance(command, str(meta.get("git_revision", "unknown")), date, host, *speeds)


# --- the registry: each summary, and each marked block ------------------------------------------

Extract = Callable[[Path], list[Row]]


@dataclass(frozen=True, slots=True)
class Table:
    """A marked block: the summaries it is rendered from, in order, and the columns it shows."""

    sources: tuple[str, ...]
    columns: tuple[Column, ...]
    shape: Callable[[Row], Row] | None = None  # a summary's row as the table shows it


def _left(header: str, key: str) -> Column:
    return Column(header, key, align=Align.LEFT)


OVERHEAD_COLUMNS: Final = (
    _left("target", "target"),
    Column("in flight", "in_flight"),
    Column("req/s", "rate", 0),
    Column("completed", "completed"),
    Column("E2EL p50 ms", "e2el_p50_ms", 2),
    Column("E2EL p99 ms", "e2el_p99_ms", 2),
    Column("+TTFT p50 ms", "added_ttft_p50_ms", 2),
    Column("+E2EL p50 ms", "added_e2el_p50_ms", 2),
    Column("+E2EL p99 ms", "added_e2el_p99_ms", 2),
    Column("server CPU us/request", "server_cpu_us_per_request", 0),
    Column("host CPU %", "host_busy_pct", 0),
    Column("valid", "valid"),
)
SWEEP_COLUMNS: Final = (
    _left("profile", "profile"),
    _left("stack", "stack"),
    Column("rates tried, req/s (points)", "rates"),
    Column("repeats", "repeats"),
    Column("max goodput, req/s", "max_goodput"),
    Column("knee, req/s", "knee"),
    Column("host CPU full at, req/s", "host_full"),
    Column("baseline E2EL p50 > zero-layer's + 50 ms from, req/s", "added_latency"),
    _left("sweep stopped early", "stopped"),
)
SESSION_COLUMNS: Final = (
    _left("profile", "profile"),
    _left("stack", "setup"),
    Column("requests", "requests"),
    Column("hit rate %", "hit_rate", 1),
    Column("prefilled tokens / request", "prefilled", 0),
    *(Column(f"TTFT p50 turn {k}, ms", f"t{k}", 1) for k in range(1, 7)),
)
SOURCES: Final[dict[str, Extract]] = {
    "overhead-null": overhead_rows,
    "overhead-stacks": overhead_rows,
    "capacity": capacity_rows,
    "benchmarks": benchmark_rows,
    "attack": attack_rows,
    "sweep-a": sweep_rows,
    "sweep-b": sweep_rows,
    "sweep-c": sweep_rows,
    "sessions": session_rows,
    "sessions-pow2": session_rows,
    "sessions-nocache": session_rows,
}
TABLES: Final[dict[str, Table]] = {
    "overhead-null": Table(("overhead-null",), OVERHEAD_COLUMNS),
    "overhead-stacks": Table(("overhead-stacks",), OVERHEAD_COLUMNS),
    "capacity": Table(
        ("capacity",),
        (
            _left("loader", "loader"),
            Column("offered req/s", "rate", 0),
            Column("best p99 lag ms", "best_lag", 3),
            Column("worst p99 lag ms", "worst_lag", 3),
            Column("repeats on schedule", "sustained"),
        ),
    ),
    "benchmarks": Table(
        ("benchmarks",),
        (
            _left("benchmark", "benchmark"),
            Column("median us per call", "median_us", 2),
            Column("IQR us", "iqr_us", 2),
            Column("rounds", "rounds"),
        ),
    ),
    "attack": Table(
        ("attack",),
        (
            _left("attack", "attack"),
            Column("item", "item"),
            _left("verdict", "verdict"),
            Column("healthy completed", "healthy"),
            Column("RSS growth MiB", "rss_growth_mib", 1),
            Column("RSS bound MiB", "rss_bound_mib", 1),
            Column("active after", "active_after"),
        ),
    ),
    "sweeps": Table(("sweep-a", "sweep-b", "sweep-c"), SWEEP_COLUMNS, sweep_cells),
    "sessions": Table(("sessions", "sessions-pow2", "sessions-nocache"), SESSION_COLUMNS),
}
# Tables that are references, not measurements (commands, files, fields, limits, definitions),
# by their header line: any other table outside a marked block is a typed figure, and fails.
REFERENCE_TABLES: Final = frozenset({
    "| command | what it does |",
    "| page | what it covers |",
    "| item | attacks |",
    "| contract | what it says |",
    "| path | what |",
    "| metric (summary keys) | definition | function (`harness/metrics.py` unless named) |",
    "| figure (row key) | definition | where |",
    "| claim (seed) | function | what it checks | held when |",
    "| limit | default | what it bounds | precedent |",
    "| use | fields | `vllm` engine | `sim`, `null`, `torch` |",
    "| file in `results/<run-id>/` | what it holds |",
    "| table | one row per |",
    "| column | type | unit | meaning |",
})  # fmt: skip


# --- summaries: docs/measured/<name>.json -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measured:
    """One measurement's committed summary: its provenance and the rows its tables show."""

    name: str
    provenance: Provenance
    rows: list[Row]

    def to_bytes(self) -> bytes:
        """Flat on disk (``command``, ``commit``, ``date``, ``host``, speeds, ``rows``)."""
        doc = {"name": self.name, **asdict(self.provenance), "rows": self.rows}
        return orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"

    @classmethod
    def load(cls, name: str, folder: Path = MEASURED) -> Measured:
        data = orjson.loads((folder / f"{name}.json").read_bytes())
        rows = data.pop("rows")
        data.pop("name")
        return cls(name, Provenance(**{**data, "host": Host(**data["host"])}), rows)


def shown_keys(source: str) -> set[str]:
    """The row keys of every table rendered from ``source``: all a summary needs to keep."""
    return {c.key for t in TABLES.values() if source in t.sources for c in t.columns}


def capture(name: str, results: Path, made: Provenance, folder: Path = MEASURED) -> Path:
    """Write ``folder/<name>.json`` from a command's results: only the figures shown."""
    if name not in SOURCES:
        raise SystemExit(f"unknown measurement {name!r}; known: {', '.join(SOURCES)}")
    keys = shown_keys(name)
    rows = [{k: v for k, v in row.items() if k in keys} for row in SOURCES[name](results)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_bytes(Measured(name, made, rows).to_bytes())
    return path


# --- rendering and checking the pages ----------------------------------------------------------


def _speed(value: int | None) -> str:
    return fmt(value, ",d")


def caption(measured: Measured, page: Path) -> str:
    """The line under a table that says where its figures came from."""
    p = measured.provenance
    link = os.path.relpath(MEASURED / f"{measured.name}.json", page.parent)
    return (
        f"*[{measured.name}]({link}): `{p.command}`; commit `{p.commit}`, {p.date}, host "
        f"`{p.host.hostname}` ({p.host.cpus} CPUs), one core {_speed(p.cpu_speed_start)} -> "
        f"{_speed(p.cpu_speed_end)} SHA-256 digests/s.*"
    )


def render_block(name: str, page: Path, folder: Path = MEASURED) -> str:
    """The marked block ``name`` as it must read in ``page``: the table, then its captions."""
    table = TABLES[name]
    measured = [Measured.load(source, folder) for source in table.sources]
    rows = [table.shape(r) if table.shape else r for m in measured for r in m.rows]
    lines = [markdown_table(table.columns, cells(rows, table.columns)), ""]
    lines += [caption(m, page) + "\n" for m in measured]
    return f"<!-- measured:{name} -->\n" + "\n".join(lines) + f"<!-- /measured:{name} -->"


def table_headers(text: str) -> Iterator[str]:
    """The header line of every markdown table in ``text`` (a line of cells over ``| --``)."""
    lines = FENCE.sub("", text).splitlines()
    for above, line in itertools.pairwise(lines):
        if above.startswith("|") and re.match(r"\|\s*:?-{3}", line):
            yield above.strip()


def problems(page: Path, text: str | None = None, folder: Path = MEASURED) -> list[str]:
    """What is wrong with ``page`` (or ``text`` read as it): a marked block that is not its
    rendering, one naming no table, and a table of figures outside every marked block."""
    text = page.read_text(encoding="utf-8") if text is None else text
    where = page.name
    found = []
    for block in BLOCK.finditer(text):
        name = block["name"]
        sources = TABLES[name].sources if name in TABLES else ()
        missing = [s for s in sources if not (folder / f"{s}.json").is_file()]
        if name not in TABLES:
            found.append(f"{where}: measured:{name} names no table in TABLES")
        elif missing:
            found.append(f"{where}: measured:{name} has no summary {', '.join(missing)}")
        elif block[0] != render_block(name, page, folder):
            found.append(f"{where}: measured:{name} differs from its rendering (a hand edit?)")
    for header in table_headers(BLOCK.sub("", text)):
        if header not in REFERENCE_TABLES:
            found.append(f"{where}: a table outside any measured block: {header[:60]}")
    return found


def rendered(page: Path, folder: Path = MEASURED) -> str:
    """``page`` with every marked block replaced by its rendering."""
    text = page.read_text(encoding="utf-8")
    return BLOCK.sub(lambda m: render_block(m["name"], page, folder), text)


def redraw(name: str, out: Path = FIGURES) -> Path:
    """The figure ``name`` of ``DRAWN`` from its committed run, written to ``out/<name>``."""
    from bench.report.data import load_run
    from bench.report.plots import RUN_PLOTS

    run_id, plot = DRAWN[name]
    figure = RUN_PLOTS[plot](load_run(RUNS / run_id))
    path = out / name
    figure.savefig(path, dpi=DPI)
    return path


# --- the command line ---------------------------------------------------------------------------


def _render() -> int:
    for page in pages():
        text = rendered(page)
        if text != page.read_text(encoding="utf-8"):
            page.write_text(text, encoding="utf-8")
            print(page.relative_to(ROOT))
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name in DRAWN:
        print(redraw(name).relative_to(ROOT))
    return 0


def stale_figures() -> list[str]:
    """The figures under ``docs/figures/`` that are not what their committed runs draw."""
    with tempfile.TemporaryDirectory() as tmp:
        return [
            f"figures/{name} is not what its run draws"
            for name in DRAWN
            if redraw(name, Path(tmp)).read_bytes() != (FIGURES / name).read_bytes()
        ]


def _check() -> int:
    found = [p for page in pages() for p in problems(page)] + stale_figures()
    print("\n".join(found) or "every measured table and figure is its rendering")
    return 1 if found else 0


def _capture(args: argparse.Namespace) -> int:
    made = read_provenance(args.probe) if args.probe else None
    run = run_dir(args.results)
    if run is not None and (made or args.command):
        made = run_provenance(run, made.command if made else args.command)
    if made is None:
        raise SystemExit("capture: these results record no host speed; give --probe")
    print(capture(args.name, args.results, made).relative_to(ROOT))
    return 0


def _probe(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    made, rc = probe(command)
    args.record.write_bytes(orjson.dumps(asdict(made), option=orjson.OPT_INDENT_2))
    return rc


def parser() -> argparse.ArgumentParser:
    """The four modes: probe, capture, render, check."""
    top = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = top.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("probe", help="run a command between two probes of one core's speed")
    p.add_argument("--record", type=Path, required=True, help="write the provenance here")
    p.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("capture", help="write docs/measured/NAME.json from a command's results")
    c.add_argument("name", choices=sorted(SOURCES))
    c.add_argument("results", type=Path)
    c.add_argument("--probe", type=Path, help="the provenance `probe --record` wrote")
    c.add_argument("--command", help="the command, for a run directory (it records its host)")
    sub.add_parser("render", help="rewrite every marked block; redraw the figures")
    sub.add_parser("check", help="exit 1 naming every block that is not its rendering")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    modes: dict[str, Callable[[], int]] = {
        "probe": lambda: _probe(args),
        "capture": lambda: _capture(args),
        "render": _render,
        "check": _check,
    }
    return modes[args.mode]()


if __name__ == "__main__":
    sys.exit(main())
