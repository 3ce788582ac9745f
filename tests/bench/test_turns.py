"""What a multi-turn run reports: figures by turn, length distributions, the prefix cache's
hit rate from engine telemetry, and the report's tables and plot for them."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.cli import main as cli_main
from bench.report import load_run, plots
from harness import metrics, schema
from harness.runner.console import turns_outcome
from harness.runner.results import RunDir
from harness.runner.sampling import Telemetry
from harness.schema import RequestRecord
from harness.stacks import Stack
from harness.telemetry import Component, EngineTarget
from tests.support.simrun import Spec, make_run
from tests.support.turns import MULTI_TURN, with_turns

MS = 1_000_000


def _rec(turn: int, ttft_ms: float | None, prompt: int = 10, out: int = 4) -> RequestRecord:
    """A request sent at 0; ``ttft_ms`` None for one that failed."""
    done = ttft_ms is not None
    first = int((ttft_ms or 0) * MS)
    return RequestRecord(
        f"r{turn}-{ttft_ms}",
        "zerolayer",
        MULTI_TURN,
        "native",
        0,
        first_token_ns=first,
        end_ns=first + MS if done else 0,
        chunk_ns=[first] if done else [],
        outcome="completed" if done else "error",
        prompt_tokens=prompt,
        output_tokens=out if done else 0,
        turn=turn,
    )


turned_records = st.lists(
    st.tuples(
        st.integers(0, 6),
        st.one_of(st.none(), st.floats(1.0, 5_000.0)),
        st.integers(1, 4096),
    ).map(lambda t: _rec(*t)),
    max_size=60,
)


@given(turned_records)
def test_by_turn_counts_every_turned_record_once(records: list[RequestRecord]) -> None:
    turns = metrics.by_turn(records)
    turned = [r for r in records if r.turn > 0]
    assert sum(t.count for t in turns) == len(turned)
    assert sum(t.completed for t in turns) == sum(r.outcome == "completed" for r in turned)
    assert [t.turn for t in turns] == sorted({r.turn for r in turned})
    for t in turns:
        assert (t.p50_ttft_ms is None) == (t.completed == 0), "no completions: no TTFT, not 0"
        assert schema.from_data(schema.TurnStats, schema.to_data(t)) == t


def test_by_turn_percentiles_and_prompt_growth_by_hand() -> None:
    records = [_rec(1, 10.0, 100), _rec(1, 30.0, 100), _rec(1, None, 100)]
    records += [_rec(2, 20.0, 300), _rec(0, 999.0, 5)]
    first, second = metrics.by_turn(records)
    assert (first.turn, first.count, first.completed) == (1, 3, 2)
    assert first.p50_ttft_ms == pytest.approx(20.0)
    assert first.p90_ttft_ms == pytest.approx(np.percentile([10.0, 30.0], 90))
    assert (second.count, second.p99_ttft_ms, second.mean_prompt_tokens) == (1, 20.0, 300.0)
    assert metrics.by_turn([_rec(0, 5.0)]) == [], "a workload without turns has no by-turn table"
    summary = metrics.summarize(records)
    assert [t["turn"] for t in summary["by_turn"]] == [1, 2]


@given(st.lists(st.integers(1, 100_000), max_size=200))
def test_length_stats_are_numpys_percentiles(lengths: list[int]) -> None:
    stats = metrics.length_stats(lengths)
    assert stats.count == len(lengths)
    if not lengths:
        assert stats == schema.LengthStats(0), "no lengths: no figures, not zeros"
        return
    expected = np.percentile(np.asarray(lengths, dtype=float), metrics.LENGTH_PERCENTILES)
    assert [stats.p10, stats.p50, stats.p90, stats.p99] == pytest.approx(list(expected))
    assert stats.mean == pytest.approx(float(np.mean(lengths)))
    assert schema.from_data(schema.LengthStats, schema.to_data(stats)) == stats


def test_input_lengths_count_all_sent_output_lengths_only_completed() -> None:
    records = [_rec(1, 10.0, 100, out=7), _rec(1, None, 300), _rec(2, 12.0, 200, out=9)]
    summary = metrics.summarize(records)
    assert summary["input_lens"]["count"] == 3
    assert summary["input_lens"]["p50"] == pytest.approx(200.0)
    assert summary["output_lens"]["count"] == 2
    assert summary["output_lens"]["mean"] == pytest.approx(8.0)
    assert set(summary["input_lens"]) == {"count", "mean", "p10", "p50", "p90", "p99"}


def _sample(name: str, queries: int, hits: int) -> dict[str, Any]:
    return {"name": name, "prefix_cache_queries": queries, "prefix_cache_hits": hits}


def test_prefix_cache_deltas_summed_over_replicas() -> None:
    samples = [
        _sample("r0", 1000, 400),
        _sample("r1", 50, 0),
        _sample("r0", 1600, 900),
        _sample("r1", 250, 100),
    ]
    cache = metrics.prefix_cache_stats(samples, completed=10)
    assert (cache.queries, cache.hits) == (600 + 200, 500 + 100)
    assert cache.hit_rate == pytest.approx(600 / 800)
    assert cache.prefilled_per_request == pytest.approx((800 - 600) / 10)


def test_a_counter_drop_is_a_restart_counted_from_zero() -> None:
    samples = [
        _sample("r0", 1000, 500),
        _sample("r0", 1200, 600),
        _sample("r0", 80, 30),  # restarted: 80 looked up since
        _sample("r0", 180, 90),
    ]
    cache = metrics.prefix_cache_stats(samples, completed=4)
    assert (cache.queries, cache.hits) == (200 + 80 + 100, 100 + 30 + 60)


def test_no_counters_or_no_lookups_read_not_available() -> None:
    failed_reads: list[dict[str, Any]] = [{"name": "r0", "error": "down"}, {"name": "r0", "up": 0}]
    for samples in ([], failed_reads, [_sample("r0", 5, 0), _sample("r0", 5, 0)]):
        cache = metrics.prefix_cache_stats(samples, completed=3)
        assert cache.hit_rate is None and cache.prefilled_per_request is None
    nothing_done = metrics.prefix_cache_stats([_sample("r", 0, 0), _sample("r", 9, 3)], 0)
    assert nothing_done.hit_rate == pytest.approx(1 / 3)
    assert nothing_done.prefilled_per_request is None, "no completed requests: nothing to share"
    round_trip = schema.from_data(schema.PrefixCacheStats, schema.to_data(nothing_done))
    assert round_trip == nothing_done
    assert schema.from_data(schema.PrefixCacheStats, {}).queries is None


@pytest.fixture(scope="module")
def turn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = make_run(
        tmp_path_factory.mktemp("runs") / "turns",
        profiles={"a_latency": Spec(count=12), MULTI_TURN: Spec(count=24, rate=40.0)},
    )
    return with_turns(run_dir, {"zerolayer": (4000, 3000)})


def _cells(page: str, section: str, *first: str) -> list[str]:
    """The cells of the first row after heading ``section`` that starts with ``first``."""
    lead = "".join(f"<td class='l'>{c}</td>" for c in first)
    start = page.index(f"<tr>{lead}", page.index(f"<h2>{section}"))
    row = page[start : page.index("</tr>", start)]
    return re.findall(r"<td[^>]*>([^<]*)</td>", row)


def test_report_shows_turns_prefix_cache_and_lengths(turn_run: Path) -> None:
    assert cli_main(["report", str(turn_run)]) == 0
    page = (turn_run / schema.REPORT).read_text()
    run = load_run(turn_run)
    assert run.turn_profiles == [MULTI_TURN], "only the profile with turns has a by-turn table"
    assert f"By turn: {MULTI_TURN}" in page and "By turn: a_latency" not in page
    for stack in ("zerolayer", "baseline"):
        first = metrics.by_turn(run.records[(stack, MULTI_TURN)])[0]
        assert first.turn == 1 and first.p50_ttft_ms is not None
        assert (
            f"<tr><td class='l'>{stack}</td><td>1</td><td>{first.count}</td>"
            f"<td>{first.completed}</td><td>{first.p50_ttft_ms:.2f}</td>"
        ) in page
    entry = run.summary("zerolayer", MULTI_TURN)
    assert entry is not None and entry.completed > 0
    prefilled = f"{1000 / entry.completed:.1f}"
    assert _cells(page, "Prefix cache", "zerolayer", MULTI_TURN)[2:] == [
        "4000",
        "3000",
        "75.0 %",
        prefilled,
    ]
    assert _cells(page, "Prefix cache", "baseline", MULTI_TURN)[2:] == ["n/a"] * 4, (
        "no telemetry: n/a, not 0 %"
    )
    sent = metrics.input_lengths(run.records[("zerolayer", MULTI_TURN)])
    assert _cells(page, "Input and output", MULTI_TURN, "input", "zerolayer")[3:] == [
        f"{sent.count}",
        *(f"{v:.1f}" for v in (sent.mean, sent.p10, sent.p50, sent.p90, sent.p99)),
    ]
    assert _cells(page, "Input and output", MULTI_TURN, "input", "workload file")[3:5] == [
        "24",
        "160.0",
    ]
    assert _cells(page, "Input and output", "a_latency", "output", "workload file")[3] == "24"
    png = turn_run / schema.PLOTS_DIR / f"{plots.TTFT_BY_TURN}-{MULTI_TURN}.png"
    assert png.stat().st_size > 10_000
    assert f"alt='{plots.TTFT_BY_TURN}-{MULTI_TURN}'" in page


def test_ttft_by_turn_plot_draws_each_stacks_percentiles(turn_run: Path) -> None:
    run = load_run(turn_run)
    fig = plots.ttft_by_turn(run, MULTI_TURN)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert set(lines) == {
        f"{s} TTFT {p}" for s in ("zerolayer", "baseline") for p in ("p50", "p90")
    }
    turns = metrics.by_turn(run.records[("baseline", MULTI_TURN)])
    line = lines["baseline TTFT p90"]
    assert np.asarray(line.get_xdata()).tolist() == [t.turn for t in turns]
    assert np.asarray(line.get_ydata()).tolist() == pytest.approx([t.p90_ttft_ms for t in turns])
    assert "turn" in fig.axes[0].get_xlabel() and "ms" in fig.axes[0].get_ylabel()


class _FakeStack:
    """What the run's ``Telemetry`` asks of a stack: its name, engine targets and processes."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.name = "zerolayer"
        self.counters = counters

    def engine_targets(self) -> list[EngineTarget]:
        return [EngineTarget("zl-0", self.name, lambda: dict(self.counters), "fake")]

    def pids(self) -> dict[str, list[int]]:
        return {}

    def components(self) -> list[Component]:
        return []


