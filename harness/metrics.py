"""The one home of metric definitions; every summary, plot and report reads these keys.

Definitions and names follow vLLM's ``vllm bench serve`` so figures line up with it:
- TTFT: first content chunk - send; E2EL: last byte - send; both per completed request.
- TPOT per request: ``(e2el - ttft) / (output_tokens - 1)``, for requests with more than one token.
- ITL: the gaps between consecutive content chunks, pooled over all completed requests.
- Throughputs over the run's duration: ``request_throughput`` (completed/s), ``output_throughput``
  (output tokens/s), ``total_token_throughput`` (prompt + output tokens/s), ``request_goodput``
  (completed requests/s that met every SLO given, each request judged alone as ``vllm bench
  serve --goodput`` judges it).
- SLOs (``Slo``): a bound on a percentile of TTFT, TPOT or E2EL, e.g. ``ttft_p99_ms = 500``. The
  bound judges each request for goodput; the percentile judges the run (``slo_met``: every SLO's
  percentile within its bound), which is what a sweep's knee is found by.
- Statistics per series: ``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` (population, as numpy and
  vLLM compute it) and ``pNN_X_ms`` (numpy's linear percentile; p99.9 is ``p99.9_X_ms``).
Beyond vLLM, for coordinated-omission-free reporting: ``e2el_intended`` and ``ttft_intended``
measure from the schedule's intended send time, ``client_queue`` is sent - intended, and ``lag``
is the loader's scheduling lag (dispatch - intended). Counts: completed, errors by code, lost.
The full latency distributions go into the summary as encoded HdrHistograms.
Workload shape: ``input_lens`` / ``output_lens`` (count, mean, p10/p50/p90/p99 of prompt and
output tokens) and, for multi-turn workloads, ``by_turn`` (per turn number: count, completed,
TTFT p50/p90/p99, mean prompt tokens). A run adds ``prefix_cache`` from engine telemetry
(``prefix_cache_stats``): tokens looked up and hit, hit rate, prefilled tokens per request.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from hdrh.histogram import HdrHistogram

from harness.schema import LengthStats, PrefixCacheStats, RequestRecord, TurnStats, to_data

PERCENTILES: Final = (50.0, 90.0, 95.0, 99.0, 99.9)
SERIES: Final = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "ttft_intended",
    "e2el_intended",
    "client_queue",
    "lag",
)
HDR_SERIES: Final = ("ttft", "itl", "e2el", "e2el_intended", "lag")
SLO_SERIES: Final = ("ttft", "tpot", "e2el")
DEFAULT_SLO_PERCENTILE: Final = 99.0
FAILED_FRACTION_LIMIT: Final = 0.05
SERVED_FRACTION_LIMIT: Final = 0.8
LAG_LIMIT_MS: Final = 1.0
LAG_FLOOR_MS: Final = 0.1
LAG_FRACTION_OF_MEDIAN: Final = 0.01
HDR_LOWEST_US: Final = 1
HDR_HIGHEST_US: Final = 3_600_000_000
HDR_DIGITS: Final = 3
NS_PER_MS: Final = 1_000_000.0


def percentile_key(p: float) -> str:
    """vLLM's spelling: ``p99`` for 99, ``p99.9`` for 99.9."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


_SLO_NAME = re.compile(r"^(?P<series>[a-z0-9]+)(?:_p(?P<pct>\d+(?:\.\d+)?))?(?:_ms)?$")


@dataclass(frozen=True, slots=True)
class Slo:
    """A service-level objective: the ``percentile`` of ``series`` within ``bound_ms``."""

    series: str
    percentile: float
    bound_ms: float

    def __post_init__(self) -> None:
        if self.series not in SLO_SERIES:
            raise ValueError(
                f"SLO series must be one of {', '.join(SLO_SERIES)}, not {self.series!r}"
            )
        if not 0 < self.percentile <= 100:
            raise ValueError(f"SLO percentile must lie in (0, 100], got {self.percentile:g}")
        if not self.bound_ms > 0:
            raise ValueError(f"SLO bound must be a positive number of ms, got {self.bound_ms!r}")

    @property
    def name(self) -> str:
        """The profile TOML's spelling, ``ttft_p99_ms``."""
        return f"{self.series}_{percentile_key(self.percentile)}_ms"

    @property
    def stat_key(self) -> str:
        """The summary statistic it bounds, in vLLM's spelling: ``p99_ttft_ms``."""
        return f"{percentile_key(self.percentile)}_{self.series}_ms"

    def __str__(self) -> str:
        return f"{self.series.upper()} {percentile_key(self.percentile)} <= {self.bound_ms:g} ms"


