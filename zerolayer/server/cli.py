"""``zl-replica``: one engine replica process.

    zl-replica --engine sim|null --port P [--host H] [--tls-cert C --tls-key K]
               [--model-shape S] [--num-kv-blocks N] [--max-num-seqs N] [--accounting PATH]

Prints ``zl-replica listening on <url>`` (flushed) once it accepts connections, so a parent can
wait for that line; ``--port 0`` picks a free port. SIGTERM (or SIGINT) drains: new streams are
refused with ``draining``, in-flight ones finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
from typing import Any

from zerolayer.engine import ENGINES, make_engine
from zerolayer.server.app import DRAIN_TIMEOUT_S, start_replica
from zerolayer.server.core import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger("zerolayer.server")
GC_GEN0_THRESHOLD = 20_000

# Engine options with their own flag: (flag, make_engine keyword, type).
ENGINE_FLAGS = (
    ("--model-shape", "model_shape", str),
    ("--num-kv-blocks", "num_kv_blocks", int),
    ("--max-num-seqs", "max_num_seqs", int),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int),
    ("--max-model-len", "max_model_len", int),
)


def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.replace("-", "_"), value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zl-replica", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="sim", choices=ENGINES)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--tls-cert", help="PEM certificate: serve TLS with ALPN h2/http1.1")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--name", help="replica name (accounting, request ids, /health)")
    p.add_argument("--accounting", metavar="PATH", help="append per-request usage as JSONL")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--keepalive-s", type=float, default=20.0, help="HTTP/2 PING interval; 0: off")
    p.add_argument("--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S)
    for flag, _, kind in ENGINE_FLAGS:
        p.add_argument(flag, type=kind, help="engine option")
    p.add_argument(
        "--option",
        action="append",
        type=_option,
        default=[],
        metavar="KEY=VALUE",
        help="any other engine option (VALUE parsed as JSON when it is)",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for flag, key, _ in ENGINE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            options[key] = value
    options.update(args.option)
    return options


async def serve(args: argparse.Namespace) -> int:
    engine = make_engine(args.engine, **engine_options(args))
    handle = await start_replica(
        engine,
        args.host,
        args.port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        name=args.name,
        accounting_path=args.accounting,
        max_body_bytes=args.max_body_bytes,
        keepalive_s=args.keepalive_s,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Everything allocated so far lives as long as the process: keep it out of every collection,
    # and collect the young generation less often; a full collection over the startup heap
    # otherwise stalls the loop for milliseconds in the middle of serving.
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    print(f"zl-replica listening on {handle.url}", flush=True)
    await stop.wait()
    log.warning("draining %s", handle.name)
    drained = await handle.drain(args.drain_timeout_s)
    await handle.close(timeout=0)
    await engine.close()
    log.warning("stopped %s (%s)", handle.name, "drained" if drained else "drain timed out")
    return 0 if drained else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        parser().error("--tls-cert and --tls-key go together")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
