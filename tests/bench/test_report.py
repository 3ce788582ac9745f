"""The report on real results: every plot drawn from the data, claims, and incomplete runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest

from bench.cli import main as cli_main
from bench.report import claims, html, load_run, plots
from harness import metrics, schema
from tests.support.paths import TEST_DATA
from tests.support.simrun import fail_everything, make_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "complete")


def test_report_embeds_every_plot_and_a_row_per_stack_and_profile(run_dir: Path) -> None:
    assert cli_main(["report", str(run_dir)]) == 0
    page = (run_dir / schema.REPORT).read_text()
    run = load_run(run_dir)
    drawn = plots.RUN_PLOTS | plots.CLAIM_PLOTS
    assert set(plots.plots_for(run)) == set(drawn), "a plain run has no load curves"
    for name in drawn:
        png = run_dir / schema.PLOTS_DIR / f"{name}.png"
        assert png.stat().st_size > 10_000, f"{name} is drawn"
        assert f"alt='{name}'" in page
    assert page.count("data:image/png;base64,") == len(drawn)
    assert not run.incomplete and "Incomplete run" not in page
    for stack in ("zerolayer", "baseline"):
        for profile in ("a_latency", "d_fault"):
            assert f"<td class='l'>{stack}</td><td class='l'>{profile}</td>" in page
            entry = run.summary(stack, profile)
            median = entry.stat("median_e2el_ms") if entry is not None else None
            assert median is not None and f"{median:.2f}" in page


def test_latency_cdf_is_the_metrics_distribution(run_dir: Path) -> None:
    run = load_run(run_dir)
    fig = plots.latency_cdf(run)
    ax = fig.axes[run.profiles.index("a_latency")]
    line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("baseline E2EL"))
    expected = np.sort(metrics.series(run.records[("baseline", "a_latency")])["e2el"])
    assert np.allclose(line.get_xdata(), expected)
    assert line.get_ydata()[-1] == 1.0
    assert "ms" in ax.get_xlabel() and "scale test" in fig.texts[0].get_text()


def test_timeline_marks_every_fault_on_both_panels(run_dir: Path) -> None:
    run = load_run(run_dir)
    assert {f.stack for f in run.faults} == {"zerolayer", "baseline"}
    fig = plots.ttft_itl_timeline(run)
    for ax in fig.axes:
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        xs = sorted(ln.get_xdata()[0] for ln in dashed)
        assert xs == pytest.approx(sorted((f.t_ns - run.t0_ns) / 1e9 for f in run.faults))


def test_fragmentation_plot_draws_kv_series_from_telemetry(run_dir: Path) -> None:
    run = load_run(run_dir)
    fig = plots.gpu_fragmentation(run)
    labels = {ln.get_label() for ln in fig.axes[1].get_lines()}
    assert {"zerolayer/engine0 KV occupancy", "baseline/engine0 KV waste"} <= labels
    peak = max(
        r["kv_usage"] for r in run.telemetry if r.get("stack") == "zerolayer" and "kv_usage" in r
    )
    line = next(
        ln for ln in fig.axes[1].get_lines() if ln.get_label() == "zerolayer/engine0 KV occupancy"
    )
    assert np.nanmax(line.get_ydata()) == pytest.approx(100 * peak) and peak > 0
    assert "no NVML" in fig.axes[0].get_ylabel(), "the sim fallback says what it shows"


def test_where_time_goes_uses_engine_accounting_then_falls_back(
    run_dir: Path, tmp_path: Path
) -> None:
    split = plots.time_breakdown(load_run(run_dir))
    basis, zl = split[("zerolayer", "a_latency")]
    _, base = split[("baseline", "a_latency")]
    assert basis == "engine-side accounting"
    assert base["layer"] > zl["layer"] >= 0, "the gated stack queues in its layer"
    copy = tmp_path / "no-engine-accounting"
    shutil.copytree(run_dir, copy)
    for path in copy.glob("requests-*.jsonl"):
        recs = schema.read_requests(path)
        path.write_bytes(
            b"".join(orjson.dumps({**schema.to_data(r), "engine_ns": 0}) + b"\n" for r in recs)
        )
    run = load_run(copy)
    basis, parts = plots.time_breakdown(run)[("zerolayer", "a_latency")]
    assert basis == "TTFT decomposition"
    entry = run.summary("zerolayer", "a_latency")
    assert entry is not None
    total = parts["TTFT (layer + engine prefill)"] + parts["generation after first token"]
    assert total == pytest.approx(entry.stat("mean_e2el_ms"))
    assert "TTFT decomposition" in plots.where_time_goes(run).texts[0].get_text()


def _with_validity(run_dir: Path, copy: Path, baseline_reason: str = "") -> Path:
    """A copy of the run whose rows are valid (a loaded machine can make the loader lag), or
    whose baseline a_latency row is invalid for ``baseline_reason``."""
    shutil.copytree(run_dir, copy)
    rows = schema.read_summary(copy)
    for row in rows:
        row.valid, row.invalid_reasons, row.loader_limited = True, [], False
        row.saturated = row.host_saturated = False
        row.host_cpu_pct = row.host_busiest_cpu_pct = 50.0
        row.host_speed = 1_000_000.0
        if (row.stack, row.profile) == ("baseline", "a_latency") and baseline_reason:
            row.valid, row.invalid_reasons = False, [baseline_reason]
    schema.write_summary(copy, rows)
    return copy


def test_claims_state_measured_figures_or_not_measured(run_dir: Path, tmp_path: Path) -> None:
    run = load_run(_with_validity(run_dir, tmp_path / "valid"))
    results = {c.key: c for c in claims.evaluate(run)}
    assert len(results) == len(claims.CLAIMS)
    zl, base = run.summary("zerolayer", "a_latency"), run.summary("baseline", "a_latency")
    assert zl is not None and base is not None
    overhead = results["layer_overhead"]
    assert overhead.status == claims.UNDECIDED, "one trial per stack decides nothing"
    assert overhead.reason.startswith("a_latency: too few valid trials: 1 of the 3 needed")
    for key in ("refusal_speed", "fault_errors", "retry_success"):
        assert results[key].status == claims.NOT_MEASURED, f"{key}: no chaos table in this run"
    assert results["layer_cpu"].status == claims.NOT_MEASURED, "no baseline processes watched"
    fragmentation = results["fragmentation"]
    assert fragmentation.status == claims.NOT_MEASURED, "a run of stacks runs one configuration"
    assert "zl-bench fragmentation" in fragmentation.reason
    reason = "loader lagged: p99 scheduling lag 2.000 ms > 1.0 ms"
    invalid = load_run(_with_validity(run_dir, tmp_path / "invalid", reason))
    overhead = next(c for c in claims.evaluate(invalid) if c.key == "layer_overhead")
    assert overhead.status == claims.UNDECIDED and reason in overhead.reason
    assert "0 of the 3 needed" in overhead.reason


def test_an_interrupted_run_renders_marked_incomplete(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "cut", complete=False)
    with open(run_dir / schema.requests_file("baseline", "d_fault"), "ab") as fh:
        fh.write(b'{"request_id": "baseline-d_fault-99", "stack": "base')
    out = html.render(run_dir)
    page = out.read_text()
    assert "Incomplete run" in page and "interrupted" in page
    run = load_run(run_dir)
    assert all(entry.recomputed for entry in run.summaries)
    assert len(run.records[("baseline", "d_fault")]) == 24, "the torn line is skipped"
    assert page.count("data:image/png;base64,") == len(plots.RUN_PLOTS | plots.CLAIM_PLOTS)


def test_a_profile_with_zero_completions_renders_and_says_so(run_dir: Path, tmp_path: Path) -> None:
    down = fail_everything(shutil.copytree(run_dir, tmp_path / "down"))
    assert cli_main(["report", str(down)]) == 0
    page = (down / schema.REPORT).read_text()
    assert page.count("data:image/png;base64,") == len(plots.RUN_PLOTS | plots.CLAIM_PLOTS)
    assert "<i>no completions</i>" in page
    row = load_run(down).summary("zerolayer", "a_latency")
    assert row is not None and row.completed == 0 and row.stat("median_e2el_ms") is None


def test_report_on_what_is_not_a_run_is_one_error_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / "results"
    shutil.copytree(run_dir, parent / run_dir.name)
    (tmp_path / "empty").mkdir()
    for path, says in (
        (tmp_path / "missing", "no results directory"),
        (tmp_path / "empty", "is not a run directory"),
        (parent, f"it holds the runs {run_dir.name}"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli_main(["report", str(path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("zl-bench: error: ") and err.count("\n") == 1 and says in err
    assert (
        not (parent / schema.REPORT).exists() and not (tmp_path / "empty" / schema.REPORT).exists()
    )


def test_a_damaged_line_mid_file_is_an_error_naming_file_and_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = shutil.copytree(run_dir, tmp_path / "damaged")
    path = damaged / schema.requests_file("zerolayer", "a_latency")
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], b"{not json", *lines[1:]]) + b"\n")
    with pytest.raises(SystemExit) as exc:
        cli_main(["report", str(damaged)])
    assert exc.value.code == 2
    assert f"{path}: line 2 is not JSON" in capsys.readouterr().err


V2_RUN = TEST_DATA / "v2-smoke-run"


def test_report_renders_a_run_written_before_the_typed_schema(tmp_path: Path) -> None:
    old = shutil.copytree(V2_RUN, tmp_path / "old")
    assert cli_main(["report", str(old)]) == 0
    page = (old / schema.REPORT).read_text()
    assert "zerolayer" in page and "a_latency" in page
    assert load_run(old).summary("zerolayer", "a_latency") is not None


def test_report_refuses_a_newer_schema_version_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newer = shutil.copytree(V2_RUN, tmp_path / "newer")
    meta = newer / schema.RUN_META
    meta.write_bytes(orjson.dumps(orjson.loads(meta.read_bytes()) | {"schema_version": 99}))
    with pytest.raises(SystemExit) as exc:
        cli_main(["report", str(newer)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "version 99" in err and f"to {schema.SCHEMA_VERSION}" in err
    assert not (newer / schema.REPORT).exists()
