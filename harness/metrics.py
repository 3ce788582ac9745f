"""The one home of metric definitions; every summary, plot and report reads these keys.

Definitions and names follow vLLM's ``vllm bench serve`` so figures line up with it:
- TTFT: first content chunk - send; E2EL: last byte - send; both per completed request.
- TPOT per request: ``(e2el - ttft) / (output_tokens - 1)``, for requests with more than one token.
- ITL: the gaps between consecutive content chunks, pooled over all completed requests.
- Throughputs over the run's duration: ``request_throughput`` (completed/s), ``output_throughput``
  (output tokens/s), ``total_token_throughput`` (prompt + output tokens/s), ``request_goodput``
  (completed requests/s that met every SLO given).
- Statistics per series: ``mean_X_ms``, ``median_X_ms``, ``std_X_ms`` (population, as numpy and
  vLLM compute it) and ``pNN_X_ms`` (numpy's linear percentile; p99.9 is ``p99.9_X_ms``).
Beyond vLLM, for coordinated-omission-free reporting: ``e2el_intended`` and ``ttft_intended``
measure from the schedule's intended send time, ``client_queue`` is sent - intended, and ``lag``
is the loader's scheduling lag (dispatch - intended). Counts: completed, errors by code, lost.
The full latency distributions go into the summary as encoded HdrHistograms.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np
from hdrh.histogram import HdrHistogram

from harness.schema import RequestRecord

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
LAG_LIMIT_MS: Final = 1.0
LAG_FRACTION_OF_MEDIAN: Final = 0.01
HDR_LOWEST_US: Final = 1
HDR_HIGHEST_US: Final = 3_600_000_000
HDR_DIGITS: Final = 3
NS_PER_MS: Final = 1_000_000.0


def percentile_key(p: float) -> str:
    """vLLM's spelling: ``p99`` for 99, ``p99.9`` for 99.9."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


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


def meets_slos(rec: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """A completed request within every SLO given (keys ``ttft``, ``tpot``, ``e2el``, in ms)."""
    if rec.outcome != "completed":
        return False
    unknown = set(slos_ms) - set(SLO_SERIES)
    if unknown:
        raise ValueError(f"unknown SLO keys {sorted(unknown)}; use {SLO_SERIES}")
    values: dict[str, float | None] = {
        "ttft": (rec.first_token_ns - rec.sent_ns) / NS_PER_MS if rec.first_token_ns else None,
        "tpot": tpot_ms(rec),
        "e2el": (rec.end_ns - rec.sent_ns) / NS_PER_MS,
    }
    return all(_within(values[k], limit) for k, limit in slos_ms.items())


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


def validity(
    stats: Mapping[str, Any],
    lost: int,
    lag_limit_ms: float = LAG_LIMIT_MS,
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
) -> list[str]:
    """Why a run must not be reported as the server's latency; empty when it is valid.

    The loader lagged when its p99 scheduling lag exceeds ``lag_limit_ms`` or ``lag_fraction``
    of the median E2E latency (0 turns that rule off: a null-engine run answers in well under a
    millisecond, so only the absolute limit means anything there). Lost requests are a defect of
    the stack and also void the run.
    """
    reasons = []
    lag = stats.get("p99_lag_ms") or 0.0
    median = stats.get("median_e2el_ms") or 0.0
    if lag > lag_limit_ms:
        reasons.append(f"loader lagged: p99 scheduling lag {lag:.3f} ms > {lag_limit_ms} ms")
    elif lag_fraction > 0 and median > 0 and lag > lag_fraction * median:
        reasons.append(
            f"loader lagged: p99 scheduling lag {lag:.3f} ms > {lag_fraction:.0%} of median "
            f"E2EL {median:.2f} ms"
        )
    if lost:
        reasons.append(f"{lost} requests lost (no answer by deadline + grace)")
    return reasons


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slos_ms: Mapping[str, float] | None = None,
    lag_fraction: float = LAG_FRACTION_OF_MEDIAN,
) -> dict[str, Any]:
    """The summary of one (stack, profile, loader) run: every metric key this suite reports."""
    outcomes = Counter(r.outcome for r in records)
    errors_by_code = Counter(
        r.error_code or f"http_{r.http_status}" for r in records if r.outcome == "error"
    )
    completed = [r for r in records if r.outcome == "completed"]
    duration = run_duration_s(records) if duration_s is None else duration_s
    per_s = 1.0 / duration if duration > 0 else 0.0
    total_in = sum(r.prompt_tokens for r in completed)
    total_out = sum(r.output_tokens for r in completed)
    good = sum(1 for r in completed if meets_slos(r, slos_ms)) if slos_ms else len(completed)
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
        "request_goodput": good * per_s,
        "output_throughput": total_out * per_s,
        "total_token_throughput": (total_in + total_out) * per_s,
        "slos_ms": dict(slos_ms or {}),
    }
    for name in SERIES:
        out.update(describe(name, values[name]))
    out["hdr_us"] = {name: hdr_encode(values[name]) for name in HDR_SERIES}
    reasons = validity(out, outcomes["lost"], lag_fraction=lag_fraction)
    out["valid"] = not reasons
    out["invalid_reasons"] = reasons
    return out