def parse_slo(name: str, bound_ms: Any, percentile: float = DEFAULT_SLO_PERCENTILE) -> Slo:
    """An SLO from its name (``ttft``, ``ttft_p90`` or ``ttft_p90_ms``) and its bound in ms."""
    match = _SLO_NAME.match(name.strip().lower())
    if match is None:
        raise ValueError(f"cannot read SLO name {name!r}; write e.g. ttft_p99_ms or ttft")
    if isinstance(bound_ms, bool) or not isinstance(bound_ms, int | float | str):
        raise ValueError(f"SLO {name}: the bound must be a number of ms, got {bound_ms!r}")
    try:
        bound = float(bound_ms)
    except ValueError:
        raise ValueError(
            f"SLO {name}: the bound must be a number of ms, got {bound_ms!r}"
        ) from None
    pct = float(match["pct"]) if match["pct"] else percentile
    return Slo(match["series"], pct, bound)


def parse_slo_option(text: str) -> Slo:
    """``--slo`` as vLLM spells ``--goodput``: ``ttft:500``, or ``ttft_p90:500`` for another
    percentile than p99."""
    name, sep, bound = text.partition(":")
    if not sep:
        raise ValueError(f"--slo {text!r}: expected NAME:MS, e.g. ttft:500 or e2el_p90:2000")
    return parse_slo(name, bound)


def override_slos(slos: Sequence[Slo], overrides: Sequence[Slo]) -> tuple[Slo, ...]:
    """``slos`` with each series given in ``overrides`` replaced (the command line wins)."""
    given = {o.series: o for o in overrides}
    kept = [s for s in slos if s.series not in given]
    return tuple(sorted([*kept, *given.values()], key=lambda s: SLO_SERIES.index(s.series)))


def slo_met(stats: Mapping[str, Any], slos: Sequence[Slo]) -> bool | None:
    """Whether every SLO's percentile lies within its bound; None without SLOs. A series with no
    value (nothing completed) misses its SLO."""
    if not slos:
        return None
    return all(stats.get(s.stat_key) is not None and stats[s.stat_key] <= s.bound_ms for s in slos)


