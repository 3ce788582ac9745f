"""``zl-baseline``: stand the Ray Serve baseline up in the foreground until SIGINT or SIGTERM.

On either signal it tears down Serve and the Ray it started, and waits until every Ray process
has exited, so a run never leaves a cluster behind.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from baselines.rayserve.standup import start_baseline
from zerolayer.engine import ENGINES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zl-baseline", description=__doc__)
    parser.add_argument("--engine", choices=ENGINES, default="sim")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    parser.add_argument("--router", choices=("consistent_hash", "pow2"), default="consistent_hash")
    parser.add_argument("--ray-address", default=None, help="attach to this Ray cluster")
    parser.add_argument(
        "--engine-options", default="{}", help="JSON object of engine options (SimConfig fields)"
    )
    parser.add_argument(
        "--throughput-optimized",
        action="store_true",
        default=None,
        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Serve's throughput flags)",
    )
    parser.add_argument("--metadata", action="store_true", help="print the run metadata as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options: dict[str, Any] = json.loads(args.engine_options)
    handle = start_baseline(
        engine=args.engine,
        replicas=args.replicas,
        port=args.port,
        engine_options=options,
        router=args.router,
        ray_address=args.ray_address,
        throughput_optimized=args.throughput_optimized,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.metadata:
            print(json.dumps(handle.metadata, default=str), flush=True)
        print(f"zl-baseline listening on {handle.url}", flush=True)
        while not stop.wait(0.5):
            continue
    finally:
        handle.close()
    print("zl-baseline stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
