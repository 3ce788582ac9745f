"""``zl-baseline``: stand the Ray Serve baseline up in the foreground until SIGINT or SIGTERM.

On either signal it tears down Serve and the Ray it started, and waits until every Ray process
has exited, so a run never leaves a cluster behind. A mistake in the arguments (a bad
``--api-keys`` file among them) is one ``zl-baseline: error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from baselines.rayserve.config import BASELINE_ROUTERS, BaselineRouter, orchestrator_router
from baselines.rayserve.standup import start_baseline
from serving.auth import read_key_file
from serving.cliargs import Parser, fail, non_negative_float, port, positive_int, readable_file
from serving.engine import ENGINES, engine_kind
from serving.engine.options import add_engine_option, validate_engine_options

PROG = "zl-baseline"
DESCRIPTION = (
    "The Ray Serve baseline in the foreground until SIGINT or SIGTERM, which tear down Serve and "
    "the Ray it started, leaving no Ray process behind."
)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=DESCRIPTION)
    parser.add_argument(
        "--engine", choices=ENGINES, default="sim", help="engine every replica runs"
    )
    add_engine_option(parser)
    parser.add_argument("--replicas", type=positive_int, default=2, help="engine replicas")
    parser.add_argument(
        "--port", type=port, default=8000, help="HTTP port, 0..65535 (0: pick a free one)"
    )
    parser.add_argument(
        "--router",
        choices=BASELINE_ROUTERS,
        default=BaselineRouter.CONSISTENT_HASH.value,
        help="how Serve picks an engine replica: Ray's consistent hash on zl-session, or pow2 "
        "(power of two choices); prefix-aware needs Ray Serve LLM, so it is refused here",
    )
    parser.add_argument(
        "--stream-batching-ms",
        type=non_negative_float,
        default=None,
        metavar="MS",
        help="how long an engine replica gathers its engine's chunks before streaming them to "
        "the ingress as one item (Ray Serve LLM's Batcher; 0: every engine step; default: Ray "
        "Serve LLM's own, 50 ms)",
    )
    parser.add_argument("--ray-address", default=None, help="attach to this Ray cluster")
    parser.add_argument(
        "--throughput-optimized",
        action="store_true",
        default=None,
        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Serve's throughput flags)",
    )
    parser.add_argument(
        "--api-keys",
        type=readable_file,
        metavar="FILE",
        help="authenticate tenants: /v1/* needs a Bearer key from this key file (zl-replica's)",
    )
    parser.add_argument("--metadata", action="store_true", help="print the run metadata as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        fit = engine_kind(args.engine).fit_to_model(
            validate_engine_options(args.engine, dict(args.engine_options))
        )
    except ValueError as exc:
        return fail(PROG, str(exc))
    options = fit.options
    for note in fit.notes:
        print(f"{PROG}: {note}", flush=True)
    try:
        router = orchestrator_router(args.router)
    except ValueError as exc:
        return fail(PROG, f"--router {args.router}: {exc}")
    if args.api_keys is not None:
        try:
            read_key_file(args.api_keys)  # before Ray starts
        except ValueError as exc:
            return fail(PROG, f"--api-keys: {exc}")
    handle = start_baseline(
        engine=args.engine,
        replicas=args.replicas,
        port=args.port,
        engine_options=options,
        router=router,
        ray_address=args.ray_address,
        throughput_optimized=args.throughput_optimized,
        api_keys=args.api_keys,
        stream_batching_interval_ms=args.stream_batching_ms,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.metadata:
            print(json.dumps(handle.metadata, default=str), flush=True)
        print(f"{PROG} listening on {handle.url}", flush=True)
        while not stop.wait(0.5):
            continue
    finally:
        handle.close()
    print(f"{PROG} stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
