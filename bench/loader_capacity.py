"""Loader capacity: the highest rate each loader sustains against a null-engine replica.

A rate is sustained when every scheduled request completed and the loader's p99 scheduling lag
stayed under 1 ms (k6's script clock is Date.now(), whole milliseconds, so its limit adds that
resolution; it must also drop no iteration). Loader and replica share the machine's cores, as
they would in a laptop run. On a shared machine other processes preempt the loader for
milliseconds at a time, which shows as lag at any rate; so each rate runs --repeats times and
the best run counts (noise only ever adds lag), while every run is printed and saved, so the
spread between repeats shows how noisy the figures were. Each run also reports CPU per request:
the native loader's own (idle spin turns excluded) and the replica process's (psutil, through
``harness.telemetry.process``). A table of each rate's best and worst p99 lag ends the run.
Every loader goes through the one Loader interface against a stack from the one stand-up path:
k6 gets the replica over TLS (HTTP/2), k6-http1 the same k6 over plaintext HTTP/1.1 (k6's own
ceiling without the replica's TLS cost).

    zl-bench capacity --loaders native,k6 --rates 500,1000,2000 --seconds 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from harness.errors import UsageError
from harness.loaders import needs_tls
from harness.loaders.base import Loader, LoadResult
from harness.loaders.k6 import K6Loader
from harness.loaders.locust import LocustLoader
from harness.loaders.native import NativeLoader
from harness.loaders.sharded import ShardedLoader
from harness.metrics import LAG_LIMIT_MS
from harness.outputs import output_file
from harness.profile import Profile, load_profile
from harness.runner.cluster import check_cluster_options, on_cluster
from harness.stacks import StackName, StackSpec, stand_up
from harness.tables import Align, Column, text_table
from harness.telemetry import measure_host_cpu
from harness.telemetry.process import cpu_spent, read_cpu
from harness.workload import build_schedule

K6_CLOCK_RESOLUTION_MS: Final = 1.0
CAPACITY_LOADERS: Final = ("native", "k6", "k6-http1", "locust")
CAPACITY_PROFILE: Final = "capacity"
LAG_COLUMNS: Final = (
    Column("loader", align=Align.LEFT),
    Column("rate/s"),
    Column("runs"),
    Column("best p99 lag ms"),
    Column("worst p99 lag ms"),
)


@dataclass(frozen=True)
class Settings:
    """One capacity measurement: which loaders, at which rates, for how long, how often;
    ``workers``: the native loader as that many Ray actors on ``ray_address``'s cluster
    instead (one measurement per count), the replica placed there too."""

    loaders: tuple[str, ...]
    rates: tuple[float, ...]
    seconds: float
    max_tokens: int
    repeats: int
    workers: tuple[int, ...] = ()
    ray_address: str | None = None

    def runs(self) -> list[tuple[str, int | None]]:
        """(loader, workers) measured: each loader here, or the native loader per count."""
        if self.workers:
            return [("native", n) for n in self.workers]
        return [(loader, None) for loader in self.loaders]


def profile_at(rate: float, seconds: float, max_tokens: int) -> Profile:
    """Profile A's request shape (1 KB prompt) at ``rate`` for ``seconds``."""
    p = load_profile("a", "smoke")
    classes = tuple(replace(c, max_tokens=max_tokens) for c in p.classes)
    return replace(
        p,
        name=CAPACITY_PROFILE,
        rate=rate,
        duration_s=seconds,
        max_requests=10**7,
        classes=classes,
    )


def loader_for(name: str, rate: float, workers: int | None = None) -> Loader:
    """The loader behind a capacity name, sized for ``rate`` (the native one as ``workers``
    Ray actors); null-engine answers take well under a millisecond, so lag is judged by the
    absolute limit only (``lag_fraction`` 0)."""
    if workers:
        return ShardedLoader(
            workers, progress=None, lag_fraction=0.0, client_options={"health_interval_s": 0}
        )
    if name == "native":
        return NativeLoader(
            progress=None, lag_fraction=0.0, client_options={"health_interval_s": 0}
        )
    if name in ("k6", "k6-http1"):
        return K6Loader(vus=max(20, int(rate / 50)), lag_fraction=0.0)
    if name == "locust":
        return LocustLoader(users=max(8, int(rate / 20)), lag_fraction=0.0)
    raise UsageError(f"unknown loader {name!r}; choose from {', '.join(CAPACITY_LOADERS)}")


