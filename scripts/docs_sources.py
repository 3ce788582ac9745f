"""The figures each table of the docs shows, extracted from a command's results: one function
per kind of results (``overhead --out``, ``capacity --out``, a run or sweep directory, ...),
used by ``docs_measured.py``'s registry."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import orjson

MIB: Final = 1 << 20

Row = dict[str, Any]


def run_dir(results: Path) -> Path | None:
    """The run directory at ``results`` (or the one run directory under it, as ``--out`` of
    run and sweep makes it); None for a results file or a directory without ``run.json``."""
    if (results / "run.json").is_file():
        return results
    found = sorted(results.glob("*/run.json")) if results.is_dir() else []
    if len(found) > 1:
        raise SystemExit(f"{results}: {len(found)} runs under it; name one")
    return found[0].parent if found else None


# --- extraction: the figures a table shows, from a command's results ---------------------------


def _json(path: Path, name: str = "") -> Any:
    """A JSON results file, or ``name`` inside a results directory."""
    return orjson.loads((path / name if path.is_dir() and name else path).read_bytes())


def overhead_rows(results: Path) -> list[Row]:
    """``zl-bench overhead --out DIR``: one row per target and in-flight level."""
    return [
        {**row, "valid": "no" if row["invalid_reasons"] else "yes"}
        for row in _json(results, "overhead.json")["rows"]
    ]


def capacity_rows(results: Path) -> list[Row]:
    """``zl-bench capacity --out FILE``: per loader and rate, the best and worst p99 lag over
    the repeats and how many repeats kept to the schedule (the command's own rule)."""
    runs: list[Row] = _json(results)
    keys = sorted({(r["loader"], r["rate"]) for r in runs}, key=lambda k: (k[0] != "native", k))
    out = []
    for loader, rate in keys:
        got = [r for r in runs if (r["loader"], r["rate"]) == (loader, rate)]
        lags = [r["p99_lag_ms"] for r in got if r["p99_lag_ms"] is not None]
        out.append({
            "loader": f"{loader} ({got[0]['protocol']})",
            "rate": rate,
            "best_lag": min(lags, default=None),
            "worst_lag": max(lags, default=None),
            "sustained": f"{sum(bool(r['sustained']) for r in got)}/{len(got)}",
        })  # fmt: skip
    return out


def attack_rows(results: Path) -> list[Row]:
    """``zl-bench attack --out FILE``: each attack's verdict and the numbers it was judged on."""
    return [
        {
            "attack": o["attack"],
            "item": o["item"],
            "verdict": o["verdict"],
            "healthy": f"{o['healthy_ok']}/{o['healthy_total']}",
            "rss_growth_mib": (o["rss_peak"] - o["rss_before"]) / MIB,
            "rss_bound_mib": o["rss_bound"] / MIB,
            "active_after": "gone" if o["active_after"] is None else o["active_after"],
        }
        for o in _json(results)["outcomes"]
    ]


def benchmark_rows(results: Path) -> list[Row]:
    """``pytest benchmarks --benchmark-json FILE``: each benchmark's CPU time per call."""
    return [
        {
            "benchmark": b["name"],
            "median_us": 1e6 * b["stats"]["median"],
            "iqr_us": 1e6 * b["stats"]["iqr"],
            "rounds": b["stats"]["rounds"],
        }
        for b in _json(results)["benchmarks"]
    ]


def _summary(run: Path) -> dict[str, Any]:
    return _json(run, "summary.json")


def _interval(figure: dict[str, Any] | None) -> str | None:
    """A headline interval as its cell: ``value [low, high]``, the value alone from one repeat,
    the reason it has none (its ``note``) or None."""
    if not figure:
        return None
    value, low, high = figure.get("value"), figure.get("low"), figure.get("high")
    if value is None:
        return figure.get("note") or None
    if low is None or high is None or figure.get("n", 0) < 2:
        return f"{value:.1f}"
    return f"{value:.1f} [{low:.1f}, {high:.1f}]"


def _figure(figure: dict[str, Any] | None) -> dict[str, Any] | None:
    """A headline interval with what its cell shows: value, bounds, repeats and why none."""
    keep = ("value", "low", "high", "n", "note")
    return {k: figure.get(k) for k in keep} if figure else None


def sweep_rows(results: Path) -> list[Row]:
    """``zl-bench sweep --out DIR``: per stack the rates it ran, the headline figures
    (intervals over repeats), the rates at which the host's CPU was full, and (baseline's row)
    the rate at which its median E2EL passes the zero-layer's by the bound."""
    run = run_dir(results)
    assert run is not None, f"{results}: no sweep run directory"
    section = _summary(run)["sweep"]
    added = section.get("added_latency") or {}
    out = []
    for stack, data in section["stacks"].items():
        head = data["headline"]
        rates = sorted({p["offered_rate"] for p in section["points"] if p["stack"] == stack})
        out.append({
            "profile": section["profile"],
            "stack": stack,
            "rates": rates,
            "repeats": section["repeats"],
            "max_goodput": _figure(head.get("max_goodput")),
            "knee": _figure(head.get("knee")),
            "host_full": data.get("host_saturated_rates") or [],
            "added_latency": _figure(added.get("rate")) if stack == "baseline" else None,
            "stopped": data.get("stopped") or None,
        })  # fmt: skip
    return out


def _rates(rates: Sequence[float]) -> str | None:
    return ", ".join(f"{r:.4g}" for r in rates) or None


def sweep_cells(row: Row) -> Row:
    """A sweep row as its table shows it: intervals and lists of rates as text."""
    tried = row["rates"]
    span = f"{min(tried):.4g}-{max(tried):.4g} ({len(tried)})" if tried else None
    shown = {k: _interval(row[k]) for k in ("max_goodput", "knee", "added_latency")}
    return {**row, **shown, "rates": span, "host_full": _rates(row["host_full"])}


def _setup(meta: dict[str, Any], stack: str) -> str:
    """A stack's routing and caching set-up in words, from run.json."""
    settings = meta["stacks"][stack]
    caching = settings.get("engine_options", {}).get("enable_prefix_caching", True)
    if stack == "baseline":
        name = f"baseline, `{settings.get('router', '?')}`"
    else:
        name = "zero-layer (SDK ring)" if stack == "zerolayer" else stack
    return name + ("" if caching else ", prefix caching off")


def session_rows(results: Path) -> list[Row]:
    """``zl-bench run --profiles e,f --out DIR``: per profile and stack the prefix-cache hit
    rate, prompt tokens prefilled per request and the TTFT p50 of turns 1-6."""
    run = run_dir(results)
    assert run is not None, f"{results}: no run directory"
    meta = orjson.loads((run / "run.json").read_bytes())
    rows = _summary(run)["rows"]
    seen = [(r["profile"], r["stack"]) for r in rows]
    if len(seen) != len(set(seen)):
        raise SystemExit(f"{run}: more than one repeat per profile and stack; run --repeats 1")
    out = []
    for r in rows:
        cache = r.get("prefix_cache") or {}
        turns = {t["turn"]: t.get("p50_ttft_ms") for t in r.get("by_turn") or []}
        rate = cache.get("hit_rate")
        out.append({
            "profile": r["profile"],
            "setup": _setup(meta, r["stack"]),
            "requests": r["num_requests"],
            "hit_rate": None if rate is None else 100.0 * rate,
            "prefilled": cache.get("prefilled_tokens_per_request"),
            **{f"t{k}": turns.get(k) for k in range(1, 7)},
        })  # fmt: skip
    return out
