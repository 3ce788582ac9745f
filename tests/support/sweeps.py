"""A sweep run built by hand with realistic shapes, written through harness.schema's own writers:
what the sweep report's tests and the notebook's test draw from."""

from __future__ import annotations

from pathlib import Path

from harness import curves, metrics, schema
from harness.schema import SummaryRow

SLOS = (metrics.Slo("ttft", 99.0, 500.0), metrics.Slo("e2el", 99.0, 2000.0))
BOUND_MS = 50.0
RATES = (4.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0)
# per rate: TTFT p50, TTFT p99, E2EL p50, E2EL p99 (ms), goodput, throughput (req/s),
# saturated, host CPU %
Figures = tuple[float, float, float, float, float, float, bool, float]
ZEROLAYER: dict[float, Figures] = {
    4.0: (25, 48, 610, 700, 4.0, 4.0, False, 21),
    8.0: (27, 55, 615, 720, 8.0, 8.0, False, 30),
    16.0: (30, 70, 625, 780, 16.0, 16.0, False, 44),
    24.0: (36, 110, 650, 900, 23.9, 24.0, False, 55),
    32.0: (55, 260, 720, 1500, 31.5, 32.0, False, 68),
    40.0: (70, 420, 780, 1900, 38.9, 39.8, False, 80),
    48.0: (900, 4200, 2400, 9000, 12.0, 40.1, True, 86),
}
BASELINE: dict[float, Figures] = {
    4.0: (60, 120, 640, 900, 4.0, 4.0, False, 35),
    8.0: (75, 180, 740, 1100, 7.9, 8.0, False, 52),
    16.0: (300, 1400, 1500, 4800, 9.5, 15.2, True, 81),
    24.0: (4000, 9000, 10400, 19900, 1.2, 15.9, True, 97),
}
LAGGED = ("zerolayer", 48.0, 1)  # the one point whose loader could not keep to the schedule
REPEATS = 2


def _row(stack: str, rate: float, repeat: int, figures: Figures) -> SummaryRow:
    ttft50, ttft99, e2el50, e2el99, good, thr, saturated, host = figures
    spread = 1.0 + 0.05 * repeat  # the second seed a little slower
    stats: dict[str, float | None] = {
        "median_ttft_ms": ttft50 * spread,
        "p99_ttft_ms": ttft99 * spread,
        "median_e2el_ms": e2el50 * spread,
        "p99_e2el_ms": e2el99 * spread,
    }
    lagged = (stack, rate, repeat) == LAGGED
    count = int(rate * 20)
    return SummaryRow(
        stack=stack,
        profile="a_latency",
        loader="native",
        num_requests=count,
        completed=count - (count // 10 if saturated else 0),
        errors=count // 10 if saturated else 0,
        request_goodput=good / spread,
        request_throughput=thr,
        slos_ms={s.series: s.bound_ms for s in SLOS},
        slo_percentiles={s.series: s.percentile for s in SLOS},
        slo_met=metrics.slo_met(stats, SLOS),
        saturated=saturated,
        saturation_reasons=["queue growing: 700 ms in the first quarter, 9000 in the last"]
        if saturated
        else [],
        offered_rate=rate,
        host_cpu_pct=float(host),
        host_busiest_cpu_pct=float(min(100, host + 10)),
        host_saturated=host >= 90,
        repeat=repeat,
        point=RATES.index(rate),
        records_file=schema.point_file(stack, "a_latency", rate, repeat),
        stats=stats,
        valid=not lagged,
        invalid_reasons=["loader lagged: p99 scheduling lag 2.100 ms > 1.0 ms"] if lagged else [],
        loader_limited=lagged,
    )


def make_sweep(run_dir: Path, stored_headline: bool = True) -> schema.SweepSection:
    """A sweep with realistic shapes: zerolayer serves ~40 req/s, baseline saturates near 16."""
    points = [
        _row(stack, rate, repeat, figures)
        for stack, table in (("zerolayer", ZEROLAYER), ("baseline", BASELINE))
        for rate, figures in table.items()
        for repeat in range(REPEATS)
    ]
    stacks = {
        stack: {
            "stopped": stopped,
            "headline": schema.to_data(
                curves.headline([p for p in points if p.stack == stack], SLOS)
            )
            if stored_headline
            else {},
        }
        for stack, stopped in (
            ("zerolayer", ""),
            ("baseline", "past saturation: queue growing at 16 and 24 req/s"),
        )
    }
    sweep = schema.SweepSection(
        profile="a_latency",
        scale="laptop",
        mode="grid",
        slos=schema.to_data(list(SLOS)),
        rates=list(RATES),
        repeats=REPEATS,
        added_latency_bound_ms=BOUND_MS,
        capacity_rps=38.0,
        points=points,
        stacks=stacks,
        added_latency=schema.to_data(curves.added_latency(points, BOUND_MS))
        if stored_headline
        else {},
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = schema.RunMeta(
        run_id=run_dir.name, scale="laptop", engine="sim", end=schema.RunEnd.COMPLETE
    )
    schema.write_run_meta(run_dir, meta)
    schema.write_summary(run_dir, [], sweep)
    return sweep