def sustained(loader: str, result: LoadResult) -> bool:
    """Every request completed and the p99 lag stayed under the limit (plus k6's clock), of
    the whole and of every worker (loader workers)."""
    s = result.summary
    limit = LAG_LIMIT_MS + (K6_CLOCK_RESOLUTION_MS if loader.startswith("k6") else 0.0)
    lag = s["p99_lag_ms"]  # None when nothing was dispatched
    workers = result.extra.get("workers", [])
    kept = all(w["kept_schedule"] for w in workers)
    return bool(s["completed"] == s["num_requests"] and lag is not None and lag < limit and kept)


def _ms(value: float | None, digits: int = 3) -> str:
    """A figure for the console; a missing one (null in the rows) reads n/a, never 0."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _row(loader: str, rate: float, result: LoadResult) -> dict[str, Any]:
    s = result.summary
    workers = result.extra.get("workers", [])
    return {
        "loader": loader,
        "workers": len(workers) or None,
        # each worker's p99 lag and its CPU per request (its process's)
        "worker_p99_lag_ms": [w["p99_lag_ms"] for w in workers],
        "worker_cpu_us": [w["loader_cpu_us_per_request"] for w in workers],
        "rate": rate,
        "protocol": result.protocol,
        "achieved": s["request_throughput"],
        "completed": s["completed"],
        "scheduled": s["num_requests"],
        "p50_lag_ms": s["median_lag_ms"],
        "p99_lag_ms": s["p99_lag_ms"],
        "p99.9_lag_ms": s["p99.9_lag_ms"],
        "median_e2el_ms": s["median_e2el_ms"],
        # CPU per request: the native loader's own (idle spin excluded; null for other loaders).
        "loader_cpu_us": result.extra.get("loader_cpu_us_per_request"),
        "sustained": sustained(loader, result),
        "valid": s["valid"],
        "invalid_reasons": s["invalid_reasons"],
    }


def _workers_text(row: dict[str, Any]) -> str:
    """Each worker's p99 lag and CPU per request, for a run of loader workers."""
    if not row["workers"]:
        return ""
    cells = [
        f"w{i} lag p99 {_ms(lag)} ms cpu/req {_ms(cpu, 0)} us"
        for i, (lag, cpu) in enumerate(
            zip(row["worker_p99_lag_ms"], row["worker_cpu_us"], strict=True)
        )
    ]
    return "; " + ", ".join(cells)


def _print_row(row: dict[str, Any]) -> None:
    verdict = "valid" if row["valid"] else "INVALID: " + "; ".join(row["invalid_reasons"])
    print(
        f"{row['loader']:8s} {row['rate']:7.0f}/s achieved {row['achieved']:7.1f}/s "
        f"completed {row['completed']}/{row['scheduled']} lag p50 "
        f"{_ms(row['p50_lag_ms'])} p99 {_ms(row['p99_lag_ms'])} p99.9 "
        f"{_ms(row['p99.9_lag_ms'])} ms e2el p50 {_ms(row['median_e2el_ms'], 2)} ms "
        f"cpu/req loader {_ms(row['loader_cpu_us'], 0)} replica {row['replica_cpu_us']:.0f} us "
        f"host CPU {row['host_cpu_pct']:.0f} % (busiest core {row['host_busiest_cpu_pct']:.0f} %)"
        f"{_workers_text(row)} ({row['protocol']}) "
        f"{'SUSTAINED' if row['sustained'] else 'not sustained'}; {verdict}",
        flush=True,
    )


def _label(loader: str, workers: int | None) -> str:
    return f"{loader} x{workers}" if workers else loader


def _measure_loader(
    loader: str, workers: int | None, settings: Settings, workdir: Path
) -> list[dict[str, Any]]:
    """Every (rate, repeat) of one loader against one fresh single-replica null-engine stack
    (placed on the cluster with the loader's workers). The host's CPU over each run shows
    what limits it where loader and replica share the cores."""
    tls = needs_tls(loader, StackName.ZEROLAYER)  # k6-http1: the same k6 over plaintext
    address = settings.ray_address if workers else None
    spec = StackSpec(StackName.ZEROLAYER, engine="null", replicas=1, tls=tls, ray_address=address)
    label, rows = _label(loader, workers), []
    with stand_up(spec, workdir / f"stack-{loader}-{workers or 0}") as stack:
        replica = stack.pids()["replica"][:1]
        for rate, repeat in itertools.product(settings.rates, range(settings.repeats)):
            profile = profile_at(rate, settings.seconds, settings.max_tokens)
            run_dir = workdir / f"{loader}-{workers or 0}-{rate:g}-{repeat}"
            before = read_cpu(replica)
            with measure_host_cpu() as host:
                result = loader_for(loader, rate, workers).run(
                    build_schedule(profile), stack, profile, run_dir / "requests.jsonl", run_dir
                )
            replica_cpu = sum(p.seconds for p in cpu_spent(before, read_cpu(replica)).values())
            row = {**_row(label, rate, result), "repeat": repeat, **host[0].row_fields()}
            row["replica_cpu_us"] = replica_cpu / max(1, row["scheduled"]) * 1e6
            _print_row(row)
            rows.append(row)
    return rows


