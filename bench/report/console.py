"""A run's report at its end: report.html rendered, then the summary table and the stacks'
labels printed for whoever watched the run."""

from __future__ import annotations

from collections.abc import Sequence

from bench.report.claims import ClaimResult
from harness.runner.console import say
from harness.runner.results import RunDir
from harness.schema import SummaryRow
from harness.tables import Align, Column, fmt, text_table
from serving.cpus import layout_text

SUMMARY_COLUMNS = (
    Column("stack", align=Align.LEFT, width=10),
    Column("profile", align=Align.LEFT, width=20),
    *(Column(h, width=w) for h, w in (("trial", 5), ("done", 6), ("err", 5), ("lost", 5),
      ("TTFT p50", 9), ("E2EL p50", 9), ("E2EL p99", 9), ("E2EL std", 9), ("req/s", 7),
      ("good/s", 7),
      ("host%", 5))),
    Column("valid", align=Align.LEFT),
)  # fmt: skip


def _host_note(rows: Sequence[SummaryRow]) -> list[str]:
    """The warning under a table where the host's cores were all near full in some phase."""
    busy = list(dict.fromkeys(f"{r.stack}/{r.profile}" for r in rows if r.host_saturated))
    if not busy:
        return []
    return [
        f"host CPU saturated during {', '.join(busy)}: these latencies measure the stacks' "
        "processes and the loader fighting for the cores, not the stacks' design"
    ]


def summary_table(rows: Sequence[SummaryRow]) -> str:
    body = []
    for r in rows:
        ttft = fmt(r.stat("median_ttft_ms")) + ("*" if r.ttft_is_first_byte else "")
        stats = [fmt(r.stat(k)) for k in ("median_e2el_ms", "p99_e2el_ms", "std_e2el_ms")]
        body.append([
            r.stack, r.profile, str(r.repeat), str(r.completed), str(r.errors), str(r.lost),
            ttft, *stats,
            f"{r.request_throughput:.2f}", f"{r.request_goodput:.2f}",
            fmt(r.host_cpu_pct, ".0f"), "yes" if r.valid else "NO: " + "; ".join(r.invalid_reasons),
        ])  # fmt: skip
    lines = [text_table(SUMMARY_COLUMNS, body, rule=True)]
    if any(r.ttft_is_first_byte for r in rows):
        lines.append("* time to first byte: this loader cannot see tokens as they stream")
    lines.extend(_host_note(rows))
    return "\n".join(lines)


def claims_lines(results: Sequence[ClaimResult]) -> list[str]:
    """Each seed claim's verdict as ``claims.json`` holds it: what was measured, and why a claim
    is undecided."""
    lines = ["seed claims (claims.json):"]
    for c in results:
        lines.append(f"  {c.key:<15} {c.status:<12} {c.measured}")
        if c.reason:
            lines.append(f"  {'':<15} {'':<12} why: {c.reason}")
    return lines


def render(run: RunDir) -> None:
    """report.html for the run as it stands, and its rows and claims at the console."""
    from bench.report import claims, html

    say("rendering report")
    report = html.render(run.path)
    if run.summary:
        print(summary_table(run.summary), flush=True)
        for name, label in run.meta.stack_labels().items():
            print(f"{name}: {label}", flush=True)
        print(f"cpu layout: {layout_text(run.meta.config)}", flush=True)
    decided = claims.read(run.path)
    if decided is not None:
        print("\n".join(claims_lines(decided.claims)), flush=True)
    say(f"report: {report}")
