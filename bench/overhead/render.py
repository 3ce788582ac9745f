"""The overhead benchmark's report: the figures over repeats (intervals over each target's valid
repeats, and what it adds over in-process, paired by repeat), every level as measured with the
host's speed and load and why it is not valid, the notes, the verdicts, authentication's cost,
and ``overhead.json`` / ``overhead.md``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from bench.overhead.model import LATENCY, Level, Role, Settings, added, floors, host_cores
from bench.overhead.summary import (
    LABELS,
    Summary,
    judge,
    paired,
    reference_speed,
    summarize,
    valid_levels,
    verdicts,
)
from bench.overhead.targets import AUTH_SUFFIX
from harness.curves import Interval
from harness.tables import MISSING, Align, Column, cells, markdown_table, text_table

_TARGET = Column("target", "target", align=Align.LEFT)
_IN_FLIGHT = Column("in-flight", "in_flight")
SUMMARY_COLUMNS = (
    _TARGET,
    _IN_FLIGHT,
    Column("valid", "valid"),
    *(Column(LABELS[name], name) for name in LATENCY),
)
ADDED_COLUMNS = (_TARGET, _IN_FLIGHT, *(Column("+" + LABELS[name], name) for name in LATENCY))
COST_COLUMNS = (
    _TARGET,
    _IN_FLIGHT,
    Column("cli us/req", "client_cpu_us"),
    Column("srv us/req", "server_us_per_request"),
    Column("srv us/tok", "server_us_per_token"),
    Column("layer us/tok", "layer_us_per_token"),
)
LEVEL_COLUMNS = (
    _TARGET,
    _IN_FLIGHT,
    Column("rep", "repeat"),
    Column("req/s", "rate", 2),
    Column("n", "completed"),
    Column("err", "errors"),
    Column("tok/req", "tokens_per_request"),
    Column("e2el p50", "e2el_p50_ms", 3),
    Column("srv us/tok", "server_cpu_us_per_token", 1),
    Column("layer us/tok", "layer_cpu_us_per_token", 1),
    Column("lag p99", "lag_p99_ms", 3),
    Column("host busy %", "host_busy_pct"),
    Column("busiest %", "host_busiest_pct"),
    Column("rest %", "rest_busiest_pct"),
    Column("wait %", "wait_share_pct"),
    Column("load1", "load1", 2),
    Column("speed", "speed_k", 0),
    Column("valid", "valid_text", align=Align.LEFT),
)


def _token_range(tokens: Sequence[int]) -> str | None:
    if not tokens:
        return None
    low, high = min(tokens), max(tokens)
    return str(low) if low == high else f"{low}-{high}"


def _cpu_row(level: Level) -> dict[str, Any]:
    """The level's CPU figures: the loader's, the server's (all and the layer's), the host's."""
    cpu = level.server_cpu
    host = level.host
    return {
        "client_cpu_us_per_request": level.client_cpu_us,
        "server_cpu_s": cpu.total_s if cpu else None,
        "layer_cpu_s": cpu.layer_s if cpu else None,
        "server_cpu_us_per_request": level.server_us_per_request,
        "server_cpu_us_per_token": level.server_us_per_token,
        "layer_cpu_us_per_token": level.layer_us_per_token,
        "host_busy_pct": 100.0 * host.busy,
        "host_busiest_pct": 100.0 * host.busiest,
        "rest_busiest_pct": None if host.rest_busiest is None else 100.0 * host.rest_busiest,
        "wait_share_pct": None if host.wait_share is None else 100.0 * host.wait_share,
        "load1": host.load1,
        "host_speed": host.speed,
        "saturated": "yes" if host.saturated else "no",
    }


def row(
    level: Level, floor: Level | None, max_tokens: int, speed: float | None = None
) -> dict[str, Any]:
    """Everything known about one level as measured, keyed as ``overhead.json`` names it."""
    problems = level.problems(speed)
    return {
        "target": level.target,
        "in_flight": level.in_flight,
        "repeat": level.repeat + 1,
        "rate": level.rate,
        "completed": level.completed,
        "errors": level.errors,
        "error_codes": level.error_codes,
        **{name: getattr(level, name) for name in LATENCY},
        **{f"added_{k}": v for k, v in added(level, floor).items()},
        "lag_p99_ms": level.lag_p99_ms,
        "tokens_per_request": _token_range(level.tokens),
        "tokens_total": level.tokens_total,
        "short_streams": level.short_streams(max_tokens),
        **_cpu_row(level),
        "invalid_reasons": problems,
    }


def rows(levels: Sequence[Level], max_tokens: int) -> list[dict[str, Any]]:
    """One row per level as measured, each with what it adds over the in-process level of the
    same in-flight count and repeat."""
    floor = floors(levels)
    speed = reference_speed(levels)
    return [row(lv, floor.get((lv.in_flight, lv.repeat)), max_tokens, speed) for lv in levels]