def _count(counters: dict[str, int], queries: int, hits: int) -> None:
    counters.update(prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_run_telemetry_counts_a_phase_from_its_reads_and_samples(tmp_path: Path) -> None:
    """The run's figure for one profile: read before, sampled during (a restart among the
    samples), read after; what the replica counted before the phase is not the phase's."""
    tele = Telemetry(cast(RunDir, SimpleNamespace(path=tmp_path)), 1.0)
    counters: dict[str, int] = {}
    _count(counters, 500, 100)
    stack = cast(Stack, _FakeStack(counters))
    tele.watch(stack)
    tele.sampler.open()
    try:
        before = tele.last_reads(stack)
        tele.phases.begin("zerolayer/e_multi_turn")
        for queries, hits in ((800, 300), (40, 10), (240, 150)):
            _count(counters, queries, hits)
            tele.sampler.tick()
        tele.phases.end()
        _count(counters, 300, 200)
        tele.sampler.tick()  # after the phase: not its sample
        cache = tele.prefix_cache(stack, "zerolayer/e_multi_turn", before, completed=10)
    finally:
        tele.stop()
    assert (cache.queries, cache.hits) == (300 + 40 + 200 + 60, 200 + 10 + 140 + 50)
    assert cache.prefilled_per_request == pytest.approx((600 - 400) / 10)


def test_a_multi_turn_row_says_ttft_by_turn_and_the_hit_rate() -> None:
    records = [_rec(1, 10.0, 100), _rec(2, 4.0, 300)]
    data = {"stack": "zerolayer", "profile": MULTI_TURN, "loader": "native"}
    row = schema.from_data(schema.SummaryRow, data | metrics.summarize(records))
    assert turns_outcome(row) == (
        "TTFT p50 by turn (ms) 1: 10.0, 2: 4.0; prefix-cache hit rate n/a, prefilled tokens per "
        "request n/a"
    )
    row.prefix_cache = schema.PrefixCacheStats(400, 100, 2)
    assert turns_outcome(row).endswith("hit rate 25.0%, prefilled tokens per request 150")
    flat = schema.from_data(schema.SummaryRow, data | metrics.summarize([_rec(0, 3.0)]))
    assert turns_outcome(flat) == ""
