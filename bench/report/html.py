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
from typing import Any

from bench.report import claims, plots
from bench.report.data import RunData, load_run, read_recovery
from bench.report.parity import parity_section
from harness import curves, metrics, schema
from harness.curves import Interval
from harness.schema import SummaryRow, SweepSection

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


def _cell(value: Any, fmt: str) -> str:
    if isinstance(value, int | float):
        return fmt.format(value)
    return escape(str(value)) if value is not None else "-"


def _table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    head = "".join(
        f"<th class='l'>{h}</th>" if i < left else f"<th>{h}</th>" for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class='l'>{c}</td>" if i < left else f"<td>{c}</td>" for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


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


def _claims_section(run: RunData) -> str:
    """The claims table, from the verdicts it also writes to ``claims.json``."""
    results = claims.evaluate(run)
    if run.path.is_dir():
        claims.write(run.path, results)
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
        "a claim is undecided.</p>"
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


NOT_AVAILABLE = "n/a"
LENGTH_KEYS: tuple[str, ...] = ("mean", "p10", "p50", "p90", "p99")


def _or_na(value: float | None, fmt: str) -> str:
    """A figure, or "n/a" where the stack did not report it (never a misleading 0)."""
    return NOT_AVAILABLE if value is None else fmt.format(value)


def _length_cells(stats: schema.LengthStats) -> list[str]:
    return [f"{stats.count}", *(_or_na(getattr(stats, k), "{:.1f}") for k in LENGTH_KEYS)]


def _lengths_section(run: RunData) -> str:
    """Every profile's prompt and output lengths in tokens as sent and answered, beside the
    workload file's own distribution where the run recorded it."""
    rows = []
    for profile in run.profiles:
        workload = run.workload_lengths(profile)
        for which, lengths in (
            ("input", metrics.input_lengths),
            ("output", metrics.output_lengths),
        ):
            for stack in run.stacks:
                recs = run.records.get((stack, profile))
                if recs:
                    rows.append(
                        [escape(profile), which, escape(stack), *_length_cells(lengths(recs))]
                    )
            if which in workload:
                rows.append(
                    [escape(profile), which, "workload file", *_length_cells(workload[which])]
                )
    if not rows:
        return ""
    headers = ["profile", "tokens", "source", "count", "mean", "p10", "p50", "p90", "p99"]
    note = (
        "<p>Input: prompt tokens of every request sent; output: tokens of completed requests; "
        "the workload file's rows are its own distribution.</p>"
    )
    return "<h2>Input and output lengths (tokens)</h2>" + note + _table(headers, rows, left=3)


def _turns_section(run: RunData) -> str:
    """Per multi-turn profile, per stack and turn: requests, completions, TTFT percentiles and
    mean prompt tokens (the history grows turn by turn)."""
    parts = []
    for profile in run.turn_profiles:
        rows = [
            [
                escape(stack),
                f"{t.turn}",
                f"{t.count}",
                f"{t.completed}",
                _cell(t.p50_ttft_ms, "{:.2f}"),
                _cell(t.p90_ttft_ms, "{:.2f}"),
                _cell(t.p99_ttft_ms, "{:.2f}"),
                f"{t.mean_prompt_tokens:.1f}",
            ]
            for stack in run.stacks
            for t in metrics.by_turn(run.records.get((stack, profile), []))
        ]
        headers = [
            "stack",
            "turn",
            "requests",
            "completed",
            "TTFT p50 (ms)",
            "TTFT p90 (ms)",
            "TTFT p99 (ms)",
            "mean prompt tokens",
        ]
        parts.append(f"<h3>By turn: {escape(profile)}</h3>" + _table(headers, rows, left=1))
    return "<h2>Multi-turn sessions</h2>" + "".join(parts) if parts else ""


def _prefix_cache_profiles(run: RunData) -> list[str]:
    """Multi-turn profiles, and any other whose stacks reported prefix-cache lookups."""
    turned = set(run.turn_profiles)
    return [
        p
        for p in run.profiles
        if p in turned or any(run.prefix_cache(s, p).queries for s in run.stacks)
    ]


def _prefix_cache_section(run: RunData) -> str:
    """Per stack: the engines' prefix-cache hit rate and prefilled tokens per request."""
    rows = []
    for profile in _prefix_cache_profiles(run):
        for stack in run.stacks:
            cache = run.prefix_cache(stack, profile)
            rate = None if cache.hit_rate is None else 100 * cache.hit_rate
            rows.append(
                [
                    escape(stack),
                    escape(profile),
                    _or_na(cache.queries, "{:.0f}"),
                    _or_na(cache.hits, "{:.0f}"),
                    _or_na(rate, "{:.1f} %"),
                    _or_na(cache.prefilled_per_request, "{:.1f}"),
                ]
            )
    if not rows:
        return ""
    headers = [
        "stack",
        "profile",
        "prompt tokens looked up",
        "cache hits (tokens)",
        "hit rate",
        "prefilled tokens / request",
    ]
    note = (
        "<p>From the engines' <code>vllm:prefix_cache_queries</code> and "
        "<code>vllm:prefix_cache_hits</code> over the profile, summed over replicas; n/a where "
        "the stack's engines reported no lookups (no engine telemetry, or no prefix cache).</p>"
    )
    return "<h2>Prefix cache</h2>" + note + _table(headers, rows, left=2)


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


def render(run_dir: str | Path) -> Path:
    """Re-draw the plots and write ``report.html`` for a results directory; returns its path."""
    run = load_run(run_dir)
    images = plots.render_all(run)
    sweep = run.sweep
    meta = run.meta
    head = [
        ("run", run.run_id),
        ("scale", run.scale),
        ("engine", meta.engine),
        *((f"stack {name}", label) for name, label in meta.stack_labels().items()),
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
        _turns_section(run),
        _prefix_cache_section(run),
        _lengths_section(run),
        _claims_section(run),
        _faults_section(run),
        _recovery_section(run),
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


def run_command(args: argparse.Namespace) -> int:
    """Render the report; a path that is not a run directory is a UsageError (exit 2)."""
    print(f"wrote {render(args.run)}")
    return 0
