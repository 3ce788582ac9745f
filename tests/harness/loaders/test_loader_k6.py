"""The k6 loader: the generated script runs in the real k6 binary, and its output is parsed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from harness.loaders import LOADERS, needs_tls
from harness.loaders.base import replica_routes
from harness.loaders.k6 import (
    K6Loader,
    TlsTrust,
    console_lines,
    k6_binary,
    parse_run,
    tls_trust,
    write_inputs,
)
from harness.schema import read_requests
from harness.stacks import StackName, StackSpec, stand_up
from harness.workload import build_schedule
from tests.support.loader_checks import HANG_DEADLINE_MS, assert_spread, profile_at, served


def test_parse_maps_k6_lines_to_records(tmp_path: Path) -> None:
    sched = build_schedule(profile_at(rate=10.0, duration_s=0.4, max_tokens=4))
    start = 1_700_000_000_000
    ok = {"i": 0, "url": "https://127.0.0.1:1", "start": start, "dispatch": start + 1,
          "end": start + 51, "sending": 0.5, "waiting": 9.5, "receiving": 30.0, "status": 200,
          "proto": "HTTP/2.0", "zl_error": "", "sse_error": "", "error_code": 0,
          "tokens": 4}  # fmt: skip
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
    assert r0.replica == "https://127.0.0.1:1"
    assert r0.intended_start_ns == start * ms and r0.dispatch_ns == (start + 1) * ms
    assert r0.end_ns - r0.sent_ns == 40 * ms  # sending + waiting + receiving
    assert r0.first_token_ns - r0.sent_ns == 10 * ms  # time to first byte
    assert r0.chunk_ns == []  # k6 reads whole responses: no chunk times, so no ITL samples
    assert r1.outcome == "error" and r1.error_code == "queue_full" and r1.http_status == 429
    assert r1.intended_start_ns == (start + 100) * ms  # iteration i starts at i / rate
    assert r2.outcome == "lost"
    assert r3.outcome == "error" and r3.error_code == "not_sent"  # k6 never started it
    assert r3.intended_start_ns == (start + 300) * ms and not r3.replica


def test_script_inputs_match_the_schedule(tmp_path: Path) -> None:
    sched = build_schedule(profile_at(rate=7.5, duration_s=2.0, max_tokens=8))
    routes = [f"https://127.0.0.1:{1 + i % 2}/" for i in range(len(sched))]
    paths = write_inputs(
        sched, routes, tmp_path, rate=7.5, duration_s=2.0, vus=4, grace_s=1.0, trust=TlsTrust()
    )
    plan = json.loads(paths["plan"].read_text())
    fillers = json.loads(paths["fillers"].read_text())
    config = json.loads(paths["config"].read_text())
    assert config["rate_per_1000s"] == 7500 and config["insecure_skip_tls_verify"] is False
    assert [p["id"] for p in plan] == [r.request_id for r in sched]
    assert [p["url"] for p in plan] == [u.rstrip("/") for u in routes]
    for p, req in zip(plan, sched, strict=True):
        # The script builds the prompt as id + ":" + filler, cut to size: the same text.
        assert (p["id"] + ":" + fillers[p["filler"]])[: p["prompt_bytes"]] == req.prompt()
    script = paths["script"].read_text()
    assert "constant-arrival-rate" in script and "p.url + '/v1/completions'" in script


def test_tls_trust_skips_verification_only_for_loopback(tmp_path: Path) -> None:
    ca = tmp_path / "cert.pem"
    assert tls_trust(["http://127.0.0.1:1"], None) == TlsTrust()
    assert tls_trust(["https://127.0.0.1:1"], ca).ca_file == ca
    assert not tls_trust(["https://127.0.0.1:1"], ca).skip_verify
    assert tls_trust(["https://localhost:1", "https://[::1]:2"], None).skip_verify
    remote = tls_trust(["https://127.0.0.1:1", "https://10.0.0.1:2"], None)
    assert not remote.skip_verify and remote.ca_file is None


def test_k6_needs_tls_only_against_zerolayer() -> None:
    assert needs_tls("k6", StackName.ZEROLAYER)
    assert not needs_tls("k6", StackName.BASELINE)
    assert not any(needs_tls(name, StackName.ZEROLAYER) for name in ("native", "locust"))


def test_k6_spreads_over_every_replica_with_http2_over_tls(tmp_path: Path) -> None:
    """Two TLS replicas: each request goes where the SDK's ring sends its session, over HTTP/2,
    each replica's own /metrics counts what the plan sent it; a Poisson profile is labelled as
    sent at a constant rate; TTFT is labelled time to first byte."""
    assert Path(k6_binary()).name == "k6"
    profile = profile_at(
        rate=100.0, duration_s=2.0, max_tokens=4, process="poisson", deadline_ms=HANG_DEADLINE_MS
    )
    sched = build_schedule(profile)
    tls = needs_tls("k6", StackName.ZEROLAYER)
    spec = StackSpec(StackName.ZEROLAYER, engine="sim", replicas=2, tls=tls)
    assert LOADERS["k6"].name == "k6"
    with stand_up(spec, tmp_path / "stack") as stack:
        assert stack.tls_ca is not None
        # A VU per iteration: on a loaded host k6 drops an iteration when every VU is busy.
        loader = K6Loader(vus=len(sched))
        result = loader.run(sched, stack, profile, tmp_path / "req.jsonl", tmp_path / "k6")
        counts = served(stack)
        planned = Counter(replica_routes(sched, stack))
    assert result.protocol == "h2" and result.extra["protocols"] == ["HTTP/2.0"]
    assert result.ttft_is_first_byte
    # No chunk times, so no ITL: null in the summary, not 0 ms.
    assert result.summary["median_itl_ms"] is None and result.summary["p99_itl_ms"] is None
    assert "run's CA" in result.extra["tls_verification"]  # verified, not skipped
    assert result.extra["arrival"] == "constant"
    assert result.extra["arrival_requested"] == "poisson"
    assert result.extra["dropped_iterations"] == 0 and result.extra["vus"] == len(sched)
    assert result.summary["completed"] == len(sched) > 150
    assert counts == planned == result.extra["per_replica"]
    assert_spread(counts, replicas=2)
    saved = read_requests(tmp_path / "req.jsonl")
    assert {r.request_id for r in saved} == {r.request_id for r in sched}
    assert all(r.output_tokens == 4 and r.loader == "k6" and not r.chunk_ns for r in saved)
    k6_median = result.extra["k6_summary"]["http_req_duration"]["med"]
    assert result.summary["median_e2el_ms"] == pytest.approx(k6_median, rel=0.1, abs=2.0)


def test_k6_reports_refusals_with_their_code(tmp_path: Path) -> None:
    profile = profile_at(rate=20.0, duration_s=0.5, max_tokens=4, prompt_bytes=4000)
    sched = build_schedule(profile)
    spec = StackSpec(
        StackName.ZEROLAYER, engine="sim", engine_options={"max_model_len": 256}, replicas=1,
        tls=True,
    )  # fmt: skip
    with stand_up(spec, tmp_path / "stack") as stack:
        # A VU per iteration: on a loaded host k6 drops an iteration when every VU is busy.
        result = K6Loader(vus=len(sched)).run(
            sched, stack, profile, tmp_path / "req.jsonl", tmp_path
        )
    assert result.summary["errors"] == len(sched) == 10
    assert set(result.summary["errors_by_code"]) == {"prompt_too_long"}


def test_k6_segments_split_the_iterations_and_together_send_the_schedule_once(
    tmp_path: Path,
) -> None:
    """k6's own distributed mode, each instance as a cluster's loader worker runs it (here in
    this process: the cluster places them, ``test_cluster_run`` places them): paused, resumed
    through its REST API, each with its segment of the one plan."""
    from harness.loaders.k6_segments import K6Segment, segments

    sched = build_schedule(profile_at(rate=20.0, duration_s=1.0, max_tokens=4))
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=1, tls=True)
    with stand_up(spec, tmp_path / "stack") as stack:
        trust = tls_trust(stack.urls, stack.tls_ca)
        # A VU per iteration: on a loaded host k6 drops an iteration when every VU is busy.
        paths = write_inputs(
            sched, replica_routes(sched, stack), tmp_path / "k6", rate=20.0, duration_s=1.0,
            vus=len(sched), grace_s=5.0, trust=trust,
        )  # fmt: skip
        files = {p.name: p.read_bytes() for p in paths.values()}
        assert trust.ca_file is not None
        files["ca.pem"] = trust.ca_file.read_bytes()
        names, sequence = segments(2)
        assert (names, sequence) == (["0:1/2", "1/2:1"], "0,1/2,1")
        instances = [K6Segment(), K6Segment()]
        for instance, name in zip(instances, names, strict=True):
            assert instance.start(files, name, sequence)
        for instance in instances:
            instance.resume()
        ends = [instance.finish(60.0) for instance in instances]
    per_segment = [{line["i"] for line in lines} for lines, _ in ends]
    assert all(per_segment) and not per_segment[0] & per_segment[1]
    records, dropped = parse_run(sched, [line for lines, _ in ends for line in lines],
                                 "zerolayer", "a", rate=20.0)  # fmt: skip
    k6_dropped = [m.get("dropped_iterations", {}).get("count", 0) for _, m in ends]
    assert dropped == 0, f"{dropped} not sent; k6's dropped_iterations per segment: {k6_dropped}"
    assert {r.request_id for r in records} == {r.request_id for r in sched}
    assert all(r.outcome == "completed" for r in records)