def _cell(figure: Interval, signed: bool = False) -> str:
    """``1.234±0.056`` (mean and the interval's half width over the valid repeats); the mean
    alone for one repeat; a dash for none."""
    if figure.value is None:
        return MISSING
    spec = "+.3f" if signed else ".3f"
    digits = 3 if abs(figure.value) < 100 else 1
    spec = spec.replace(".3", f".{digits}")
    if figure.n < 2 or figure.high is None:
        return format(figure.value, spec)
    return f"{figure.value:{spec}}±{figure.high - figure.value:.{digits}f}"


def _summary_cells(summaries: Sequence[Summary], columns: Sequence[Column]) -> list[list[str]]:
    out = []
    for sm in summaries:
        line = []
        for c in columns:
            if c.key == "target":
                line.append(sm.target)
            elif c.key == "in_flight":
                line.append(str(sm.in_flight))
            elif c.key == "valid":
                line.append(f"{sm.valid}/{sm.repeats}")
            elif c.header.startswith("+"):
                line.append(_cell(sm.added[c.key], signed=True))
            else:
                line.append(_cell(sm.figures[c.key]))
        out.append(line)
    return out


def _level_cells(levels: Sequence[Level], max_tokens: int) -> list[list[str]]:
    table_rows = rows(levels, max_tokens)
    for r in table_rows:
        r["speed_k"] = None if r["host_speed"] is None else r["host_speed"] / 1000
        r["valid_text"] = "yes" if not r["invalid_reasons"] else "; ".join(r["invalid_reasons"])
    return cells(table_rows, LEVEL_COLUMNS)


def _sections(levels: Sequence[Level], max_tokens: int) -> list[tuple[str, Any, Any]]:
    """Each table: its title, its columns and its cells."""
    summaries = summarize(levels)
    with_floor = [sm for sm in summaries if any(f.value is not None for f in sm.added.values())]
    sections = [
        ("Latency over valid repeats (ms, from intended send; mean±95 % interval):",
         SUMMARY_COLUMNS, _summary_cells(summaries, SUMMARY_COLUMNS)),
        ("Added over in-process (ms, paired by repeat):",
         ADDED_COLUMNS, _summary_cells(with_floor, ADDED_COLUMNS)),
        ("CPU over valid repeats (us; srv: every server process; layer: less vLLM's own):",
         COST_COLUMNS, _summary_cells(summaries, COST_COLUMNS)),
        ("Every level as measured (rest %: the busiest of the loader's and layers' cores; wait "
         "%: their runnable time spent waiting for a core; speed: one core's SHA-256 "
         "digests/ms before it):",
         LEVEL_COLUMNS, _level_cells(levels, max_tokens)),
    ]  # fmt: skip
    return [s for s in sections if s[2]]


def table(levels: Sequence[Level], max_tokens: int = 0) -> str:
    """The tables (figures over repeats, added, CPU, every level) and any errors by code."""
    notes = [f"{lv.target} at {lv.in_flight} in flight, repeat {lv.repeat + 1}: errors "
             f"{lv.error_codes}" for lv in levels if lv.error_codes]  # fmt: skip
    parts = [f"{title}\n{text_table(columns, body)}"
             for title, columns, body in _sections(levels, max_tokens)]  # fmt: skip
    return "\n\n".join(parts) + ("\n" + "\n".join(notes) if notes else "")


def _short_note(lv: Level, max_tokens: int) -> str | None:
    short = lv.short_streams(max_tokens)
    if not short:
        return None
    return (
        f"WARNING: {lv.target} at {lv.in_flight} in flight, repeat {lv.repeat + 1}: {short} of "
        f"{lv.completed} requests streamed other than {max_tokens} tokens "
        f"({_token_range(lv.tokens)})"
    )


def warnings(levels: Sequence[Level], max_tokens: int) -> list[str]:
    """Levels where a request streamed other than ``max_tokens`` tokens, and how many levels
    were left out of the figures and verdicts as no valid measurement (each one's reason is in
    the table of every level)."""
    notes = [note for lv in levels if (note := _short_note(lv, max_tokens)) is not None]
    left_out = len(levels) - len(valid_levels(levels))
    if left_out:
        notes.append(
            f"NOTE: {left_out} of {len(levels)} levels were no valid measurement (the loader "
            "lagged, requests were lost, or the host was saturated or slowed): left out of every "
            "figure over repeats and every verdict"
        )
    return notes


def verdict(levels: Sequence[Level], over_reference: bool = False) -> list[str]:
    """The verdict lines: the zero-layer stack against each target it is judged against, paired
    by repeat over the levels valid on both sides; empty when no such pair ran."""
    ours = next((lv.target for lv in levels if lv.role is Role.OURS), None)
    if ours is None:
        return []
    return verdicts(judge(levels, over_reference), ours)


