"""The result files' readers beside their writers: torn lines, nulls for missing figures, and
rows and run metadata that round-trip with vLLM's key names unchanged on disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import metrics, schema
from harness.schema import ResultsError, RunEnd, RunMeta, SummaryRow
from tests.support.paths import TEST_DATA

ROWS = st.lists(
    st.dictionaries(
        st.text("abc", min_size=1, max_size=3), st.integers(-(2**53), 2**53), max_size=3
    ),
    min_size=1,
    max_size=8,
)


@given(rows=ROWS, torn=st.binary(min_size=1, max_size=20).filter(lambda b: b"\n" not in b))
def test_a_torn_last_line_is_skipped_and_nothing_else(
    tmp_path_factory: pytest.TempPathFactory, rows: list[dict[str, int]], torn: bytes
) -> None:
    path = tmp_path_factory.mktemp("jsonl") / "t.jsonl"
    body = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    try:
        orjson.loads(torn)
        torn = b"{" + torn
    except orjson.JSONDecodeError:
        pass
    path.write_bytes(body + torn)
    assert schema.read_jsonl(path) == rows


def test_a_bad_line_in_the_middle_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(ResultsError, match=r"t\.jsonl: line 2 is not JSON"):
        schema.read_jsonl(path)


def test_an_empty_series_is_null_not_zero() -> None:
    stats = metrics.describe("e2el", [])
    assert stats and all(v is None for v in stats.values())
    record = schema.RequestRecord("r0", "zerolayer", "a_latency", "native", 1, outcome="error")
    summary = metrics.summarize([record])
    assert summary["median_e2el_ms"] is None and summary["completed"] == 0
    row = schema.from_data(SummaryRow, summary | {"stack": "zerolayer", "profile": "a_latency"})
    assert row.stat("median_e2el_ms") is None and row.failed == 1


def test_a_summary_row_round_trips_with_vllm_keys(tmp_path: Path) -> None:
    records = [
        schema.RequestRecord(
            f"r{i}", "zerolayer", "a_latency", "native", 0, 1, 2, 5_000_000, 9_000_000,
            [5_000_000, 9_000_000], "completed", output_tokens=2,
        )
        for i in range(3)
    ]  # fmt: skip
    flat = {"stack": "zerolayer", "profile": "a_latency", "loader": "k6"} | metrics.summarize(
        records
    )
    flat |= {"chaos_scale": {"x": 1}, "ttft_is_first_byte": True, "loader_protocol": "h2"}
    row = schema.from_data(SummaryRow, flat)
    assert row.stat("p99.9_e2el_ms") == pytest.approx(flat["p99.9_e2el_ms"])
    assert row.other == {"chaos_scale": {"x": 1}} and row.ttft_is_first_byte
    schema.write_summary(tmp_path, [row])
    on_disk = orjson.loads((tmp_path / schema.SUMMARY).read_bytes())["rows"][0]
    assert set(flat) <= set(on_disk) and on_disk["median_ttft_ms"] == flat["median_ttft_ms"]
    assert schema.read_summary(tmp_path) == [row]


def test_run_meta_records_the_real_end(tmp_path: Path) -> None:
    meta = RunMeta(run_id="r1", scale="smoke", config={"loader": "k6", "seed": 3})
    schema.write_run_meta(tmp_path, meta)
    first = orjson.loads((tmp_path / schema.RUN_META).read_bytes())
    assert first["complete"] is False and first["end"]["state"] == "running"
    meta.end, meta.end_detail = RunEnd.ERROR, "RuntimeError: engine on fire"
    schema.write_run_meta(tmp_path, meta)
    back = schema.read_run_meta(tmp_path)
    assert back == meta and back.loader == "k6" and back.seed == 3
    assert back.incomplete_reason == "stopped by an error: RuntimeError: engine on fire"
    on_disk = orjson.loads((tmp_path / schema.RUN_META).read_bytes())
    assert "RuntimeError: engine on fire" in on_disk["incomplete_reason"]


def test_older_run_meta_reads(tmp_path: Path) -> None:
    legacy = {"run_id": "old", "complete": True, "engine": {"name": "sim", "max_num_seqs": 4}}
    (tmp_path / schema.RUN_META).write_bytes(orjson.dumps(legacy | {"status": "x"}))
    meta = schema.read_run_meta(tmp_path)
    assert meta.complete and meta.engine == "sim" and meta.engine_options == {"max_num_seqs": 4}
    assert meta.other == {"status": "x"}


FIXTURE = TEST_DATA / "v2-smoke-run"

FIGURE = st.none() | st.floats(allow_nan=False, allow_infinity=False, width=32)
COUNT = st.integers(0, 2**31)
LENGTHS = st.builds(schema.LengthStats, COUNT, FIGURE, FIGURE, FIGURE, FIGURE, FIGURE)
TURNS = st.builds(
    schema.TurnStats, st.integers(1, 50), COUNT, COUNT, FIGURE, FIGURE, FIGURE,
    st.floats(0, 1e6, allow_nan=False),
)  # fmt: skip
CACHE = st.builds(schema.PrefixCacheStats, st.none() | COUNT, st.none() | COUNT, COUNT)
NAME = st.text("abcxyz-_/", min_size=1, max_size=12)
RECORDS = st.builds(
    schema.RequestRecord,
    request_id=NAME, stack=NAME, profile=NAME, loader=NAME,
    intended_start_ns=st.integers(0, 2**62), sent_ns=st.integers(0, 2**62),
    chunk_ns=st.lists(st.integers(0, 2**62), max_size=6),
    outcome=st.sampled_from(schema.OUTCOMES), error_code=st.text(max_size=8),
    prompt_tokens=COUNT, output_tokens=COUNT, turn=st.integers(0, 9),
)  # fmt: skip
JSON_INT = st.integers(-(2**53), 2**53)
STAT_KEYS = st.sampled_from(["median_e2el_ms", "p99_ttft_ms", "p99.9_itl_ms", "std_lag_ms"])
ROWS_TYPED = st.builds(
    SummaryRow,
    stack=NAME, profile=NAME, loader=NAME, completed=COUNT,
    slo_met=st.none() | st.booleans(), host_cpu_pct=FIGURE,
    stats=st.dictionaries(STAT_KEYS, FIGURE, max_size=4),
    errors_by_code=st.dictionaries(NAME, COUNT, max_size=2),
    input_lens=LENGTHS, output_lens=LENGTHS,
    by_turn=st.lists(TURNS, max_size=3), prefix_cache=CACHE,
    other=st.dictionaries(st.sampled_from(["chaos_scale", "note"]), JSON_INT, max_size=2),
)  # fmt: skip


ROUND_TRIPS = settings(max_examples=40, deadline=None)


@ROUND_TRIPS
@given(records=st.lists(RECORDS, max_size=5))
def test_request_records_survive_write_and_read(
    tmp_path_factory: pytest.TempPathFactory, records: list[schema.RequestRecord]
) -> None:
    path = tmp_path_factory.mktemp("req") / "r.jsonl"
    with schema.JsonlWriter(path) as out:
        for record in records:
            out.write(record)
    assert schema.read_requests(path) == records


@ROUND_TRIPS
@given(rows=st.lists(ROWS_TYPED, min_size=1, max_size=3))
def test_summary_rows_with_their_nested_records_survive_write_and_read(
    tmp_path_factory: pytest.TempPathFactory, rows: list[SummaryRow]
) -> None:
    run_dir = tmp_path_factory.mktemp("summary")
    schema.write_summary(run_dir, rows)
    assert schema.read_summary(run_dir) == rows
    assert schema.read_sweep(run_dir) is None


@ROUND_TRIPS
@given(
    end=st.sampled_from(RunEnd),
    detail=st.text(max_size=20),
    finished=st.none() | st.integers(0, 2**62),
    validity=st.dictionaries(NAME, st.builds(schema.Validity), max_size=2),
    machine=st.builds(schema.Machine, NAME, NAME, st.none() | COUNT, st.none() | COUNT),
    ticks=COUNT,
)
def test_run_meta_survives_write_and_read(
    tmp_path_factory: pytest.TempPathFactory,
    end: RunEnd,
    detail: str,
    finished: int | None,
    validity: dict[str, schema.Validity],
    machine: schema.Machine,
    ticks: int,
) -> None:
    run_dir = tmp_path_factory.mktemp("meta")
    telemetry = schema.TelemetryInfo(0.25, [{"kind": "engine", "available": True}], ticks)
    meta = RunMeta("r", end=end, end_detail=detail, finished_ns=finished, validity=validity)
    meta.machine, meta.telemetry = machine, telemetry
    schema.write_run_meta(run_dir, meta)
    assert schema.read_run_meta(run_dir) == meta


def test_the_nested_statistics_read_back_typed() -> None:
    records = [
        schema.RequestRecord(
            f"r{i}", "zerolayer", "e", "native", 0, 1, 2, 5_000_000, 9_000_000,
            [5_000_000], "completed", prompt_tokens=100 * (i + 1), output_tokens=2, turn=i + 1,
        )
        for i in range(2)
    ]  # fmt: skip
    row = schema.from_data(SummaryRow, metrics.summarize(records))
    assert row.input_lens == metrics.input_lengths(records)
    assert row.by_turn == metrics.by_turn(records)
    assert isinstance(row.prefix_cache, schema.PrefixCacheStats)
    assert row.prefix_cache.queries is None, "no engine telemetry: no counters"


def test_the_derived_prefix_cache_figures_are_written_for_readers_of_the_file() -> None:
    on_disk = schema.to_data(schema.PrefixCacheStats(400, 100, 2))
    assert on_disk == {
        "queries": 400, "hits": 100, "completed": 2,
        "hit_rate": 0.25, "prefilled_tokens_per_request": 150.0,
    }  # fmt: skip
    assert schema.from_data(schema.PrefixCacheStats, on_disk) == schema.PrefixCacheStats(
        400, 100, 2
    )


def test_every_results_file_says_its_schema_version(tmp_path: Path) -> None:
    schema.write_run_meta(tmp_path, RunMeta("r", schema_version=1))
    schema.write_summary(tmp_path, [])
    for name in (schema.RUN_META, schema.SUMMARY):
        written = orjson.loads((tmp_path / name).read_bytes())
        assert written["schema_version"] == schema.SCHEMA_VERSION, name


@pytest.mark.parametrize("name", [schema.RUN_META, schema.SUMMARY])
@pytest.mark.parametrize("version", [99, 0, "3"])
def test_a_version_this_code_does_not_read_is_refused_in_one_line(
    tmp_path: Path, name: str, version: object
) -> None:
    shutil.copytree(FIXTURE, tmp_path / "run")
    path = tmp_path / "run" / name
    path.write_bytes(orjson.dumps(orjson.loads(path.read_bytes()) | {"schema_version": version}))
    read = schema.read_run_meta if name == schema.RUN_META else schema.read_summary
    with pytest.raises(ResultsError) as caught:
        read(tmp_path / "run")
    message = str(caught.value)
    assert "\n" not in message and name in message
    assert f"version {version!r}" in message and f"to {schema.SCHEMA_VERSION}" in message


def test_a_record_that_does_not_fit_is_refused_naming_file_and_field(tmp_path: Path) -> None:
    (tmp_path / schema.SUMMARY).write_bytes(
        orjson.dumps({"schema_version": 2, "rows": [{"stack": "z", "completed": "many"}]})
    )
    with pytest.raises(ResultsError, match=r"summary\.json: .*completed") as caught:
        schema.read_summary(tmp_path)
    assert "\n" not in str(caught.value)


def test_results_written_before_the_typed_schema_read_unchanged() -> None:
    """tests/data/v2-smoke-run: a smoke run of profile a on the zero-layer stack as the code
    before version 3 wrote it (per-request and telemetry files trimmed)."""
    meta = schema.read_run_meta(FIXTURE)
    assert meta.schema_version == 2 and meta.complete and meta.engine == "sim"
    assert meta.other == {"token_rule": "bytes/4"}
    assert meta.machine.cpus == 2 and meta.machine.cpu_speed_end == 984341
    assert [s["kind"] for s in meta.telemetry.sources] == ["nvml", "engine", "process"]
    (row,) = schema.read_summary(FIXTURE)
    assert (row.stack, row.profile, row.completed) == ("zerolayer", "a_latency", 24)
    assert row.input_lens.count == 24 and row.input_lens.p50 == pytest.approx(250.0)
    assert row.prefix_cache.queries == 6000 and row.prefix_cache.hit_rate == 0.0
    assert row.stat("p99_e2el_ms") is not None
    records = schema.read_requests(FIXTURE / schema.requests_file("zerolayer", "a_latency"))
    assert len(records) == 8 and all(r.outcome == "completed" for r in records)
    old_row = orjson.loads((FIXTURE / schema.SUMMARY).read_bytes())["rows"][0]
    # version 3 writes a version-2 row's keys unchanged, plus the fields added since (None)
    assert schema.to_data(row) == old_row | {"host_speed": None}
    old_meta = orjson.loads((FIXTURE / schema.RUN_META).read_bytes())
    # ... and run.json's, plus the parity check's record (nothing read in an older run) and the
    # cluster's (None: a run not placed on a Ray cluster)
    added = {
        "schema_version": schema.SCHEMA_VERSION,
        "parity": schema.to_data(schema.Parity()),
        "cluster": None,
    }
    assert schema.to_data(meta) == old_meta | added
