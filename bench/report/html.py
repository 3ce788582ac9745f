"""``report.html``: one self-contained page (plots embedded as PNG data URIs) per run.

Sections: an "incomplete run" banner when the run was cut short; for a sweep, the headline
figures per stack first (max goodput, knee, highest rate within the SLOs, each with its interval
over repeats) and the table of points; the run header, validity flags, the summary table, the
multi-turn profiles' figures by turn and every stack's prefix-cache hit rate, each profile's input
and output lengths (beside its workload file's), the claims check, fault markers, telemetry
sources, a note where the host's CPU was full, and every plot that applies to the run.
"""

from __future__ import annotations

import argparse
import base64
from html import escape
from pathlib import Path

from bench.report import claims, plots, slosets
from bench.report.data import RunData, load_run, read_recovery
from bench.report.htmlparts import cell as _cell
from bench.report.htmlparts import table as _table
from bench.report.parity import parity_section
from bench.report.workload_sections import lengths_section, prefix_cache_section, turns_section
from harness import curves, schema
from harness.curves import Interval
from harness.errors import UsageError
from harness.schema import SummaryRow, SweepSection
from harness.slosets import SLO_SETS, slo_set
from serving.cpus import layout_text

SUMMARY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("num_requests", "requests", "{:.0f}"),
    ("completed", "completed", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("lost", "lost", "{:.0f}"),
    ("median_ttft_ms", "TTFT p50 (ms)", "{:.2f}"),
    ("p99_ttft_ms", "TTFT p99 (ms)", "{:.2f}"),
    ("median_itl_ms", "ITL p50 (ms)", "{:.2f}"),
    ("p99_itl_ms", "ITL p99 (ms)", "{:.2f}"),
    ("median_e2el_ms", "E2EL p50 (ms)", "{:.2f}"),
    ("p99_e2el_ms", "E2EL p99 (ms)", "{:.2f}"),
    ("std_e2el_ms", "E2EL std (ms)", "{:.2f}"),
    ("p99_e2el_intended_ms", "E2EL p99 from intended (ms)", "{:.2f}"),
    ("p99_lag_ms", "loader lag p99 (ms)", "{:.3f}"),
    ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput", "output tok/s", "{:.1f}"),
    ("host_cpu_pct", "host CPU %", "{:.0f}"),
)
RATE = "req/s"
LAGGED_PREFIX = "loader lagged: "  # harness.metrics.lag_reason's wording, said once per cell

CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1300px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f0f0f0}td.l,th.l{text-align:left}
.banner{background:#fde2e1;border:2px solid #c0392b;padding:1em;font-weight:bold}
.held{background:#e3f6e3}.not-held{background:#fde2e1}.not-measured{background:#f3f3f3}
.undecided{background:#fff4d6}
.invalid{background:#fff3cd}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}
.mismatch{background:#fde2e1;color:#c0392b;font-weight:bold}
"""


def _summary_cells(entry: SummaryRow) -> list[str]:
    """The row's figures; a profile that completed nothing says so in its latency columns."""
    flat = schema.to_data(entry)
    return [
        "<i>no completions</i>"
        if entry.completed == 0 and key.endswith("_ms")
        else _cell(flat.get(key), fmt)
        for key, _, fmt in SUMMARY_COLUMNS
    ]


def _loader_note(entry: SummaryRow) -> str:
    parts = [entry.loader_protocol or "?"]
    if entry.ttft_is_first_byte:
        parts.append("TTFT = time to first byte (the tool cannot stream)")
    return escape("; ".join(parts))


def _saturated_cell(entry: SummaryRow) -> str:
    """ "yes" with why (``harness.metrics.saturation``'s reasons), or "no"."""
    if not entry.saturated:
        return "no"
    return "<b>yes</b>: " + escape("; ".join(entry.saturation_reasons))


def _summary_section(run: RunData) -> str:
    if not run.summaries and run.sweep is not None:
        return ""
    rows, notes = [], []
    for entry in run.summaries:
        flag = "valid" if entry.valid else "INVALID"
        if entry.recomputed:
            flag += " (recomputed)"
        rows.append(
            [
                escape(entry.stack),
                escape(entry.profile),
                str(entry.repeat),
                escape(entry.loader),
                *_summary_cells(entry),
                _saturated_cell(entry),
                _loader_note(entry),
                flag,
            ]
        )
        for reason in entry.invalid_reasons:
            where = f"{escape(entry.stack)} / {escape(entry.profile)} trial {entry.repeat}"
            notes.append(f"<li>{where}: {escape(reason)}</li>")
    headers = [
        "stack",
        "profile",
        "trial",
        "loader",
        *(h for _, h, _ in SUMMARY_COLUMNS),
        "saturated",
        "on the wire",
        "validity",
    ]
    out = "<h2>Summary</h2>" + _table(headers, rows, left=4)
    if notes:
        out += (
            "<div class='invalid'><b>Validity flags</b>: these figures are not the server's "
            f"latency.<ul>{''.join(notes)}</ul></div>"
        )
    return out


def _rate_text(figure: Interval) -> str:
    return escape(figure.text(".2f", RATE))


def _headline_section(sweep: SweepSection) -> str:
    """The sweep's answer, first: per stack its max goodput, knee and highest rate within the
    SLOs (intervals over repeats), why its sweep stopped; then the added-latency rate."""
    rows = []
    for stack in plots.sweep_stacks(sweep):
        figures = plots.sweep_headline(sweep, stack)
        stopped = sweep.stacks.get(stack, {}).get("stopped") or "ran every rate"
        rows.append(
            [
                escape(stack),
                _rate_text(figures["max_goodput"]),
                _rate_text(figures["knee"]),
                _rate_text(figures["highest_within_slos"]),
                escape(stopped),
            ]
        )
    headers = [
        "stack",
        "max goodput",
        "knee (leaves the SLOs)",
        "highest rate within the SLOs",
        "sweep stopped",
    ]
    added = plots.sweep_added_latency(sweep)
    slos = "; ".join(str(s) for s in plots.sweep_slos(sweep)) or "none"
    return (
        f"<h2>Load sweep: {escape(sweep.profile)}</h2><p>{escape(sweep.mode)} sweep, "
        f"{len(sweep.rates)} rates, {sweep.repeats} repeat(s) per rate; SLOs: {escape(slos)}. "
        f"Figures are the mean over repeats with a {curves.CONFIDENCE:.0%} Student-t interval; "
        "points where the loader lagged take no part.</p>"
        + _table(headers, rows, left=1)
        + f"<p><b>Added latency</b>: offered rate at which the baseline's median E2EL exceeds "
        f"the zero-layer stack's by more than {added.bound_ms:g} ms: "
        f"{_rate_text(added.rate)}</p>"
    )


POINT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("median_ttft_ms", "TTFT p50 (ms)", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 (ms)", "{:.1f}"),
    ("median_e2el_ms", "E2EL p50 (ms)", "{:.1f}"),
    ("p99_e2el_ms", "E2EL p99 (ms)", "{:.1f}"),
    ("request_goodput", "goodput (req/s)", "{:.2f}"),
    ("request_throughput", "throughput (req/s)", "{:.2f}"),
)


def _point_validity(row: SummaryRow) -> str:
    """Whether the point measured the stack; a loader-limited point is the loader's."""
    if row.loader_limited:
        why = "; ".join(r.removeprefix(LAGGED_PREFIX) for r in row.invalid_reasons)
        return f"<span class='invalid'><b>{plots.INVALID_LABEL}</b> ({escape(why)})</span>"
    if not row.valid:
        return f"<span class='invalid'>INVALID: {escape('; '.join(row.invalid_reasons))}</span>"
    return "valid"


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "<b>no</b>")


def _host_cell(row: SummaryRow) -> str:
    if row.host_cpu_pct is None:
        return "-"
    return f"{row.host_cpu_pct:.0f}" + (" <b>(all cores full)</b>" if row.host_saturated else "")


def _points_section(sweep: SweepSection) -> str:
    """Every point of the sweep, with why a point is not the stack's where it is not."""
    rows = []
    for stack in plots.sweep_stacks(sweep):
        for row in sweep.stack_points(stack):
            flat = schema.to_data(row)
            latency = [
                "<i>no completions</i>"
                if row.completed == 0 and key.endswith("_ms")
                else _cell(flat.get(key), fmt)
                for key, _, fmt in POINT_COLUMNS
            ]
            rows.append(
                [
                    escape(stack),
                    f"{row.offered_rate:.3g}",
                    str(row.repeat),
                    f"{row.completed}/{row.errors}/{row.lost}",
                    *latency,
                    _yes_no(row.slo_met),
                    _saturated_cell(row),
                    _host_cell(row),
                    _point_validity(row),
                ]
            )
    headers = [
        "stack",
        "offered (req/s)",
        "repeat",
        "completed/errors/lost",
        *(h for _, h, _ in POINT_COLUMNS),
        "SLOs met",
        "saturated",
        "host CPU %",
        "valid / why not",
    ]
    return "<h2>Sweep points</h2>" + _table(headers, rows, left=1)


def _host_note(run: RunData) -> str:
    """Beside the figures: where all cores were near full, what the latency there measures."""
    where = [f"{r.stack} / {r.profile}" for r in run.summaries if r.host_saturated]
    if run.sweep is not None:
        for stack in plots.sweep_stacks(run.sweep):
            rates = [p.rate for p in plots.rate_points(run.sweep, stack) if p.host_saturated]
            if rates:
                where.append(f"{stack} at {', '.join(f'{r:g}' for r in rates)} req/s")
    if not where:
        return ""
    return (
        f"<div class='invalid'><b>Host CPU</b>: {escape(plots.HOST_NOTE)} "
        f"({escape('; '.join(where))}).</div>"
    )


def _validity_section(run: RunData) -> str:
    flags = run.meta.validity
    if not flags:
        return ""
    lis = "".join(
        f"<li>{escape(k)}: {'valid' if v.valid else 'INVALID: ' + escape('; '.join(v.reasons))}"
        "</li>"
        for k, v in flags.items()
    )
    return f"<h2>Run validity flags</h2><ul>{lis}</ul>"


def _claims_section(results: list[claims.ClaimResult]) -> str:
    """The claims table, from the verdicts written to ``claims.json``."""
    rows = []
    for result in results:
        css = result.status.css
        verdict = f"<span class='{css}'><b>{escape(result.status)}</b></span>"
        if result.reason:
            verdict += f"<br>{escape(result.reason)}"
        rows.append(
            [
                escape(result.claim),
                escape(result.claimed),
                escape(result.measured),
                verdict,
                escape(result.rule),
            ]
        )
    return (
        "<h2>Seed-study claims</h2><p>Each claim from docs/design.md against this run's "
        "measurements; the rule column says how the verdict was reached, the verdict column why "
        "a claim is undecided. The figure <i>claim_trials</i> below shows each trial's figure "
        "beside the interval it was decided on.</p>"
        + _table(["claim", "claimed", "measured", "verdict", "rule"], rows, left=5)
    )


def _faults_section(run: RunData) -> str:
    if not run.faults:
        return ""
    rows = [
        [
            escape(f.name),
            escape(f.stack or "all"),
            f"{(f.t_ns - run.t0_ns) / 1e9:.2f}",
            f"{(f.end_ns - run.t0_ns) / 1e9:.2f}" if f.end_ns else "-",
            escape(f.source),
        ]
        for f in run.faults
    ]
    return "<h2>Faults</h2>" + _table(["fault", "stack", "start (s)", "end (s)", "from"], rows, 2)


RECOVERY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("trial", "{:.0f}"),
    ("requests", "{:.0f}"),
    ("failed", "{:.0f}"),
    ("lost", "{:.0f}"),
    ("time_to_detect_s", "{:.2f}"),
    ("time_to_recover_s", "{:.2f}"),
    ("sdk_reroute_s", "{:.2f}"),
    ("error_budget_burn", "{:.1f}"),
    ("blast_radius_requests", "{:.0%}"),
    ("blast_radius_replicas", "{:.0%}"),
)


def _recovery_section(run: RunData) -> str:
    rows = schema.to_data(read_recovery(run.path))
    if not rows:
        return ""
    body = [
        [escape(str(r.get("stack", "?"))), escape(str(r.get("experiment", "?")))]
        + [_cell(r.get(key), fmt) for key, fmt in RECOVERY_COLUMNS]
        + [
            escape(f"{r.get('hypothesis_before')}/{r.get('hypothesis_after')}"),
            "ok" if r.get("rollbacks_ok") else "<b>FAILED</b>",
        ]
        for r in rows
    ]
    headers = ["stack", "experiment", *(k for k, _ in RECOVERY_COLUMNS), "hypothesis", "rollbacks"]
    return (
        "<h2>Recovery (profile D, Chaos Toolkit)</h2><p>Lost must be 0: every request either "
        "completed or got an explicit error by its deadline. Times are from the fault's start; "
        "'-' means the SLI never left its target.</p>" + _table(headers, body, left=2)
    )


def _chaos_trials_section(run: RunData) -> str:
    """Profile D's errors and retries per experiment and trial, and its refusal figures, as
    ``zl-bench`` printed them (``chaos.runner``)."""
    from chaos.runner import fault_table, refusal_table

    rows = read_recovery(run.path)
    if not rows:
        return ""
    text = fault_table(rows) + (
        "\n\n" + refusal_table(rows) if any(r.refusal for r in rows) else ""
    )
    return (
        "<h2>Errors, retries and refusals per experiment (profile D)</h2><p>Errors and retries "
        "in each fault's window against the steady state before it; refusal latency in ms to "
        "the microsecond, the notice time from the engine crossing its refusal threshold to "
        "the first refusal ('&gt;': none came before the pressure ended), and the requests "
        f"admitted into the full replica meanwhile.</p><pre>{escape(text)}</pre>"
    )


def _telemetry_section(run: RunData) -> str:
    sources = run.meta.telemetry.sources
    if not sources:
        return ""
    rows = [
        [
            escape(s.get("kind", "?")),
            "yes" if s.get("available") else "no",
            escape(s.get("reason", "")),
        ]
        for s in sources
    ]
    return "<h2>Telemetry sources</h2>" + _table(["source", "available", "reason"], rows, 3)


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (
        f"<h3>{escape(path.stem)}</h3><img alt='{escape(path.stem)}' "
        f"src='data:image/png;base64,{data}'>"
    )


def _slo_set_section(run: RunData, name: str | None) -> str:
    """The run judged against the SLO set asked for (here, else at the run), written to
    ``slo-<set>.json``; nothing when none was."""
    name = name or run.meta.config.get("slo_set")
    if not name:
        return ""
    try:
        chosen = slo_set(str(name))
    except ValueError as exc:
        raise UsageError(f"--slo-set: {exc}") from None
    results = slosets.judge_run(run, chosen)
    slosets.write(run.path, results)
    return slosets.html_section(results, chosen)


def render(run_dir: str | Path, slo_set_name: str | None = None) -> Path:
    """Re-draw the plots and write ``report.html`` for a results directory (judged against
    ``slo_set_name`` or the run's own ``--slo-set``); returns its path."""
    run = load_run(run_dir)
    decided = claims.evaluate(run)
    claims.write(run.path, decided)
    images = plots.render_all(run)
    sweep = run.sweep
    meta = run.meta
    head = [
        ("run", run.run_id),
        ("scale", run.scale),
        ("engine", meta.engine),
        *((f"stack {name}", label) for name, label in meta.stack_labels().items()),
        ("cpu layout", layout_text(meta.config)),
        ("loader", meta.loader or "?"),
        ("seed", meta.seed if meta.seed is not None else "per profile"),
        ("git revision", meta.git_revision),
        ("machine", meta.machine),
    ]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>zl-bench "
        f"{escape(run.run_id)}</title><style>{CSS}</style></head><body>",
        f"<h1>zl-bench report: {escape(run.run_id)}</h1>",
    ]
    if run.incomplete:
        reasons = "".join(f"<li>{escape(r)}</li>" for r in run.incomplete_reasons)
        parts.append(
            f"<div class='banner'>Incomplete run: the figures below cover only what "
            f"was measured before it stopped.<ul>{reasons}</ul></div>"
        )
    if sweep is not None:
        parts.append(_headline_section(sweep))
    parts.append(_table(["", ""], [[k, escape(str(v))] for k, v in head], left=2))
    parts += [
        _validity_section(run),
        parity_section(run.meta.parity),
        _points_section(sweep) if sweep is not None else "",
        _summary_section(run),
        turns_section(run),
        prefix_cache_section(run),
        lengths_section(run),
        _claims_section(decided),
        _slo_set_section(run, slo_set_name),
        _faults_section(run),
        _recovery_section(run),
        _chaos_trials_section(run),
        _telemetry_section(run),
        "<h2>Plots</h2>",
        _host_note(run),
    ]
    parts += [_image(p) for p in images]
    parts.append("</body></html>")
    out = run.path / schema.REPORT
    out.write_text("\n".join(p for p in parts if p), encoding="utf-8")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench report``'s arguments."""
    parser.add_argument("run", type=Path, help="a run's results directory, e.g. results/<run-id>")
    parser.add_argument(
        "--slo-set",
        help=f"also judge the run against a named SLO set ({', '.join(sorted(SLO_SETS))}); "
        "default: the one the run was asked for, if any",
    )


def run_command(args: argparse.Namespace) -> int:
    """Render the report; a path that is not a run directory is a UsageError (exit 2)."""
    print(f"wrote {render(args.run, args.slo_set)}")
    return 0
