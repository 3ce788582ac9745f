"""The overhead benchmark's report: one row of figures per level, the console's tables and
notes, the verdict, authentication's cost, and ``overhead.json`` / ``overhead.md``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from bench.overhead.model import Level, Role, Settings, added, floors, host_cores, minus
from bench.overhead.targets import AUTH_SUFFIX
from harness.tables import Align, Column, cells, markdown_table, text_table

LATENCY_COLUMNS = (
    Column("target", "target", align=Align.LEFT),
    Column("in-flight", "in_flight"),
    Column("req/s", "rate", 2),
    Column("n", "completed"),
    Column("err", "errors"),
    Column("ttft p50", "ttft_p50_ms", 3),
    Column("ttft p99", "ttft_p99_ms", 3),
    Column("e2el p50", "e2el_p50_ms", 3),
    Column("e2el p99", "e2el_p99_ms", 3),
    Column("+ttft p50", "added_ttft_p50_ms", 3),
    Column("+ttft p99", "added_ttft_p99_ms", 3),
    Column("+e2el p50", "added_e2el_p50_ms", 3),
    Column("+e2el p99", "added_e2el_p99_ms", 3),
    Column("lag p99", "lag_p99_ms", 3),
)
COST_COLUMNS = (
    Column("target", "target", align=Align.LEFT),
    Column("in-flight", "in_flight"),
    Column("tok/req", "tokens_per_request"),
    Column("short", "short_streams"),
    Column("cli us/req", "client_cpu_us_per_request"),
    Column("srv us/req", "server_cpu_us_per_request"),
    Column("srv us/tok", "server_cpu_us_per_token", 1),
    Column("layer us/tok", "layer_cpu_us_per_token", 1),
    Column("host busy %", "host_busy_pct"),
    Column("load1", "load1", 2),
    Column("saturated", "saturated"),
)


def _token_range(tokens: Sequence[int]) -> str | None:
    if not tokens:
        return None
    low, high = min(tokens), max(tokens)
    return str(low) if low == high else f"{low}-{high}"


def _cpu_row(level: Level) -> dict[str, Any]:
    """The level's CPU figures: the loader's, the server's (all and the layer's), the host's."""
    cpu = level.server_cpu
    return {
        "client_cpu_us_per_request": level.client_cpu_us,
        "server_cpu_s": cpu.total_s if cpu else None,
        "layer_cpu_s": cpu.layer_s if cpu else None,
        "server_cpu_us_per_request": level.server_us_per_request,
        "server_cpu_us_per_token": level.server_us_per_token,
        "layer_cpu_us_per_token": level.layer_us_per_token,
        "host_busy_pct": 100.0 * level.host.busy,
        "load1": level.host.load1,
        "saturated": "yes" if level.host.saturated else "no",
    }


def row(level: Level, floor: Level | None, max_tokens: int) -> dict[str, Any]:
    """Everything known about one level, keyed as the JSON output and the tables name it."""
    plus = added(level, floor)
    return {
        "target": level.target,
        "in_flight": level.in_flight,
        "rate": level.rate,
        "completed": level.completed,
        "errors": level.errors,
        "error_codes": level.error_codes,
        "ttft_p50_ms": level.ttft_p50_ms,
        "ttft_p99_ms": level.ttft_p99_ms,
        "e2el_p50_ms": level.e2el_p50_ms,
        "e2el_p99_ms": level.e2el_p99_ms,
        **{f"added_{k}": v for k, v in asdict(plus).items()},
        "lag_p99_ms": level.lag_p99_ms,
        "tokens_per_request": _token_range(level.tokens),
        "tokens_total": level.tokens_total,
        "short_streams": level.short_streams(max_tokens),
        **_cpu_row(level),
        "invalid_reasons": list(level.invalid_reasons),
    }


def rows(levels: Sequence[Level], max_tokens: int) -> list[dict[str, Any]]:
    """One row per level, each with what it adds over the in-process level of its in-flight."""
    floor = floors(levels)
    return [row(lv, floor.get(lv.in_flight), max_tokens) for lv in levels]