def describe(name: str, values_ms: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std and percentiles of one series, keyed ``{stat}_{name}_ms``.

    An empty series has no statistics: every value is None (null on disk), never 0 ms, so a
    profile that completed nothing cannot read as infinitely fast.
    """
    arr = np.asarray(values_ms, dtype=float)
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"{percentile_key(p)}_{name}_ms" for p in PERCENTILES]
    if arr.size == 0:
        return dict.fromkeys(keys, None)
    values = [float(arr.mean()), float(np.median(arr)), float(arr.std())]
    values += [float(v) for v in np.percentile(arr, PERCENTILES)]
    return dict(zip(keys, values, strict=True))


def tpot_ms(rec: RequestRecord) -> float | None:
    """Time per output token after the first, or None for a single-token answer."""
    if rec.output_tokens <= 1 or not rec.first_token_ns:
        return None
    return (rec.end_ns - rec.first_token_ns) / NS_PER_MS / (rec.output_tokens - 1)


def series(records: Iterable[RequestRecord]) -> dict[str, list[float]]:
    """Every per-request (or per-chunk, for ITL) series in milliseconds, keyed as in SERIES."""
    out: dict[str, list[float]] = {name: [] for name in SERIES}
    for r in records:
        if r.dispatch_ns:
            out["lag"].append((r.dispatch_ns - r.intended_start_ns) / NS_PER_MS)
        if r.sent_ns:
            out["client_queue"].append((r.sent_ns - r.intended_start_ns) / NS_PER_MS)
        if r.outcome != "completed":
            continue
        out["e2el"].append((r.end_ns - r.sent_ns) / NS_PER_MS)
        out["e2el_intended"].append((r.end_ns - r.intended_start_ns) / NS_PER_MS)
        if r.first_token_ns:
            out["ttft"].append((r.first_token_ns - r.sent_ns) / NS_PER_MS)
            out["ttft_intended"].append((r.first_token_ns - r.intended_start_ns) / NS_PER_MS)
        tpot = tpot_ms(r)
        if tpot is not None:
            out["tpot"].append(tpot)
        chunks = r.chunk_ns
        out["itl"].extend((b - a) / NS_PER_MS for a, b in itertools.pairwise(chunks))
    return out


def meets_slos(rec: RequestRecord, slos: Sequence[Slo]) -> bool:
    """A completed request within every SLO's bound (vLLM's per-request goodput test)."""
    if rec.outcome != "completed":
        return False
    values: dict[str, float | None] = {
        "ttft": (rec.first_token_ns - rec.sent_ns) / NS_PER_MS if rec.first_token_ns else None,
        "tpot": tpot_ms(rec),
        "e2el": (rec.end_ns - rec.sent_ns) / NS_PER_MS,
    }
    return all(_within(values[s.series], s.bound_ms) for s in slos)


def _within(value: float | None, limit: float) -> bool:
    """A figure the request does not have (TPOT of one token) cannot miss its SLO."""
    return value is None or value <= limit


def hdr_encode(values_ms: Iterable[float]) -> str:
    """A compressed, base64 HdrHistogram of the values in microseconds (3 significant digits)."""
    hist = HdrHistogram(HDR_LOWEST_US, HDR_HIGHEST_US, HDR_DIGITS)
    for v in values_ms:
        hist.record_value(min(max(round(v * 1000.0), HDR_LOWEST_US), HDR_HIGHEST_US))
    return hist.encode().decode("ascii")


def hdr_decode(encoded: str) -> HdrHistogram:
    """Back from ``hdr_encode``; values are microseconds."""
    return HdrHistogram.decode(encoded.encode("ascii"))


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """From the first intended send to the last answer (or dispatch, if nothing answered)."""
    if not records:
        return 0.0
    start = min(r.intended_start_ns for r in records)
    end = max(max(r.end_ns, r.dispatch_ns, r.sent_ns) for r in records)
    return max(0.0, (end - start) / 1e9)


def lag_reason(
    stats: Mapping[str, Any],
    lag_limit_ms: float = LAG_LIMIT_MS,
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
) -> str | None:
    """Why the loader could not keep to the schedule, or None when it did.

    The loader lagged when its p99 scheduling lag exceeds ``lag_fraction`` of the median E2E
    latency: its own error (a starved loader is as late to read an answer as to send) is then
    more than that share of what it measures. A millisecond or two of lag on a 600 ms request is
    noise; on a 20 ms one it is not. Lag under ``LAG_FLOOR_MS`` (the loader's own timing
    precision: it spins for the last stretch before each send) never counts, so that a null
    engine's sub-millisecond answers can be measured at all. Where that rule is off
    (``lag_fraction`` 0) or nothing completed, the absolute ``lag_limit_ms`` applies instead.
    """
    lag = stats.get("p99_lag_ms") or 0.0
    median = stats.get("median_e2el_ms") or 0.0
    if lag_fraction > 0 and median > 0:
        if lag > max(LAG_FLOOR_MS, lag_fraction * median):
            return (
                f"loader lagged: p99 scheduling lag {lag:.3f} ms > {lag_fraction:.0%} of median "
                f"E2EL {median:.2f} ms"
            )
        return None
    if lag > lag_limit_ms:
        return f"loader lagged: p99 scheduling lag {lag:.3f} ms > {lag_limit_ms} ms"
    return None


def validity(
    stats: Mapping[str, Any],
    lost: int,
    lag_limit_ms: float = LAG_LIMIT_MS,
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
) -> list[str]:
    """Why a run must not be reported as the server's latency; empty when it is valid: the
    loader lagged (``lag_reason``), or requests were lost, a defect of the stack."""
    reasons = []
    lagged = lag_reason(stats, lag_limit_ms, lag_fraction)
    if lagged:
        reasons.append(lagged)
    if lost:
        reasons.append(f"{lost} requests lost (no answer by deadline + grace)")
    return reasons


def goodput(
    records: Sequence[RequestRecord],
    duration_s: float,
    stats: Mapping[str, Any],
    slos: Sequence[Slo],
) -> dict[str, Any]:
    """The SLO figures of a summary: ``request_goodput``, the SLOs used (``slos_ms`` as vLLM
    writes them, ``slo_percentiles`` beside) and ``slo_met``. Without SLOs goodput is the
    throughput of completed requests, as in vLLM."""
    completed = [r for r in records if r.outcome == "completed"]
    good = sum(1 for r in completed if meets_slos(r, slos)) if slos else len(completed)
    return {
        "request_goodput": good / duration_s if duration_s > 0 else 0.0,
        "slos_ms": {s.series: s.bound_ms for s in slos},
        "slo_percentiles": {s.series: s.percentile for s in slos},
        "slo_met": slo_met(stats, slos),
    }


def arrival_and_departure_rates(records: Sequence[RequestRecord]) -> tuple[float, float] | None:
    """Requests per second as scheduled (intended sends) and as answered (completions' ends),
    each over its own span; None with fewer than 8 completed. Below capacity the two agree;
    past it the answers come slower than the requests, which is a queue (or a processor-sharing
    slowdown) growing for as long as the load lasts."""
    done = [r.end_ns for r in records if r.outcome == "completed"]
    starts = [r.intended_start_ns for r in records]
    if len(done) < 8 or max(starts) <= min(starts) or max(done) <= min(done):
        return None
    arrival = (len(starts) - 1) / ((max(starts) - min(starts)) / 1e9)
    departure = (len(done) - 1) / ((max(done) - min(done)) / 1e9)
    return arrival, departure


def saturation(records: Sequence[RequestRecord]) -> list[str]:
    """Why the load was past what the stack can serve; empty when it was not.

    Saturated means failing (more than 5 % of requests errored or lost) or falling behind
    (answers leaving at less than 80 % of the rate requests arrived: with a fixed span of load
    that backlog only grows; 80 %, not 100 %, so that the jitter of short bursty points does
    not count).
    """
    reasons = []
    failed = sum(1 for r in records if r.outcome != "completed")
    if records and failed / len(records) > FAILED_FRACTION_LIMIT:
        reasons.append(
            f"{failed} of {len(records)} requests failed or lost (> {FAILED_FRACTION_LIMIT:.0%})"
        )
    rates = arrival_and_departure_rates(records)
    if rates is not None and rates[1] < SERVED_FRACTION_LIMIT * rates[0]:
        reasons.append(
            f"falling behind: answered {rates[1]:.2f} req/s of {rates[0]:.2f} req/s arriving"
        )
    return reasons


LENGTH_PERCENTILES: Final = (10.0, 50.0, 90.0, 99.0)
TURN_PERCENTILES: Final = (50.0, 90.0, 99.0)


def length_stats(lengths: Sequence[int]) -> LengthStats:
    """count, mean and numpy's linear p10/p50/p90/p99; no figures (None) for no lengths."""
    if not lengths:
        return LengthStats(0)
    arr = np.asarray(lengths, dtype=float)
    p10, p50, p90, p99 = (float(v) for v in np.percentile(arr, LENGTH_PERCENTILES))
    return LengthStats(int(arr.size), float(arr.mean()), p10, p50, p90, p99)


def input_lengths(records: Iterable[RequestRecord]) -> LengthStats:
    """Prompt tokens of every request that recorded them, whatever its outcome: the load sent."""
    return length_stats([r.prompt_tokens for r in records if r.prompt_tokens > 0])


def output_lengths(records: Iterable[RequestRecord]) -> LengthStats:
    """Output tokens of the completed requests (a failed one's count is cut short)."""
    return length_stats([r.output_tokens for r in records if r.outcome == "completed"])


def _turn_stats(turn: int, records: Sequence[RequestRecord]) -> TurnStats:
    ttft = np.asarray(series(records)["ttft"], dtype=float)
    p50, p90, p99 = (
        (float(v) for v in np.percentile(ttft, TURN_PERCENTILES))
        if ttft.size
        else (None, None, None)
    )
    completed = sum(1 for r in records if r.outcome == "completed")
    mean_prompt = float(np.mean([r.prompt_tokens for r in records]))
    return TurnStats(turn, len(records), completed, p50, p90, p99, mean_prompt)


def by_turn(records: Iterable[RequestRecord]) -> list[TurnStats]:
    """Per turn number, in order, for the records with a turn; empty for a workload without
    turns. TTFT against turn is what a prefix cache (and routing that finds it) changes."""
    turns: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.turn > 0:
            turns.setdefault(r.turn, []).append(r)
    return [_turn_stats(turn, turns[turn]) for turn in sorted(turns)]


PREFIX_COUNTERS: Final = ("prefix_cache_queries", "prefix_cache_hits")


def _replica_increases(readings: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """Queries and hits one replica counted; a drop in either counter is a restart of both."""
    queries = hits = 0.0
    for before, after in itertools.pairwise(readings):
        q0, h0 = before["prefix_cache_queries"], before["prefix_cache_hits"]
        q1, h1 = after["prefix_cache_queries"], after["prefix_cache_hits"]
        restarted = q1 < q0 or h1 < h0
        queries += q1 if restarted else q1 - q0
        hits += h1 if restarted else h1 - h0
    return queries, hits


def prefix_cache_stats(samples: Iterable[Mapping[str, Any]], completed: int) -> PrefixCacheStats:
    """The counters' increase between each replica's first and last sample (``samples`` in time
    order, keyed by replica ``name``), summed over replicas. Samples without the counters (a
    failed read, an engine that has none) are skipped; with none left the figures are None."""
    by_replica: dict[str, list[Mapping[str, Any]]] = {}
    for sample in samples:
        if all(sample.get(k) is not None for k in PREFIX_COUNTERS):
            by_replica.setdefault(str(sample.get("name", "")), []).append(sample)
    if not by_replica:
        return PrefixCacheStats(completed=completed)
    increases = [_replica_increases(readings) for readings in by_replica.values()]
    queries = round(sum(q for q, _ in increases))
    hits = round(sum(h for _, h in increases))
    return PrefixCacheStats(queries, hits, completed)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slos: Sequence[Slo] = (),
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
) -> dict[str, Any]:
    """The summary of one (stack, profile, loader) run: every metric key this suite reports, as
    summary.json's flat row holds them (``schema.from_data(SummaryRow, ...)`` reads it typed)."""
    outcomes = Counter(r.outcome for r in records)
    errors_by_code = Counter(
        r.error_code or f"http_{r.http_status}" for r in records if r.outcome == "error"
    )
    completed = [r for r in records if r.outcome == "completed"]
    duration = run_duration_s(records) if duration_s is None else duration_s
    per_s = 1.0 / duration if duration > 0 else 0.0
    total_in = sum(r.prompt_tokens for r in completed)
    total_out = sum(r.output_tokens for r in completed)
    values = series(records)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": outcomes["completed"],
        "errors": outcomes["error"],
        "lost": outcomes["lost"],
        "errors_by_code": dict(sorted(errors_by_code.items())),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(completed) * per_s,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
    }
    for name in SERIES:
        out.update(describe(name, values[name]))
    out.update(goodput(records, duration, out, slos))
    out["hdr_us"] = {name: hdr_encode(values[name]) for name in HDR_SERIES}
    reasons = validity(out, outcomes["lost"], lag_fraction=lag_fraction)
    out["valid"] = not reasons
    out["invalid_reasons"] = reasons
    out["loader_limited"] = lag_reason(out, lag_fraction=lag_fraction) is not None
    out["saturation_reasons"] = saturation(records)
    out["saturated"] = bool(out["saturation_reasons"])
    out["input_lens"] = to_data(input_lengths(records))
    out["output_lens"] = to_data(output_lengths(records))
    out["by_turn"] = to_data(by_turn(records))
    return out
