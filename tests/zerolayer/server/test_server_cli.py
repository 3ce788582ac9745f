"""``zl-replica`` as a process: the ready line, SIGTERM drain, accounting flushed at exit; and
every argument mistake as one ``zl-replica: error:`` line with exit status 2."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server_client import H2Client, run, wait_all
from tests.support.waiting import HANG_GUARD_S
from zerolayer.accounting import read_jsonl
from zerolayer.server.cli import check, main, parser


async def spawn(*args: str) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zerolayer.server", "--port", "0", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.startswith(b"zl-replica listening on http://127.0.0.1:"), line
    return proc, int(line.rsplit(b":", 1)[1])


def test_engine_options_have_one_spelling() -> None:
    args = parser().parse_args(
        ["--engine", "sim", "--engine-option", "model_shape=llama-3.2-1b",
         "--engine-option", "num-kv-blocks=64", "--engine-option", "max_num_seqs=4",
         "--engine-option", "gpu_memory_utilization=1"]
    )  # fmt: skip
    check(args)
    assert args.engine_options == {
        "model_shape": "llama-3.2-1b",
        "num_kv_blocks": 64,
        "max_num_seqs": 4,
        "gpu_memory_utilization": 1.0,
    }
    args = parser().parse_args(["--engine", "null"])
    check(args)
    assert args.engine_options == {}


MISTAKES = {
    "port wraps": (["--port", "70000"], "port must be 0..65535"),
    "negative port": (["--port", "-1"], "port must be 0..65535"),
    "port not a number": (["--port", "http"], "expected a port number"),
    "unknown option": (["--engine-option", "foo=1"], "valid options: model_shape,"),
    "option without value": (["--engine-option", "num_kv_blocks"], "expected KEY=VALUE"),
    "option of the wrong type": (["--engine-option", "max_num_seqs=many"], "max_num_seqs takes"),
    "option out of range": (["--engine-option", "num_kv_blocks=0"], "num_kv_blocks must be >= 1"),
    "old --option spelling": (["--option", "block_size=32"], "unrecognized arguments"),
    "null engine options": (["--engine", "null", "--engine-option", "a=1"], "per_token, itl_ms"),
    "unknown engine": (["--engine", "tpu"], "invalid choice"),
    "missing cert": (["--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"], "no such file"),
    "cert without key": (["--tls-cert", __file__], "--tls-cert and --tls-key go together"),
    "cert not PEM": (["--tls-cert", __file__, "--tls-key", __file__], "cannot load --tls-cert"),
    "accounting folder": (["--accounting", "/no/such/dir/a.jsonl"], "no such directory"),
    "bad body limit": (["--max-body-bytes", "0"], "must be >= 1"),
    "bad log level": (["--log-level", "loud"], "invalid choice"),
}


@pytest.mark.parametrize(("argv", "says"), MISTAKES.values(), ids=list(MISTAKES))
def test_argument_mistakes_are_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own checks exit from parse_args
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("zl-replica: error: ") and says in err, err


def test_a_bad_model_shape_is_refused_before_start_with_one_line() -> None:
    """The sim's config checks the shape against its profile, so validation names the shapes."""
    done = subprocess.run(
        [sys.executable, "-m", "zerolayer.server", "--port", "0",
         "--engine-option", "model_shape=llama-9"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(
        "zl-replica: error: sim engine options: unknown model shape 'llama-9'; the profile has: "
    )
    assert done.stderr.count("\n") == 1, done.stderr


def test_an_address_it_cannot_listen_on_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zerolayer.server", "--host", "256.0.0.1", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("zl-replica: error: cannot listen on 256.0.0.1:0: ")
    assert done.stderr.count("\n") == 1, done.stderr


INFLIGHT_TOKENS = 2000  # some 3 s on the sim's llama-3.2-1b


@run
async def test_sigterm_drains_then_exits(tmp_path: Path) -> None:
    accounting = tmp_path / "usage.jsonl"
    proc, port = await spawn(
        "--engine", "sim", "--engine-option", "model_shape=llama-3.2-1b",
        "--accounting", str(accounting),
        "--name", "cli-replica",
    )  # fmt: skip
    try:
        client = await H2Client.connect("127.0.0.1", port)
        # The SIGTERM and a probe must land before this ends, or the drain is over and the
        # process gone: the sim paces its tokens in real time, so a loaded host only slows it.
        inflight = client.completion("in flight", max_tokens=INFLIGHT_TOKENS, stream=True)
        await asyncio.wait_for(inflight.got_data.wait(), 30)
        proc.send_signal(signal.SIGTERM)
        refused = None
        give_up = asyncio.get_running_loop().time() + HANG_GUARD_S
        while asyncio.get_running_loop().time() < give_up:  # the signal lands asynchronously
            if client.lost.is_set():
                break  # exited without refusing a probe
            probe = client.completion("new", max_tokens=2)
            await wait_all([probe], HANG_GUARD_S)
            if probe.error == "draining":
                refused = probe
                break
            await asyncio.sleep(0.01)
        assert refused is not None and refused.status == 503
        await wait_all([inflight], HANG_GUARD_S)
        assert inflight.status == 200 and inflight.reset_code is None
        assert inflight.events()[-1] == "[DONE]"
        assert await asyncio.wait_for(proc.wait(), HANG_GUARD_S) == 0
        await client.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    rows = read_jsonl(accounting)
    completed = [r for r in rows if r["outcome"] == "completed"]
    assert any(r["completion_tokens"] == INFLIGHT_TOKENS for r in completed)
    assert {r["replica"] for r in rows} == {"cli-replica"}
    assert any(r["error"] == "draining" for r in rows)
