"""The result schema: file layout of ``results/<run-id>/`` and the records written there.

One home for these names; loaders write them, metrics and the report read them back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Final, Literal

import orjson

SCHEMA_VERSION: Final = 1

RUN_META: Final = "run.json"
SUMMARY: Final = "summary.json"
TELEMETRY: Final = "telemetry.jsonl"
PHASES: Final = "phases.jsonl"
PLOTS_DIR: Final = "plots"
REPORT: Final = "report.html"
CHAOS_DIR: Final = "chaos"

Outcome = Literal["completed", "error", "lost"]
OUTCOMES: Final = ("completed", "error", "lost")


def requests_file(stack: str, profile: str) -> str:
    """Per-request JSONL for one stack and profile."""
    return f"requests-{stack}-{profile}.jsonl"


@dataclass(slots=True)
class RequestRecord:
    """One request as the loader saw it; every request ends as exactly one of OUTCOMES.

    Times are ``time.time_ns()``-based wall-clock nanoseconds so records from different processes
    line up with telemetry. ``intended_start_ns`` is when the schedule said to send (latency from
    it is coordinated-omission free); ``dispatch_ns`` is when the loader handed it to the client
    (dispatch - intended is the loader's scheduling lag); ``sent_ns`` is when it really went out.
    ``chunk_ns`` holds the arrival time of every content chunk, the first one being TTFT.
    ``engine_ns`` is the time the request spent inside the engine by the serving side's own
    accounting (0 when the stack does not report it); the rest of its latency is the layer's.
    """

    request_id: str
    stack: str
    profile: str
    loader: str
    intended_start_ns: int
    dispatch_ns: int = 0
    sent_ns: int = 0
    first_token_ns: int = 0
    end_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)
    outcome: Outcome = "lost"
    error_code: str = ""
    http_status: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_bytes: int = 0
    request_class: str = ""
    session: str = ""
    tenant: str = ""
    priority: str = "normal"
    replica: str = ""
    retries: int = 0
    deadline_ms: int = 0
    engine_ns: int = 0

    def to_json(self) -> bytes:
        """orjson serialises dataclasses natively: same JSON as ``asdict`` at a tenth of the cost
        (this runs once per request inside the loader's event loop)."""
        return orjson.dumps(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so an interrupted run keeps its data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, obj: Any) -> None:
        data = obj.to_json() if hasattr(obj, "to_json") else orjson.dumps(obj)
        self._fh.write(data + b"\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file, skipping a torn last line left by an interrupted writer."""
    out = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return out


def read_requests(path: str | Path) -> list[RequestRecord]:
    return [RequestRecord.from_dict(d) for d in read_jsonl(path)]
