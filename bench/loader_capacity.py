"""Loader capacity: the highest rate each loader sustains against a null-engine replica.

A rate is sustained when every scheduled request completed and the loader's p99 scheduling lag
stayed under 1 ms (k6's script clock is ``Date.now()``, whole milliseconds, so its limit adds
that resolution; it must also drop no iteration). Loader and replica share the machine's cores,
as they would in a laptop run. On a shared machine other processes preempt the loader for
milliseconds at a time, which shows as lag at any rate; so each rate runs ``--repeats`` times and
the best run counts (noise only ever adds lag), while every run is printed and saved, so the
spread between repeats shows how noisy the figures were. Each run also reports CPU per request:
the native loader's own (idle spin turns excluded) and the replica process's (from psutil).

    python -m bench.loader_capacity --loaders native,k6 --rates 500,1000,2000 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import uvloop

from harness.loaders.base import LoadResult
from harness.loaders.k6 import run_k6
from harness.loaders.locust import run_locust
from harness.loaders.native import run_native
from harness.loaders.tls import self_signed
from harness.metrics import LAG_LIMIT_MS
from harness.profile import load_profile
from harness.stacks import ReplicaProcess
from harness.workload import Schedule, build_schedule

K6_CLOCK_RESOLUTION_MS = 1.0


def schedule_at(rate: float, seconds: float, max_tokens: int) -> Schedule:
    """Profile A's request shape (1 KB prompt) at ``rate`` for ``seconds``."""
    p = load_profile("a", "smoke")
    classes = tuple(replace(c, max_tokens=max_tokens) for c in p.classes)
    return build_schedule(
        replace(p, rate=rate, duration_s=seconds, max_requests=10**7, classes=classes)
    )


def sustained(loader: str, result: LoadResult) -> bool:
    """Every request completed and the p99 lag stayed under the limit (plus k6's clock)."""
    s = result.summary
    limit = LAG_LIMIT_MS + (K6_CLOCK_RESOLUTION_MS if loader.startswith("k6") else 0.0)
    return s["completed"] == s["num_requests"] and s["p99_lag_ms"] < limit


def run_one(
    loader: str, rate: float, seconds: float, url: str, workdir: Path, tokens: int
) -> LoadResult:
    """One loader at one rate against the replica at ``url``."""
    sched = schedule_at(rate, seconds, tokens)
    records = workdir / f"{loader}-{rate:g}.jsonl"
    if loader == "native":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(
                run_native(
                    sched, urls=[url], stack="zerolayer", profile="capacity",
                    records_path=records, progress=None, lag_fraction=0.0,
                    client_options={"health_interval_s": 0},
                )
            )  # fmt: skip
    if loader in ("k6", "k6-http1"):
        return run_k6(
            sched, url=url, stack="zerolayer", profile="capacity", rate=rate,
            duration_s=seconds, workdir=workdir / f"{loader}-{rate:g}", records_path=records,
            vus=max(20, int(rate / 50)), lag_fraction=0.0,
        )  # fmt: skip
    if loader == "locust":
        return run_locust(
            sched, url=url, stack="zerolayer", profile="capacity",
            workdir=workdir / f"locust-{rate:g}", records_path=records,
            users=max(8, int(rate / 20)), lag_fraction=0.0,
        )  # fmt: skip
    raise ValueError(f"unknown loader {loader!r}")


def _row(loader: str, rate: float, result: LoadResult) -> dict[str, Any]:
    s = result.summary
    return {
        "loader": loader,
        "rate": rate,
        "achieved": s["request_throughput"],
        "completed": s["completed"],
        "scheduled": s["num_requests"],
        "p50_lag_ms": s["median_lag_ms"],
        "p99_lag_ms": s["p99_lag_ms"],
        "p99.9_lag_ms": s["p99.9_lag_ms"],
        "median_e2el_ms": s["median_e2el_ms"],
        # CPU per request: the native loader's own (idle spin excluded; NaN for other loaders).
        "loader_cpu_us": result.extra.get("loader_cpu_us_per_request", float("nan")),
        "sustained": sustained(loader, result),
        "valid": s["valid"],
        "invalid_reasons": s["invalid_reasons"],
    }


def measure(
    loaders: list[str],
    rates: list[float],
    seconds: float,
    tokens: int,
    workdir: Path,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Every (loader, rate) pair against a fresh null-engine replica per loader: HTTP/2 over
    TLS for k6 (Go speaks HTTP/2 only over TLS), h2c for native, HTTP/1.1 for locust and for
    ``k6-http1`` (k6 without the replica's TLS cost, to show k6's own ceiling)."""
    cert, key = self_signed(workdir / "tls")
    rows = []
    for loader in loaders:
        tls = (cert, key) if loader == "k6" else None
        with ReplicaProcess("null", tls=tls) as replica:
            proc = psutil.Process(replica.pid)
            for rate, repeat in itertools.product(rates, range(repeats)):
                cpu0 = sum(proc.cpu_times()[:2])
                result = run_one(loader, rate, seconds, replica.url, workdir, tokens)
                replica_cpu = sum(proc.cpu_times()[:2]) - cpu0
                row = {**_row(loader, rate, result), "repeat": repeat}
                row["replica_cpu_us"] = replica_cpu / max(1, row["scheduled"]) * 1e6
                rows.append(row)
                verdict = (
                    "valid" if row["valid"] else "INVALID: " + "; ".join(row["invalid_reasons"])
                )
                print(
                    f"{loader:7s} {rate:7.0f}/s achieved {row['achieved']:7.1f}/s "
                    f"completed {row['completed']}/{row['scheduled']} lag p50 "
                    f"{row['p50_lag_ms']:.3f} p99 {row['p99_lag_ms']:.3f} p99.9 "
                    f"{row['p99.9_lag_ms']:.3f} ms e2el p50 {row['median_e2el_ms']:.2f} ms "
                    f"cpu/req loader {row['loader_cpu_us']:.0f} replica "
                    f"{row['replica_cpu_us']:.0f} us "
                    f"{'SUSTAINED' if row['sustained'] else 'not sustained'}; {verdict}",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loader_capacity", description=__doc__)
    p.add_argument("--loaders", default="native,k6", help="native, k6, k6-http1, locust")
    p.add_argument("--rates", default="250,500,1000,1500,2000,2500")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="runs per rate; the best one counts")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    loaders = [x for x in args.loaders.split(",") if x]
    rates = [float(x) for x in args.rates.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="zl-capacity-") as tmp:
        rows = measure(loaders, rates, args.seconds, args.max_tokens, Path(tmp), args.repeats)
    for loader in loaders:
        for rate in rates:
            lags = [r["p99_lag_ms"] for r in rows if r["loader"] == loader and r["rate"] == rate]
            print(
                f"{loader} {rate:.0f}/s p99 lag over {len(lags)} runs: best {min(lags):.3f} "
                f"worst {max(lags):.3f} ms"
            )
        ok = [r["rate"] for r in rows if r["loader"] == loader and r["sustained"]]
        print(f"{loader}: highest sustained rate {max(ok) if ok else 0:.0f} req/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
