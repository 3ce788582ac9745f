"""The k6 loader: the generated script runs in the real k6 binary, and its output is parsed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from harness.loaders.k6 import console_lines, k6_binary, parse_run, run_k6, write_inputs
from harness.loaders.tls import self_signed
from harness.profile import load_profile
from harness.schema import read_requests
from harness.stacks import ReplicaProcess
from harness.workload import Schedule, build_schedule


def _schedule(
    rate: float, duration_s: float, max_tokens: int, prompt_bytes: int = 1000
) -> Schedule:
    p = load_profile("a", "smoke")
    classes = tuple(replace(c, max_tokens=max_tokens, prompt_bytes=prompt_bytes) for c in p.classes)
    return build_schedule(replace(p, rate=rate, duration_s=duration_s, classes=classes))


def test_parse_maps_k6_lines_to_records(tmp_path: Path) -> None:
    sched = _schedule(rate=10.0, duration_s=0.4, max_tokens=4)
    start = 1_700_000_000_000
    ok = {"i": 0, "start": start, "dispatch": start + 1, "end": start + 51, "sending": 0.5,
          "waiting": 9.5, "receiving": 30.0, "status": 200, "proto": "HTTP/2.0", "zl_error": "",
          "sse_error": "", "error_code": 0, "tokens": 4}  # fmt: skip
    refused = {**ok, "i": 1, "dispatch": start + 100, "end": start + 102, "status": 429,
               "zl_error": "queue_full", "tokens": 0}  # fmt: skip
    timeout = {**ok, "i": 2, "dispatch": start + 200, "end": start + 9000, "status": 0,
               "error_code": 1050, "tokens": 0}  # fmt: skip
    log = tmp_path / "console.jsonl"
    log.write_text(
        "\n".join(
            json.dumps({"level": "info", "msg": json.dumps(m)}) for m in (ok, refused, timeout)
        )
        + "\nnot json\n"
    )
    records, dropped = parse_run(sched, console_lines(log), "zerolayer", "a", rate=10.0)
    assert dropped == 1 and len(records) == 4
    r0, r1, r2, r3 = records
    ms = 1_000_000
    assert r0.outcome == "completed" and r0.output_tokens == 4
    assert r0.intended_start_ns == start * ms and r0.dispatch_ns == (start + 1) * ms
    assert r0.end_ns - r0.sent_ns == 40 * ms  # sending + waiting + receiving
    assert r0.first_token_ns - r0.sent_ns == 10 * ms  # time to first byte
    assert r1.outcome == "error" and r1.error_code == "queue_full" and r1.http_status == 429
    assert r1.intended_start_ns == (start + 100) * ms  # iteration i starts at i / rate
    assert r2.outcome == "lost"
    assert r3.outcome == "error" and r3.error_code == "not_sent"  # k6 never started it
    assert r3.intended_start_ns == (start + 300) * ms


def test_script_inputs_match_the_schedule(tmp_path: Path) -> None:
    sched = _schedule(rate=7.5, duration_s=2.0, max_tokens=8)
    paths = write_inputs(
        sched, tmp_path, url="https://127.0.0.1:1", rate=7.5, duration_s=2.0, vus=4, grace_s=1.0
    )
    plan = json.loads(paths["plan"].read_text())
    fillers = json.loads(paths["fillers"].read_text())
    config = json.loads(paths["config"].read_text())
    assert config["rate_per_1000s"] == 7500 and config["url"].endswith("/v1/completions")
    assert [p["id"] for p in plan] == [r.request_id for r in sched]
    for p, req in zip(plan, sched, strict=True):
        # The script builds the prompt as id + ":" + filler, cut to size: the same text.
        assert (p["id"] + ":" + fillers[p["filler"]])[: p["prompt_bytes"]] == req.prompt()
    assert "constant-arrival-rate" in paths["script"].read_text()


def test_k6_speaks_http2_over_tls_to_a_replica(tmp_path: Path) -> None:
    assert Path(k6_binary()).name == "k6"
    sched = _schedule(rate=20.0, duration_s=1.0, max_tokens=4)
    cert, key = self_signed(tmp_path / "tls")
    with ReplicaProcess("sim", tls=(cert, key)) as replica:
        assert replica.url.startswith("https://")
        result = run_k6(
            sched, url=replica.url, stack="zerolayer", profile="a", rate=20.0, duration_s=1.0,
            workdir=tmp_path / "k6", records_path=tmp_path / "req.jsonl", vus=8,
        )  # fmt: skip
    assert result.extra["protocols"] == ["HTTP/2.0"]
    assert result.summary["completed"] == len(sched) == 20
    assert result.extra["dropped_iterations"] == 0
    saved = read_requests(tmp_path / "req.jsonl")
    assert {r.request_id for r in saved} == {r.request_id for r in sched}
    assert all(r.output_tokens == 4 and r.loader == "k6" for r in saved)
    k6_median = result.extra["k6_summary"]["http_req_duration"]["med"]
    assert result.summary["median_e2el_ms"] == pytest.approx(k6_median, rel=0.1, abs=2.0)


def test_k6_reports_refusals_with_their_code(tmp_path: Path) -> None:
    sched = _schedule(rate=20.0, duration_s=0.5, max_tokens=4, prompt_bytes=4000)
    cert, key = self_signed(tmp_path / "tls")
    with ReplicaProcess("sim", tls=(cert, key), extra_args=["--max-model-len", "256"]) as replica:
        result = run_k6(
            sched, url=replica.url, stack="zerolayer", profile="a", rate=20.0, duration_s=0.5,
            workdir=tmp_path / "k6", records_path=tmp_path / "req.jsonl", vus=4,
        )  # fmt: skip
    assert result.summary["errors"] == len(sched) == 10
    assert set(result.summary["errors_by_code"]) == {"prompt_too_long"}
