"""Locust in its own distributed mode (``--loader locust --loader-workers N``): a master on the
driver's host and N workers, each a Ray actor's child on the node the placement gives it.

The schedule is sharded by session as the native loader's workers shard it
(``harness.loaders.sharded.shards``); each worker gets its shard's plan (each request naming its
replica by the SDK's ring) and writes its own records on its node, which its actor hands back at
the end. The master (``harness.loaders.locust_child``, ``mode`` master) waits for every worker,
sends them one start time on its clock, spawns the users across them, and ends when every worker
has finished its shard. Also the gevent-patched child every locust process runs as.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

CHILD: Final = (
    "from gevent import monkey; monkey.patch_all()\n"
    "import sys\n"
    "from harness.loaders.locust_child import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
LOG_TAIL: Final = 2000
MASTER, WORKER = "master", "worker"  # a locust child's mode in a distributed run
START, DONE = "zl-start", "zl-done"  # messages: the master's start time; a worker's shard done


def child_env() -> dict[str, str]:
    """The environment of a locust child: this repository first on its path."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


class LocustWorker:
    """One locust worker on its node, as a Ray actor: ``start`` (its child connects to the
    master), ``finish`` (its records)."""

    def __init__(self) -> None:
        self._folder = Path()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, files: Mapping[str, bytes], cfg: Mapping[str, Any]) -> None:
        """Write its plan and fillers here and start its child in worker mode."""
        from harness.stacks.nodeagent import fate_share

        self._folder = Path(tempfile.mkdtemp(prefix="zl-locust-"))
        for name, data in files.items():
            (self._folder / name).write_bytes(data)
        config = {
            **cfg,
            "plan": str(self._folder / "plan.json"),
            "fillers": str(self._folder / "fillers.json"),
            "records": str(self._folder / "records.jsonl"),
            "stats": str(self._folder / "stats.json"),
        }
        path = self._folder / "locust-config.json"
        path.write_text(json.dumps(config))
        with open(self._folder / "locust.log", "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(path)],
                env=child_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=fate_share,
            )

    def finish(self, timeout_s: float) -> tuple[bytes, int, str]:
        """Wait (bounded) for the child to end: its records, exit status and log's tail."""
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        records = self._folder / "records.jsonl"
        data = records.read_bytes() if records.exists() else b""
        log = self._folder / "locust.log"
        tail = log.read_text(errors="replace")[-LOG_TAIL:] if log.exists() else ""
        shutil.rmtree(self._folder, ignore_errors=True)
        return data, code, tail