def measure(settings: Settings, workdir: Path) -> list[dict[str, Any]]:
    """Every (loader, rate, repeat), each loader (or worker count) against its own fresh
    replica; on the cluster when loader workers are asked for."""
    with on_cluster(settings.ray_address if settings.workers else None, None):
        return [
            row
            for loader, workers in settings.runs()
            for row in _measure_loader(loader, workers, settings, workdir)
        ]


def _lag_cells(loader: str, rate: float, rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line of the lag table: the best and worst p99 lag of a loader's runs at a rate."""
    runs = [r for r in rows if r["loader"] == loader and r["rate"] == rate]
    lags = [r["p99_lag_ms"] for r in runs if r["p99_lag_ms"] is not None]
    best, worst = _ms(min(lags, default=None)), _ms(max(lags, default=None))
    return [loader, f"{rate:.0f}", str(len(runs)), best, worst]


def _print_verdicts(settings: Settings, rows: Sequence[dict[str, Any]]) -> None:
    """The p99 lag of every loader and rate over its runs, then each loader's highest rate."""
    labels = [_label(loader, workers) for loader, workers in settings.runs()]
    body = [_lag_cells(label, rate, rows) for label in labels for rate in settings.rates]
    print(text_table(LAG_COLUMNS, body))
    for label in labels:
        ok = [r["rate"] for r in rows if r["loader"] == label and r["sustained"]]
        print(f"{label}: highest sustained rate {max(ok) if ok else 0:.0f} req/s")


def _positive_numbers(flag: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} takes numbers separated by commas, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise UsageError(f"{flag} takes positive numbers separated by commas, got {text!r}")
    return values


def settings_from(args: argparse.Namespace) -> Settings:
    """The command line as Settings; a mistake raises UsageError naming the flag."""
    loaders = tuple(x.strip() for x in args.loaders.split(",") if x.strip())
    unknown = [x for x in loaders if x not in CAPACITY_LOADERS]
    if not loaders or unknown:
        raise UsageError(
            f"--loaders takes names from {', '.join(CAPACITY_LOADERS)}, got {args.loaders!r}"
        )
    for flag, value in (("--seconds", args.seconds), ("--max-tokens", args.max_tokens),
                        ("--repeats", args.repeats)):  # fmt: skip
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    workers = _worker_counts(args.loader_workers)
    check_cluster_options(args.ray_address, None, max(workers, default=0), "native")
    return Settings(
        loaders, _positive_numbers("--rates", args.rates), args.seconds, args.max_tokens,
        args.repeats, workers, args.ray_address,
    )  # fmt: skip


def _worker_counts(text: str | None) -> tuple[int, ...]:
    """``--loader-workers``: whole numbers of workers, at least 1 each (none: not asked)."""
    values = _positive_numbers("--loader-workers", text) if text else ()
    if any(v != int(v) for v in values):
        raise UsageError(f"--loader-workers takes whole numbers of workers, got {text!r}")
    return tuple(dict.fromkeys(int(v) for v in values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zl-bench capacity``'s flags."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument(
        "--loaders", default="native,k6",
        help=f"comma-separated, from: {', '.join(CAPACITY_LOADERS)}",
    )  # fmt: skip
    parser.add_argument(
        "--rates", default="250,500,1000,1500,2000,2500", help="comma-separated requests/s"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each run")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="runs per rate; the best counts")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument(
        "--loader-workers",
        metavar="N,...",
        help="measure the native loader as N Ray actors instead (each count in turn; the "
        "replica placed on the cluster too; needs --ray-address)",
    )
    parser.add_argument("--ray-address", help="the Ray cluster of --loader-workers")


def run_command(args: argparse.Namespace) -> int:
    """Measure, print each run and each loader's highest sustained rate, save rows to --out."""
    settings = settings_from(args)
    if args.out is not None:
        output_file(args.out)
    with tempfile.TemporaryDirectory(prefix="zl-capacity-") as tmp:
        rows = measure(settings, Path(tmp))
    _print_verdicts(settings, rows)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0
