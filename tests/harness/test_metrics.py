"""harness.metrics against values worked out by hand for a small set of records."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from harness.metrics import (
    Slo,
    describe,
    hdr_decode,
    hdr_encode,
    meets_slos,
    percentile_key,
    saturation,
    series,
    summarize,
    validity,
)
from harness.schema import RequestRecord

MS = 1_000_000


def _rec(rid: str, intended: float, **kw: object) -> RequestRecord:
    ms = {k: int(v * MS) for k, v in kw.items() if k.endswith("_ns") and k != "chunk_ns"}
    other = {k: v for k, v in kw.items() if not (k.endswith("_ns") and k != "chunk_ns")}
    if "chunk_ns" in other:
        other["chunk_ns"] = [int(c * MS) for c in other["chunk_ns"]]  # type: ignore[union-attr]
    return RequestRecord(rid, "zl", "a", "native", int(intended * MS), **ms, **other)


@pytest.fixture
def records() -> list[RequestRecord]:
    """Times in ms: r1 three chunks, r2 one token, r3 refused, r4 lost."""
    return [
        _rec(
            "r1",
            0,
            dispatch_ns=1,
            sent_ns=2,
            first_token_ns=12,
            end_ns=18,
            chunk_ns=[12, 14, 18],
            outcome="completed",
            output_tokens=3,
            prompt_tokens=10,
        ),
        _rec(
            "r2",
            10,
            dispatch_ns=10,
            sent_ns=10,
            first_token_ns=30,
            end_ns=30,
            chunk_ns=[30],
            outcome="completed",
            output_tokens=1,
            prompt_tokens=20,
        ),
        _rec(
            "r3",
            20,
            dispatch_ns=20.5,
            sent_ns=21,
            end_ns=22,
            outcome="error",
            error_code="queue_full",
            http_status=429,
        ),
        _rec("r4", 30, dispatch_ns=30, sent_ns=31, end_ns=100, outcome="lost"),
    ]


def test_series_by_hand(records: list[RequestRecord]) -> None:
    s = series(records)
    assert s["ttft"] == pytest.approx([10, 20])
    assert s["e2el"] == pytest.approx([16, 20])
    assert s["e2el_intended"] == pytest.approx([18, 20])
    assert s["ttft_intended"] == pytest.approx([12, 20])
    assert s["tpot"] == pytest.approx([3.0])  # (16 - 10) / (3 - 1); r2 has one token
    assert s["itl"] == pytest.approx([2, 4])  # pooled chunk gaps
    assert s["lag"] == pytest.approx([1, 0, 0.5, 0])  # every dispatched request
    assert s["client_queue"] == pytest.approx([2, 0, 1, 1])


def test_summary_by_hand(records: list[RequestRecord]) -> None:
    s = summarize(records)
    assert (s["num_requests"], s["completed"], s["errors"], s["lost"]) == (4, 2, 1, 1)
    assert s["errors_by_code"] == {"queue_full": 1}
    assert s["duration"] == pytest.approx(0.1)  # first intended 0 ms .. last end 100 ms
    assert s["request_throughput"] == pytest.approx(20.0)
    assert s["output_throughput"] == pytest.approx(40.0)
    assert s["total_token_throughput"] == pytest.approx(340.0)  # (30 + 4) tokens / 0.1 s
    assert s["mean_ttft_ms"] == pytest.approx(15.0)
    assert s["median_ttft_ms"] == pytest.approx(15.0)
    assert s["std_ttft_ms"] == pytest.approx(5.0)  # population std, as vLLM
    assert s["p99_ttft_ms"] == pytest.approx(19.9)  # linear: 10 + 0.99 * 10
    assert s["p99.9_ttft_ms"] == pytest.approx(19.99)
    assert s["mean_lag_ms"] == pytest.approx(0.375)
    assert s["median_lag_ms"] == pytest.approx(0.25)
    assert s["mean_itl_ms"] == pytest.approx(3.0)
    assert s["mean_tpot_ms"] == pytest.approx(3.0)
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert not s["valid"]
    assert any("lost" in r for r in s["invalid_reasons"])


def test_goodput_under_slos(records: list[RequestRecord]) -> None:
    def good(*slos: Slo) -> float:
        return float(summarize(records, slos=slos)["request_goodput"])

    assert good(Slo("ttft", 99, 15)) == pytest.approx(10.0)
    assert good(Slo("e2el", 99, 16)) == pytest.approx(10.0)
    # r1's TPOT is 3 ms; r2 has no TPOT (one token) and so cannot miss that SLO.
    assert good(Slo("tpot", 99, 2)) == pytest.approx(10.0)
    assert not meets_slos(records[2], [Slo("e2el", 99, 1000)])
    with pytest.raises(ValueError, match="series"):
        Slo("latency", 99, 1)


def test_percentile_keys_follow_vllm() -> None:
    assert percentile_key(99) == "p99"
    assert percentile_key(99.9) == "p99.9"
    stats = describe("e2el", list(range(1, 101)))
    assert stats["median_e2el_ms"] == pytest.approx(50.5)
    assert stats["p90_e2el_ms"] == pytest.approx(float(np.percentile(range(1, 101), 90)))
    assert set(stats) >= {"mean_e2el_ms", "std_e2el_ms", "p95_e2el_ms", "p99.9_e2el_ms"}


def test_validity_rules() -> None:
    assert validity({"p99_lag_ms": 0.5, "median_e2el_ms": 600.0}, lost=0) == []
    # 2 ms of lag is a third of a percent of a 600 ms latency: noise, not the loader's figure...
    assert validity({"p99_lag_ms": 2.0, "median_e2el_ms": 600.0}, lost=0) == []
    assert "1% of median" in validity({"p99_lag_ms": 6.5, "median_e2el_ms": 600.0}, lost=0)[0]
    # ...but 0.5 ms of lag is more than 1 % of a 20 ms median latency...
    assert validity({"p99_lag_ms": 0.5, "median_e2el_ms": 20.0}, lost=0)
    # ...and lag within the loader's own precision never counts, even on a 1 ms answer
    assert validity({"p99_lag_ms": 0.05, "median_e2el_ms": 0.9}, lost=0) == []
    assert validity({"p99_lag_ms": 0.2, "median_e2el_ms": 0.9}, lost=0)
    # ...unless that rule is off, as for a null engine's sub-millisecond answers, where the
    # absolute limit applies, as it does when nothing completed.
    assert validity({"p99_lag_ms": 0.5, "median_e2el_ms": 20.0}, lost=0, lag_fraction=0) == []
    assert (
        "1.0 ms" in validity({"p99_lag_ms": 1.5, "median_e2el_ms": 20.0}, lag_fraction=0, lost=0)[0]
    )
    assert "1.0 ms" in validity({"p99_lag_ms": 1.5}, lost=0)[0]
    assert validity({"p99_lag_ms": 0.1, "median_e2el_ms": 600.0}, lost=2)


def test_hdr_round_trip(records: list[RequestRecord]) -> None:
    encoded = summarize(records)["hdr_us"]["e2el"]
    hist = hdr_decode(encoded)
    assert hist.get_total_count() == 2
    assert hist.get_max_value() == pytest.approx(20_000, rel=1e-3)
    assert hist.get_min_value() == pytest.approx(16_000, rel=1e-3)
    assert hdr_decode(hdr_encode([])).get_total_count() == 0


def _load(n: int, gap_ms: float, latency_ms: Callable[[int], float]) -> list[RequestRecord]:
    out = []
    for i in range(n):
        start = int(i * gap_ms * MS)
        rec = RequestRecord(f"r{i}", "zerolayer", "a_latency", "native", start, start, start)
        rec.end_ns, rec.first_token_ns = start + int(latency_ms(i) * MS), start + MS
        rec.outcome, rec.output_tokens = "completed", 2
        out.append(rec)
    return out


def test_saturation_is_answers_falling_behind_arrivals_or_failures() -> None:
    steady = _load(40, 100.0, lambda i: 500.0)
    assert saturation(steady) == []
    # each answer 60 ms later than the one before: answers leave at 1/160 ms, arrivals 1/100 ms
    behind = _load(40, 100.0, lambda i: 500.0 + 60.0 * i)
    assert "falling behind" in saturation(behind)[0]
    failing = _load(40, 100.0, lambda i: 500.0)
    for rec in failing[:3]:
        rec.outcome = "error"
    assert "3 of 40 requests failed" in saturation(failing)[0]
    assert saturation(steady[:5]) == []  # too few answers to judge a rate