def auth_costs(levels: Sequence[Level]) -> list[str]:
    """A line per stack run both ways (``NAME`` and ``NAME+auth``) and in-flight level: what
    authentication added to E2EL p50 and p99 and to the server's CPU per completed request,
    paired by repeat over the valid levels."""
    valid = valid_levels(levels)
    pairs = dict.fromkeys(
        (lv.target.removesuffix(AUTH_SUFFIX), lv.in_flight)
        for lv in levels
        if lv.target.endswith(AUTH_SUFFIX)
    )
    lines = []
    for plain, n in pairs:
        on = plain + AUTH_SUFFIX
        e2el = [paired(valid, on, plain, n, name).text("+.2f", "ms")
                for name in ("e2el_p50_ms", "e2el_p99_ms")]  # fmt: skip
        cpu = paired(valid, on, plain, n, "server_us_per_request").text("+.1f", "us")
        lines.append(f"auth cost, {plain} at {n} in flight: E2EL p50 {e2el[0]}, p99 {e2el[1]}, "
                     f"server CPU {cpu} per request")  # fmt: skip
    return lines


def rates_text(rates: Mapping[int, float]) -> str:
    return ", ".join(f"{lv} in flight {r:.3g} req/s" for lv, r in rates.items())


def header(settings: Settings, rates: Mapping[int, float], source: str) -> str:
    """The run's one-line description: engine, levels, rates, repeats and the request."""
    w = settings.workload
    options = ", ".join(f"{k}={v}" for k, v in w.engine_options.items() if k != "model")
    return (
        f"overhead: {w.engine} engine{f' ({options})' if options else ''}, "
        f"{settings.repeats} repeats in a balanced order, {settings.duration_s:g} s per level, "
        f"in-flight {list(settings.levels)}, rates: "
        f"{f'{rates_text(rates)} ({source})' if rates else source}, "
        f"prompt {w.prompt_bytes} B, {w.max_tokens} output tokens, streamed"
        + (", in bursts of the in-flight count" if settings.burst else "")
    )


def summary_rows(levels: Sequence[Level]) -> list[dict[str, Any]]:
    """Each target and level over the repeats, as ``overhead.json``'s ``summary`` holds it."""
    return [
        {
            "target": sm.target,
            "in_flight": sm.in_flight,
            "repeats": sm.repeats,
            "valid": sm.valid,
            **{name: _interval_data(f) for name, f in sm.figures.items()},
            **{f"added_{name}": _interval_data(f) for name, f in sm.added.items()},
        }
        for sm in summarize(levels)
    ]


def _interval_data(figure: Interval) -> dict[str, Any]:
    return {"mean": figure.value, "low": figure.low, "high": figure.high, "n": figure.n}


def _json(
    settings: Settings, levels: Sequence[Level], rates: Mapping[int, float], source: str
) -> dict[str, Any]:
    """``overhead.json``'s document: settings, rates, every level, the figures over repeats, the
    notes and the verdicts."""
    max_tokens = settings.workload.max_tokens
    over_reference = settings.workload.kind.is_reference
    return {
        "workload": asdict(settings.workload),
        "levels": list(settings.levels),
        "repeats": settings.repeats,
        "duration_s": settings.duration_s,
        "warmup_s": settings.warmup_s,
        "burst": settings.burst,
        "rates": {str(k): v for k, v in rates.items()},
        "rate_source": source,
        "cores": host_cores(),
        "rows": rows(levels, max_tokens),
        "summary": summary_rows(levels),
        "verdict": verdict(levels, over_reference),
        "warnings": warnings(levels, max_tokens),
        "auth": settings.auth,
        "auth_cost": auth_costs(levels),
    }


def _markdown(
    settings: Settings, levels: Sequence[Level], rates: Mapping[int, float], source: str
) -> str:
    """``overhead.md``: the header, the tables, the notes and the verdicts."""
    max_tokens = settings.workload.max_tokens
    notes, costs = warnings(levels, max_tokens), auth_costs(levels)
    lines = verdict(levels, settings.workload.kind.is_reference)
    md = [f"# zl-bench overhead ({settings.workload.engine} engine)", ""]
    md.append(header(settings, rates, source))
    for title, columns, body in _sections(levels, max_tokens):
        md += ["", title, "", markdown_table(columns, body)]
    md += [""] + [f"- {n}" for n in notes] if notes else []
    md += [""] + [f"- {line}" for line in lines] if lines else []
    md += [""] + [f"- {c}" for c in costs] if costs else []
    return "\n".join(md) + "\n"


def write_out(
    out: Path, settings: Settings, levels: Sequence[Level], rates: Mapping[int, float], source: str
) -> None:
    """``overhead.json`` (settings, rates, every level, the summaries, the verdicts) and
    ``overhead.md``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = _json(settings, levels, rates, source)
    (out / "overhead.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (out / "overhead.md").write_text(_markdown(settings, levels, rates, source))