def table(levels: Sequence[Level], max_tokens: int = 0) -> str:
    """The side-by-side tables (latency, then costs) and any errors by code."""
    table_rows = rows(levels, max_tokens)
    notes = [f"{lv.target} at {lv.in_flight} in flight: errors {lv.error_codes}"
             for lv in levels if lv.error_codes]  # fmt: skip
    parts = [
        text_table(LATENCY_COLUMNS, cells(table_rows, LATENCY_COLUMNS)),
        "",
        text_table(COST_COLUMNS, cells(table_rows, COST_COLUMNS)),
    ]
    return "\n".join(parts + notes)


def _short_note(lv: Level, max_tokens: int) -> str | None:
    short = lv.short_streams(max_tokens)
    if not short:
        return None
    return (
        f"WARNING: {lv.target} at {lv.in_flight} in flight: {short} of {lv.completed} "
        f"requests streamed other than {max_tokens} tokens ({_token_range(lv.tokens)})"
    )


def _invalid_note(lv: Level) -> str | None:
    if not lv.invalid_reasons:
        return None
    return (
        f"NOTE: {lv.target} at {lv.in_flight} in flight is no valid latency measurement: "
        + "; ".join(lv.invalid_reasons)
    )


def _saturated_note(lv: Level) -> str | None:
    if not lv.host.saturated:
        return None
    return (
        f"NOTE: host saturated during {lv.target} at {lv.in_flight} in flight "
        f"(CPU {100 * lv.host.busy:.0f}% of {lv.host.cores} cores, "
        f"load {lv.host.load1:.2f}): trust its CPU figures over its latencies"
    )


def warnings(levels: Sequence[Level], max_tokens: int) -> list[str]:
    """Levels where a request streamed other than ``max_tokens`` tokens, whose summary says
    their latencies are invalid (the loader lagged, requests were lost), or the host saturated."""
    notes = (
        note
        for lv in levels
        for note in (_short_note(lv, max_tokens), _invalid_note(lv), _saturated_note(lv))
    )
    return [note for note in notes if note is not None]


def _signed(value: float | None, unit: str) -> str:
    return f"{value:+.2f} {unit}" if value is not None else "-"


def _us(value: float | None) -> str:
    return f"{value:.0f} us" if value is not None else "-"


def _less(a: float | None, b: float | None) -> bool | None:
    return None if a is None or b is None else a < b


def _by_role(levels: Sequence[Level], role: Role) -> dict[int, Level]:
    return {lv.in_flight: lv for lv in levels if lv.role is role}


def verdict(levels: Sequence[Level]) -> str | None:
    """One line: does the zero-layer stack (role OURS) add less than vLLM's own server (PEER)
    (added E2EL p50 and p99 over in-process, and the layer's CPU per streamed token) at every
    in-flight level both ran? None if they did not both run beside the floor."""
    floor, ours, peer = (_by_role(levels, r) for r in (Role.FLOOR, Role.OURS, Role.PEER))
    shared = sorted(n for n in ours if n in peer and n in floor)
    if not shared:
        return None
    latency: list[bool | None] = []
    cpu: list[bool | None] = []
    details = []
    for n in shared:
        a, b = ours[n], peer[n]
        plus_a, plus_b = added(a, floor[n]), added(b, floor[n])
        latency += [_less(plus_a.e2el_p50_ms, plus_b.e2el_p50_ms),
                    _less(plus_a.e2el_p99_ms, plus_b.e2el_p99_ms)]  # fmt: skip
        cpu.append(_less(a.layer_us_per_token, b.layer_us_per_token))
        details.append(
            f"{n} in flight: +e2el p50 {_signed(plus_a.e2el_p50_ms, 'ms')} vs "
            f"{_signed(plus_b.e2el_p50_ms, 'ms')}, p99 {_signed(plus_a.e2el_p99_ms, 'ms')} vs "
            f"{_signed(plus_b.e2el_p99_ms, 'ms')}, layer CPU/token "
            f"{_us(a.layer_us_per_token)} vs {_us(b.layer_us_per_token)}"
        )
    names = ours[shared[0]].target, peer[shared[0]].target
    return f"verdict: {names[0]} {_judge(latency, cpu)} {names[1]} ({'; '.join(details)})"


def _word(results: Sequence[bool | None]) -> str:
    """``less`` when every comparison came out less, ``more`` when none did, else ``mixed``."""
    if all(results):
        return "less"
    return "more" if not any(results) else "mixed"


