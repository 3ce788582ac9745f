"""``zl-replica``: one engine replica process.

    zl-replica --engine sim|null|torch|vllm --port P [--host H] [--tls-cert C --tls-key K]
               [--engine-option KEY=VALUE ...] [--accounting PATH [--accounting-fsync P]
               [--accounting-flush-rows N] [--accounting-flush-s S]]
               [--api-keys FILE] [--tls-client-ca FILE] [--kv-watch PATH]

Prints ``zl-replica listening on <url>`` (flushed) once it accepts connections, so a parent can
wait for that line; ``--port 0`` picks a free port. SIGTERM (or SIGINT) drains: new streams are
refused with ``draining``, in-flight ones finish, then the process exits 0. A mistake in the
arguments (or a replica that cannot start because of one) is one ``zl-replica: error:`` line and
exit status 2.

``--api-keys FILE`` turns authentication on (off by default, for local benchmarking): every
``/v1/*`` request then needs ``authorization: Bearer <key>`` for a key in FILE, or a client
certificate verified against ``--tls-client-ca`` (see ``serving.auth``).

``--kv-watch PATH`` stamps the engine's KV under pressure into PATH (``serving.engine.kvwatch``),
for the refusal-speed measurement of profile D.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import ssl
import sys

from serving.auth import load_key_file
from serving.cliargs import (
    Parser,
    fail,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    readable_file,
)
from serving.engine import ENGINES, Engine, engine_kind, make_engine
from serving.engine.options import add_engine_option, validate_engine_options
from zerolayer.accounting import FLUSH_INTERVAL_S, FLUSH_ROWS, FsyncPolicy
from zerolayer.server.app import DRAIN_TIMEOUT_S, ReplicaHandle, start_replica, tls_context
from zerolayer.server.core import DEFAULT_MAX_BODY_BYTES
from zerolayer.server.limits import DEFAULT_LIMITS, parse_limit

PROG = "zl-replica"
log = logging.getLogger("zerolayer.server")
GC_GEN0_THRESHOLD = 20_000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


DESCRIPTION = (
    "One engine replica: HTTP/2 and HTTP/1.1 (TLS with ALPN when given a certificate). Prints "
    "'zl-replica listening on URL' once it accepts connections; SIGTERM or SIGINT drains it."
)


class StartupError(Exception):
    """The replica cannot start for a reason in its arguments (engine, address, files)."""


def parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=DESCRIPTION)
    p.add_argument("--engine", default="sim", choices=ENGINES, help="engine to serve")
    add_engine_option(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8000, help="0..65535; 0 picks a free port")
    p.add_argument(
        "--tls-cert", type=readable_file, help="PEM certificate: serve TLS with ALPN h2/http1.1"
    )
    p.add_argument("--tls-key", type=readable_file, help="PEM private key for --tls-cert")
    p.add_argument(
        "--api-keys",
        type=readable_file,
        metavar="FILE",
        help="authenticate tenants: /v1/* needs a Bearer key from this key file (TOML)",
    )
    p.add_argument(
        "--tls-client-ca",
        type=readable_file,
        metavar="FILE",
        help="PEM CA bundle: a client certificate it verifies names the tenant (mutual TLS; "
        "needs --tls-cert and --api-keys)",
    )
    p.add_argument("--name", help="replica name (accounting, request ids, /health)")
    _add_accounting_options(p)
    p.add_argument(
        "--kv-watch",
        metavar="PATH",
        help="append the engine's KV cache, sampled every 5 ms from a quarter committed, to PATH "
        "as JSONL while it is at least half committed (when it crossed a refusal threshold)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with payload_too_large",
    )
    p.add_argument(
        "--limit",
        dest="limits",
        metavar="NAME=VALUE",
        type=_limit,
        action="append",
        default=[],
        help="override one of the replica's limits (repeatable; the table: docs/limits.md)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=non_negative_float,
        default=DRAIN_TIMEOUT_S,
        help="on SIGTERM, how long in-flight requests may take to finish",
    )
    p.add_argument(
        "--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS, help="stderr log"
    )
    return p


def _add_accounting_options(p: argparse.ArgumentParser) -> None:
    """The accounting file and when it is written (see zerolayer/accounting.py)."""
    p.add_argument(
        "--accounting",
        metavar="PATH",
        help="append per-request usage as JSONL, written by a worker thread in batches; SIGKILL "
        "loses at most the rows of --accounting-flush-rows or --accounting-flush-s (whichever "
        "is fewer) plus one batch being written (at most --accounting-flush-rows rows), while "
        "writes keep up (fsync does not hold them up)",
    )
    p.add_argument(
        "--accounting-flush-rows",
        metavar="N",
        type=positive_int,
        default=FLUSH_ROWS,
        help="write a batch as soon as this many rows wait",
    )
    p.add_argument(
        "--accounting-flush-s",
        metavar="S",
        type=positive_float,
        default=FLUSH_INTERVAL_S,
        help="write what waits at least this often",
    )
    p.add_argument(
        "--accounting-fsync",
        choices=[policy.value for policy in FsyncPolicy],
        default=FsyncPolicy.BATCH.value,
        help="fsync after every batch in a thread of its own (batch: a power loss loses little "
        "more than a SIGKILL), only at exit (close), or never (the OS writes back when it likes)",
    )


def _limit(text: str) -> tuple[str, str]:
    try:
        return parse_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check(args: argparse.Namespace) -> None:
    """Checks that need more than one argument, or a file's contents; StartupError if one fails.

    Replaces ``args.engine_options`` (a list of pairs) with the validated dict.
    """
    try:
        options = validate_engine_options(args.engine, dict(args.engine_options))
        fit = engine_kind(args.engine).fit_to_model(options)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    args.engine_options = fit.options
    # What was fitted to the model is said once, where the options left it to the model.
    args.fitted = fit.notes if fit.options != options else ()
    try:
        args.limits = DEFAULT_LIMITS.with_overrides(dict(args.limits))
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise StartupError("--tls-cert and --tls-key go together")
    if args.tls_cert is not None:
        try:
            tls_context(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"cannot load --tls-cert/--tls-key: {exc}") from None
    args.auth = None
    if args.api_keys is not None:
        try:
            args.auth = load_key_file(args.api_keys)
        except ValueError as exc:
            raise StartupError(f"--api-keys: {exc}") from None
    if args.tls_client_ca is not None and (args.tls_cert is None or args.auth is None):
        # The key file is where each tenant's highest priority class is granted.
        raise StartupError("--tls-client-ca needs --tls-cert and --api-keys")
    if args.tls_client_ca is not None:
        try:
            tls_context(args.tls_cert, args.tls_key, args.tls_client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"cannot load --tls-client-ca: {exc}") from None
    for option, path in (("--accounting", args.accounting), ("--kv-watch", args.kv_watch)):
        folder = os.path.dirname(os.path.abspath(path)) if path is not None else ""
        if folder and not os.path.isdir(folder):
            raise StartupError(f"{option}: no such directory: {folder}")


async def _start(args: argparse.Namespace) -> tuple[Engine, ReplicaHandle]:
    try:
        engine = make_engine(args.engine, **args.engine_options)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    try:
        handle = await start_replica(
            engine,
            args.host,
            args.port,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            name=args.name,
            accounting_path=args.accounting,
            accounting_flush_rows=args.accounting_flush_rows,
            accounting_flush_s=args.accounting_flush_s,
            accounting_fsync=FsyncPolicy(args.accounting_fsync),
            max_body_bytes=args.max_body_bytes,
            limits=args.limits,
            auth=args.auth,
            tls_client_ca=args.tls_client_ca,
            kv_watch_path=args.kv_watch,
        )
    except OSError as exc:
        await engine.close()
        reason = exc.strerror or str(exc)
        raise StartupError(f"cannot listen on {args.host}:{args.port}: {reason}") from None
    return engine, handle


async def serve(args: argparse.Namespace) -> int:
    engine, handle = await _start(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Everything allocated so far lives as long as the process: keep it out of every collection,
    # and collect the young generation less often; a full collection over the startup heap
    # otherwise stalls the loop for milliseconds in the middle of serving.
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    print(f"{PROG} listening on {handle.url}", flush=True)
    await stop.wait()
    log.warning("draining %s", handle.name)
    drained = await handle.drain(args.drain_timeout_s)
    await handle.close(timeout=0)
    await engine.close()
    log.warning("stopped %s (%s)", handle.name, "drained" if drained else "drain timed out")
    return 0 if drained else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check(args)
    except StartupError as exc:
        return fail(PROG, str(exc))
    for note in args.fitted:
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(serve(args))
    except StartupError as exc:
        return fail(PROG, str(exc))


if __name__ == "__main__":
    raise SystemExit(main())
