"""``bench.perf`` (``nox -s perf``): the in-process token paths answer every request, their CPU per
token comes as ratios to the echo's, and a ratio past its stored baseline is a regression."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.perf import (
    ECHO,
    H2C,
    HTTP1,
    TARGETS,
    Baseline,
    Figures,
    read_baseline,
    regressions,
    run,
    write_baseline,
)


def test_every_path_streams_its_requests_and_is_measured_against_the_echo() -> None:
    figures = run(rounds=2, per_round=4, in_flight=2)
    assert set(figures.per_token_us) == set(TARGETS)
    assert all(len(v) == 2 and min(v) > 0 for v in figures.per_token_us.values())
    assert set(figures.ratios) == {H2C, HTTP1}
    assert any(line.startswith(f"{H2C}: ") and "the echo's" in line for line in figures.lines())


def _figures(h2c: float, http1: float) -> Figures:
    return Figures({H2C: [h2c], HTTP1: [http1], ECHO: [1.0]}, {H2C: [h2c], HTTP1: [http1]})


def test_a_ratio_past_its_baseline_and_tolerance_is_a_regression(tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    stored = write_baseline(path, _figures(1.1, 0.9), note="test")
    assert read_baseline(path) == stored == Baseline({H2C: 1.1, HTTP1: 0.9}, note="test")
    assert regressions(_figures(1.3, 1.1), stored) == []
    (line,) = regressions(_figures(1.5, 1.1), stored)
    assert line.startswith(f"{H2C}: 1.50x the echo's CPU per token, past its limit 1.38x")
    assert len(regressions(_figures(1.5, 1.2), stored)) == 2


def test_the_stored_baseline_names_the_replicas_paths() -> None:
    baseline = read_baseline(Path(__file__).parents[2] / "benchmarks" / "perf_baseline.json")
    assert set(baseline.ratios) == {H2C, HTTP1}
    assert all(0 < ratio < 5 for ratio in baseline.ratios.values())
    assert baseline.tolerance == pytest.approx(0.25)
