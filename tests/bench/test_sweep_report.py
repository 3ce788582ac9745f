"""The report of a sweep run: load-curve figures and the headline table, from a hand-built
results directory written through harness.schema's own writers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.axes import Axes
from matplotlib.container import ErrorbarContainer
from matplotlib.lines import Line2D

from bench.report import html, load_run, plots
from harness import curves, schema
from harness.schema import SummaryRow
from tests.support.simrun import make_run
from tests.support.sweeps import BASELINE, BOUND_MS, RATES, REPEATS, SLOS, ZEROLAYER, make_sweep


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("sweeps") / "sweep-run"
    make_sweep(run_dir)
    return run_dir


def _legend_texts(ax: Axes) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def _x(line: Line2D) -> list[float]:
    return [float(v) for v in np.asarray(line.get_xdata(), dtype=float)]


def _y(line: Line2D) -> list[float]:
    return [float(v) for v in np.asarray(line.get_ydata(), dtype=float)]


def _line(ax: Axes, label: str) -> Line2D:
    """The line labelled ``label``: a plain line, or the data line of an error-bar curve."""
    bars = [
        c.lines[0]
        for c in ax.containers
        if isinstance(c, ErrorbarContainer) and c.get_label() == label
    ]
    return next(iter(bars), None) or next(ln for ln in ax.get_lines() if ln.get_label() == label)


def test_the_report_of_a_sweep_leads_with_the_headline_and_marks_invalid_points(
    sweep_dir: Path,
) -> None:
    page = html.render(sweep_dir).read_text()
    run = load_run(sweep_dir)
    assert run.sweep is not None
    for name in plots.SWEEP_PLOTS:
        png = sweep_dir / schema.PLOTS_DIR / f"{name}.png"
        assert png.stat().st_size > 10_000, f"{name} is drawn"
        assert f"alt='{name}'" in page
    assert page.count("data:image/png;base64,") == len(plots.plots_for(run))
    assert "alt='latency_cdf'" not in page, "no per-profile records in a sweep run"
    first_table = page.index("<table>")
    assert page.index("<h2>Load sweep: a_latency</h2>") < first_table
    headline = page[first_table : page.index("</table>", first_table)]
    for stack in ("zerolayer", "baseline"):
        mine = [p for p in run.sweep.points if p.stack == stack]
        figures = curves.headline(mine, SLOS)
        for key in ("max_goodput", "knee", "highest_within_slos"):
            assert figures[key].text(".2f", "req/s") in headline, (stack, key)
    assert "past saturation: queue growing" in headline
    added = curves.added_latency(run.sweep.points, BOUND_MS)
    assert added.rate.value is not None
    assert f"more than {BOUND_MS:g} ms: {added.rate.text('.2f', 'req/s')}" in page
    assert page.count(plots.INVALID_LABEL) == 1, "exactly the one lagged point"
    assert "2.100 ms &gt; 1.0 ms" in page
    assert plots.HOST_NOTE.replace("'", "&#x27;") in page
    assert "(baseline at 24 req/s)" in page
    assert "<h2>Summary</h2>" not in page, "a sweep has no plain rows"


def test_latency_figure_draws_each_stack_with_slos_knees_and_the_invalid_point(
    sweep_dir: Path,
) -> None:
    run = load_run(sweep_dir)
    assert run.sweep is not None
    fig = plots.load_latency(run)
    ttft_ax, e2el_ax = fig.axes
    assert e2el_ax.get_xscale() == "log"
    zl = [p for p in run.sweep.points if p.stack == "zerolayer"]
    line = _line(e2el_ax, "zerolayer p50")
    expected = [
        np.mean([p.stat("median_e2el_ms") for p in zl if p.offered_rate == r and curves.usable(p)])
        for r in RATES
    ]
    assert list(_x(line)) == list(RATES)
    assert np.allclose(_y(line), expected)
    curve = next(c for c in e2el_ax.containers if c.get_label() == "zerolayer p50")
    assert isinstance(curve, ErrorbarContainer)
    bars = curve.lines[2][0]
    low, high = np.asarray(bars.get_segments()[0], dtype=float)[:, 1]
    repeats = [p.stat("median_e2el_ms") or 0.0 for p in zl if p.offered_rate == RATES[0]]
    assert (low, high) == pytest.approx((min(repeats), max(repeats))), "bars: the repeats' range"
    assert _line(e2el_ax, "baseline p99").get_linestyle() == "--"
    slo_line = _line(e2el_ax, "E2EL p99 <= 2000 ms")
    assert list(_y(slo_line)) == [2000.0, 2000.0]
    assert "TTFT p99 <= 500 ms" in _legend_texts(ttft_ax)
    knee = curves.knee(zl, SLOS)
    knee_line = _line(e2el_ax, f"zerolayer knee {knee.text('.3g', 'req/s')}")
    assert _x(knee_line)[0] == pytest.approx(knee.value)
    assert plots.INVALID_LABEL in _legend_texts(e2el_ax)
    hollow = [c for c in e2el_ax.collections if c.get_label() == plots.INVALID_LABEL]
    lagged = next(p for p in zl if p.loader_limited)
    offsets = {tuple(o) for c in hollow for o in np.asarray(c.get_offsets(), dtype=float)}
    assert offsets == {(48.0, lagged.stat("median_e2el_ms")), (48.0, lagged.stat("p99_e2el_ms"))}
    assert all(len(c.get_facecolor()) == 0 for c in hollow), "drawn hollow"
    assert plots.SATURATED_LABEL in _legend_texts(e2el_ax)
    assert plots.HOST_LABEL in _legend_texts(e2el_ax)
    assert any(plots.HOST_NOTE in t.get_text() for t in fig.texts), "the caption line"


def test_goodput_figure_has_the_diagonal_and_each_stacks_max_goodput(sweep_dir: Path) -> None:
    run = load_run(sweep_dir)
    assert run.sweep is not None
    fig = plots.load_goodput(run)
    (ax,) = fig.axes
    diagonal = _line(ax, "served = offered")
    assert np.allclose(_x(diagonal), _y(diagonal))
    for stack in ("zerolayer", "baseline"):
        best = curves.max_goodput([p for p in run.sweep.points if p.stack == stack])
        level = _line(ax, f"{stack} max goodput {best.text('.3g', 'req/s')}")
        assert _y(level)[0] == pytest.approx(best.value)
    assert best.value is not None and best.value < 10.0, "the baseline saturates near 16"
    zl_good = _line(ax, "zerolayer goodput")
    assert max(_y(zl_good)) == pytest.approx(
        np.mean([ZEROLAYER[40.0][4] / (1 + 0.05 * k) for k in range(REPEATS)])
    )


def test_added_latency_figure_is_baseline_minus_zerolayer_with_the_crossing(
    sweep_dir: Path,
) -> None:
    run = load_run(sweep_dir)
    fig = plots.load_added_latency(run)
    (ax,) = fig.axes
    p50 = _line(ax, "E2EL p50 difference")
    shared = [r for r in RATES if r in BASELINE]
    assert list(_x(p50)) == shared
    expected = [
        np.mean([(BASELINE[r][2] - ZEROLAYER[r][2]) * (1 + 0.05 * k) for k in range(REPEATS)])
        for r in shared
    ]
    assert np.allclose(_y(p50), expected)
    assert list(_y(_line(ax, f"bound: median {BOUND_MS:g} ms"))) == [BOUND_MS] * 2
    assert run.sweep is not None
    crossing = curves.added_latency(run.sweep.points, BOUND_MS).rate
    assert crossing.value is not None and 4.0 < crossing.value < 8.0
    mark = _line(ax, f"median crosses the bound at {crossing.text('.3g', 'req/s')}")
    assert _x(mark)[0] == pytest.approx(crossing.value)


def test_headline_figures_are_recomputed_where_the_sweep_lacks_them(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path / "cut-short", stored_headline=False)
    run = load_run(tmp_path / "cut-short")
    assert run.sweep is not None and run.sweep.stacks["baseline"]["headline"] == {}
    got = plots.sweep_headline(run.sweep, "baseline")
    want = curves.headline(sweep.stack_points("baseline"), SLOS)
    assert {k: v.text() for k, v in got.items()} == {k: v.text() for k, v in want.items()}
    assert plots.sweep_added_latency(run.sweep).rate.text() == (
        curves.added_latency(sweep.points, BOUND_MS).rate.text()
    )
    page = html.render(tmp_path / "cut-short").read_text()
    assert want["knee"].text(".2f", "req/s") in page


def test_a_plain_run_draws_no_load_curves_and_shows_host_cpu(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "plain")
    run = load_run(run_dir)
    assert run.sweep is None
    assert set(plots.plots_for(run)) == set(plots.RUN_PLOTS | plots.CLAIM_PLOTS)
    fig = plots.load_latency(run)
    assert any("no sweep in this run" in t.get_text() for t in fig.texts)
    rows = schema.read_summary(run_dir)
    rows[0].host_cpu_pct, rows[0].host_saturated = 97.0, True
    rows[0].saturated, rows[0].saturation_reasons = True, ["queue growing"]
    schema.write_summary(run_dir, rows)
    page = html.render(run_dir).read_text()
    assert "<th>host CPU %</th>" in page and "<th>saturated</th>" in page
    assert "<td>97</td><td><b>yes</b>: queue growing</td>" in page
    assert plots.HOST_NOTE.replace("'", "&#x27;") in page
    assert f"{rows[0].stack} / {rows[0].profile}" in page


rows_strategy = st.lists(
    st.tuples(
        st.sampled_from(RATES),
        st.integers(0, 3),
        st.booleans(),
        st.one_of(st.none(), st.floats(1.0, 1e5)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(rows_strategy)
def test_rate_points_partition_the_points_and_pool_only_usable_repeats(
    drawn: list[tuple[float, int, bool, float | None]],
) -> None:
    points = [
        SummaryRow(
            "zerolayer",
            "a_latency",
            "native",
            offered_rate=rate,
            repeat=repeat,
            loader_limited=lagged,
            stats={"p99_e2el_ms": value},
        )
        for rate, repeat, lagged, value in drawn
    ]
    sweep = schema.SweepSection("a_latency", "test", "grid", [], list(RATES), 4, points=points)
    groups = plots.rate_points(sweep, "zerolayer")
    assert sorted(id(r) for g in groups for r in g.rows) == sorted(id(p) for p in points)
    assert [g.rate for g in groups] == sorted({p.offered_rate for p in points})
    for group in groups:
        assert all(not r.loader_limited for r in group.valid)
        assert len(group.valid) + len(group.invalid) == len(group.rows)
        pooled = group.stat("p99_e2el_ms")
        got = [v for v in (r.stat("p99_e2el_ms") for r in group.valid) if v is not None]
        assert pooled.n == len(got)
        if got:
            assert pooled.value is not None
            assert min(got) - 1e-6 <= pooled.value <= max(got) + 1e-6