def _judge(latency: Sequence[bool | None], cpu: Sequence[bool | None]) -> str:
    """The verdict's words: added latency and CPU per token, each less, more or mixed."""
    if None in latency or None in cpu:
        return "cannot be compared (figures missing) with"
    return f"adds {_word(latency)} latency and {_word(cpu)} layer CPU per token than"


def auth_costs(levels: Sequence[Level]) -> list[str]:
    """A line per stack run both ways (``NAME`` and ``NAME+auth``) and in-flight level: what
    authentication added to E2EL p50 and p99 and to the server's CPU per completed request."""
    by = {(lv.target, lv.in_flight): lv for lv in levels}
    lines = []
    for (target, n), on in by.items():
        off = by.get((target.removesuffix(AUTH_SUFFIX), n))
        if not target.endswith(AUTH_SUFFIX) or off is None:
            continue
        cpu = minus(on.server_us_per_request, off.server_us_per_request)
        lines.append(
            f"auth cost, {off.target} at {n} in flight: E2EL p50 "
            f"{_signed(minus(on.e2el_p50_ms, off.e2el_p50_ms), 'ms')}, p99 "
            f"{_signed(minus(on.e2el_p99_ms, off.e2el_p99_ms), 'ms')}, server CPU "
            f"{_signed(cpu, 'us')} per request ({_us(off.server_us_per_request)} -> "
            f"{_us(on.server_us_per_request)})"
        )
    return lines


def rates_text(rates: Mapping[int, float]) -> str:
    return ", ".join(f"{lv} in flight {r:.3g} req/s" for lv, r in rates.items())


def header(settings: Settings, rates: Mapping[int, float], source: str) -> str:
    """The run's one-line description: engine, levels, rates and the request."""
    w = settings.workload
    return (
        f"overhead: {w.engine} engine, {settings.duration_s:g} s per level, "
        f"in-flight {list(settings.levels)}, rates: "
        f"{f'{rates_text(rates)} ({source})' if rates else source}, "
        f"prompt {w.prompt_bytes} B, {w.max_tokens} output tokens, streamed"
        + (", in bursts of the in-flight count" if settings.burst else "")
    )


def _json(
    settings: Settings, levels: Sequence[Level], rates: Mapping[int, float], source: str
) -> dict[str, Any]:
    """``overhead.json``'s document: settings, rates, every row, the notes and the verdict."""
    max_tokens = settings.workload.max_tokens
    return {
        "workload": asdict(settings.workload),
        "levels": list(settings.levels),
        "duration_s": settings.duration_s,
        "warmup_s": settings.warmup_s,
        "burst": settings.burst,
        "rates": {str(k): v for k, v in rates.items()},
        "rate_source": source,
        "cores": host_cores(),
        "rows": rows(levels, max_tokens),
        "verdict": verdict(levels),
        "warnings": warnings(levels, max_tokens),
        "auth": settings.auth,
        "auth_cost": auth_costs(levels),
    }


def _markdown(
    settings: Settings, levels: Sequence[Level], rates: Mapping[int, float], source: str
) -> str:
    """``overhead.md``: the header, both tables, the notes and the verdict."""
    max_tokens = settings.workload.max_tokens
    table_rows = rows(levels, max_tokens)
    notes, line, costs = warnings(levels, max_tokens), verdict(levels), auth_costs(levels)
    md = [
        f"# zl-bench overhead ({settings.workload.engine} engine)",
        "",
        header(settings, rates, source),
        "",
        "Latency (ms from intended send; + is added over in-process):",
        "",
        markdown_table(LATENCY_COLUMNS, cells(table_rows, LATENCY_COLUMNS)),
        "",
        "Tokens and CPU:",
        "",
        markdown_table(COST_COLUMNS, cells(table_rows, COST_COLUMNS)),
    ]
    md += [""] + [f"- {n}" for n in notes] if notes else []
    md += ["", line] if line else []
    md += [""] + [f"- {c}" for c in costs] if costs else []
    return "\n".join(md) + "\n"


def write_out(
    out: Path, settings: Settings, levels: Sequence[Level], rates: Mapping[int, float], source: str
) -> None:
    """``overhead.json`` (settings, rates, every row, the verdict) and ``overhead.md``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = _json(settings, levels, rates, source)
    (out / "overhead.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (out / "overhead.md").write_text(_markdown(settings, levels, rates, source))
