"""The result files' readers beside their writers: torn lines, nulls for missing figures, and
rows and run metadata that round-trip with vLLM's key names unchanged on disk."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import metrics, schema
from harness.schema import ResultsError, RunEnd, RunMeta, SummaryRow

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
    row = SummaryRow.from_dict(summary | {"stack": "zerolayer", "profile": "a_latency"})
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
    row = SummaryRow.from_dict(flat)
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
