"""The file layout of ``results/<run-id>/``, the schema version, and the JSON(L) plumbing that
every record's reader and writer share."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Final

import orjson
from pydantic import ValidationError

# 3: the nested records (lengths, turns, prefix cache, machine, telemetry) are typed and
# written by the schema's one serialiser; 2 is the same layout written by hand; 1 wrote
# summary.json as a bare list of rows. Every version this code reads is listed; a newer one is
# refused.
SCHEMA_VERSION: Final = 3
READABLE_VERSIONS: Final = (1, 2, 3)

RUN_META: Final = "run.json"
SUMMARY: Final = "summary.json"
TELEMETRY: Final = "telemetry.jsonl"
PHASES: Final = "phases.jsonl"
PLOTS_DIR: Final = "plots"
REPORT: Final = "report.html"
CHAOS_DIR: Final = "chaos"
SWEEP_DIR: Final = "sweep"


def requests_file(stack: str, profile: str, repeat: int = 0) -> str:
    """Per-request JSONL for one stack and profile: its first trial's, or repeat ``repeat``'s
    (``requests-<stack>-<profile>.r<repeat>.jsonl``)."""
    trial = f".r{repeat}" if repeat else ""
    return f"requests-{stack}-{profile}{trial}.jsonl"


def point_file(stack: str, profile: str, rate: float, repeat: int) -> str:
    """Per-request JSONL for one sweep point, relative to the run directory."""
    return f"{SWEEP_DIR}/{stack}/{profile}-{rate:g}rps-r{repeat}.jsonl"


class ResultsError(Exception):
    """A results file that cannot be read as what it claims to be; the message names the file."""


def check_version(path: Path, data: dict[str, Any]) -> int:
    """The file's schema version (1 when it names none: the oldest runs); ResultsError, in one
    line naming the version found and the ones this code reads, for any other."""
    version = data.get("schema_version", 1)
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ResultsError(
            f"{path}: results schema version {version!r}, but this zl-bench reads versions "
            f"{READABLE_VERSIONS[0]} to {SCHEMA_VERSION}"
        )
    return int(version)


def fit_error(path: Path, exc: ValueError) -> ResultsError:
    """A record that does not fit its type, in one line naming the file and the first field
    that does not (``rows.0.completed: Input should be a valid integer``)."""
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return ResultsError(f"{path}: {where}: {first['msg']}")
    return ResultsError(f"{path}: {exc}")


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so an interrupted run keeps its data.

    The lines are records whose JSON is their fields (``RequestRecord``) or plain dicts
    (telemetry): orjson writes both natively, the same JSON as ``to_data`` at less than half
    its cost, which counts here: this runs once per request inside the loader's event loop.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, obj: Any) -> None:
        self._fh.write(orjson.dumps(obj) + b"\n")
        self._fh.flush()

    def write_many(self, objs: Sequence[Any]) -> None:
        """Several lines in one write and one flush (a loader's batch of records)."""
        if objs:
            self._fh.write(b"".join(orjson.dumps(obj) + b"\n" for obj in objs))
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
    """Read a JSONL file; only a torn LAST line (an interrupted writer's) is skipped.

    A bad line anywhere else is damage, not an interruption: it raises ResultsError naming the
    file and the line, rather than silently dropping data from the middle of a run.
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    out: list[dict[str, Any]] = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError as exc:
            if number == last:
                break
            raise ResultsError(f"{path}: line {number + 1} is not JSON ({exc})") from exc
    return out


def write_json_atomic(path: Path, data: Any) -> None:
    """``data`` (JSON data, see ``codec.to_data``) written whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    tmp.replace(path)


def read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from exc
