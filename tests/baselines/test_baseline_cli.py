"""``zl-baseline`` as deployed: start it in its own process, use it, SIGINT it, and check that no
Ray process outlives it. Also covers the null engine and the power-of-two-choices router.
Takes about 20 s per signal on 2 cores (one Ray start and stop each)."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import psutil
import pytest

from baselines.rayserve.cli import main
from serving.ports import free_port
from tests.support.waiting import HANG_GUARD_S

START_TIMEOUT_S = 600.0
"""A hang guard: the start is an event (the line it prints, or its exit); a Ray start beside two
busy processes and another Ray took over 120 s."""


def _post(port: int, session: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        body = orjson.dumps({"prompt": "cli", "max_tokens": 5, "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={"zl-session": session})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("stop_signal", "throughput_optimized"), [(signal.SIGINT, False), (signal.SIGTERM, True)]
)
def test_cli_serves_then_stops_leaving_no_ray_process(
    stop_signal: signal.Signals, throughput_optimized: bool, tmp_path: Path
) -> None:
    port = free_port()
    stderr = tmp_path / "stderr.txt"
    cmd = [
        sys.executable, "-m", "baselines.rayserve.cli", "--engine", "null", "--replicas", "2",
        "--port", str(port), "--router", "pow2", "--metadata",
    ] + (["--throughput-optimized"] if throughput_optimized else [])  # fmt: skip
    with stderr.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "zl-baseline listening on" in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    family: list[psutil.Process] = []
    try:
        started = ready.wait(START_TIMEOUT_S) and lines
        assert started, f"zl-baseline did not start ({proc.poll()}): {stderr.read_text()[-3000:]}"
        assert f"zl-baseline listening on http://127.0.0.1:{port}" in lines[-1], lines[-3:]
        metadata = orjson.loads(lines[-2])
        assert metadata["router"] == "pow2" and metadata["engine"] == "null"
        flags = metadata["serve_constants"]
        assert flags["RAY_SERVE_THROUGHPUT_OPTIMIZED"] is throughput_optimized
        assert flags["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] is not throughput_optimized
        for i in range(4):
            status, body = _post(port, f"cli-{i}")
            assert status == 200 and body.endswith(b"data: [DONE]\n\n"), (status, body[-200:])
        family = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in family)
        proc.send_signal(stop_signal)
        assert proc.wait(60) == 0
        reader.join(10)  # the last lines may still be in the pipe when the process is gone
        assert "zl-baseline stopped" in "".join(lines), lines[-3:]
        _, alive = psutil.wait_procs(family, timeout=HANG_GUARD_S)
        assert not alive, [p.pid for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for leftover in family:
            if leftover.is_running():
                leftover.kill()


MISTAKES = {
    "old JSON spelling": (["--engine-options", "model_shape=x"], "unrecognized arguments"),
    "unknown option": (["--engine-option", "model_shap=x"], "valid options: model_shape,"),
    "option out of range": (["--engine-option", "max_num_seqs=0"], "max_num_seqs must be >= 1"),
    "null engine options": (["--engine", "null", "--engine-option", "a=1"], "per_token, itl_ms"),
    "port wraps": (["--port", "65536"], "port must be 0..65535"),
    "no replicas": (["--replicas", "0"], "must be >= 1"),
    "unknown router": (["--router", "random"], "invalid choice"),
    "old router spelling": (["--router", "consistent_hash"], "invalid choice"),
    "prefix-aware needs Ray Serve LLM": (["--router", "prefix-aware"], "Ray Serve LLM's"),
}


@pytest.mark.parametrize(("argv", "says"), MISTAKES.values(), ids=list(MISTAKES))
def test_argument_mistakes_are_one_line_and_exit_2_before_ray_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own checks exit from parse_args
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("zl-baseline: error: ") and says in err, err
