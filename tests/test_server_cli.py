"""``zl-replica`` as a process: the ready line, SIGTERM drain, accounting flushed at exit."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from server_client import H2Client, run, wait_all

from zerolayer.accounting import read_jsonl
from zerolayer.server.cli import engine_options, parser


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


def test_engine_options_from_flags() -> None:
    args = parser().parse_args(
        ["--engine", "sim", "--model-shape", "llama-3.2-1b", "--num-kv-blocks", "64",
         "--max-num-seqs", "4", "--option", "block_size=32"]
    )  # fmt: skip
    assert engine_options(args) == {
        "model_shape": "llama-3.2-1b",
        "num_kv_blocks": 64,
        "max_num_seqs": 4,
        "block_size": 32,
    }
    assert engine_options(parser().parse_args(["--engine", "null"])) == {}


@run
async def test_sigterm_drains_then_exits(tmp_path: Path) -> None:
    accounting = tmp_path / "usage.jsonl"
    proc, port = await spawn(
        "--engine", "sim", "--model-shape", "llama-3.2-1b", "--accounting", str(accounting),
        "--name", "cli-replica",
    )  # fmt: skip
    try:
        client = await H2Client.connect("127.0.0.1", port)
        inflight = client.completion("in flight", max_tokens=60, stream=True)
        await asyncio.wait_for(inflight.got_data.wait(), 10)
        proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(50):  # the signal lands asynchronously
            probe = client.completion("new", max_tokens=2)
            await wait_all([probe], 5)
            if probe.error == "draining":
                refused = probe
                break
            await asyncio.sleep(0.01)
        assert refused is not None and refused.status == 503
        await wait_all([inflight], 10)
        assert inflight.status == 200 and inflight.reset_code is None
        assert inflight.events()[-1] == "[DONE]"
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        await client.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    rows = read_jsonl(accounting)
    completed = [r for r in rows if r["outcome"] == "completed"]
    assert any(r["completion_tokens"] == 60 for r in completed)
    assert {r["replica"] for r in rows} == {"cli-replica"}
    assert any(r["error"] == "draining" for r in rows)
