"""The records of single requests and the workload-shape statistics a summary row holds.

``harness.metrics`` computes the statistics; they are defined here, with the rows that carry
them, so that everything reading results (the report, compare, the notebook) gets them typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from pydantic import computed_field

from harness.schema.codec import from_data
from harness.schema.files import fit_error, read_jsonl

Outcome = Literal["completed", "error", "lost"]
OUTCOMES: Final = ("completed", "error", "lost")


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
    ``refused_ns`` is when the client saw the refusal that ended an ``error`` request before any
    output (its error status, or a stream reset; 0 otherwise): ``refused_ns - sent_ns`` is the
    request's refusal latency. ``retries`` are the client's own (the zero-layer SDK's);
    ``attempts`` what a layer that retries for its clients reports it made (the orchestrator's
    ``zl-attempts``; 0 where none reports them), so that its retries are ``attempts - 1``.
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
    attempts: int = 0
    refused_ns: int = 0
    deadline_ms: int = 0
    engine_ns: int = 0
    # The request's turn in its session (1, 2, ...; 0 for a workload without turns).
    turn: int = 0


def retries_of(rec: RequestRecord) -> int:
    """Every retry a request took: the client's own and the serving layer's it reports."""
    return rec.retries + max(0, rec.attempts - 1)


def read_requests(path: str | Path) -> list[RequestRecord]:
    """A per-request JSONL file (written by ``JsonlWriter``) as records, validated as one list."""
    try:
        return from_data(list[RequestRecord], read_jsonl(path))
    except ValueError as exc:
        raise fit_error(Path(path), exc) from exc


@dataclass(frozen=True, slots=True)
class LengthStats:
    """A distribution of lengths in tokens: the keys a workload file's own description uses
    (``count, mean, p10, p50, p90, p99``), so the report sets the two side by side."""

    count: int = 0
    mean: float | None = None
    p10: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass(frozen=True, slots=True)
class TurnStats:
    """One turn number of a multi-turn workload across its sessions: how many requests, how
    many completed, their TTFT percentiles (None when none completed) and mean prompt length
    (which grows turn by turn as the history does)."""

    turn: int
    count: int = 0
    completed: int = 0
    p50_ttft_ms: float | None = None
    p90_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_prompt_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """A stack's prefix cache over one profile, summed over its replicas: prompt tokens looked
    up (``queries``) and found cached (``hits``), as vLLM counts them, and the requests that
    completed. ``queries`` None: the stack's engines do not report the counters (an external
    stack, a loader without engine telemetry, an engine without prefix caching), shown "n/a".
    The two derived figures are written beside the counters for people reading the file."""

    queries: int | None = None
    hits: int | None = None
    completed: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def hit_rate(self) -> float | None:
        """hits / queries; None without lookups (never a misleading 0 %)."""
        if not self.queries or self.hits is None:
            return None
        return self.hits / self.queries

    @computed_field(alias="prefilled_tokens_per_request")  # type: ignore[prop-decorator]
    @property
    def prefilled_per_request(self) -> float | None:
        """Prompt tokens the engines had to prefill, per completed request."""
        if not self.queries or self.hits is None or not self.completed:
            return None
        return (self.queries - self.hits) / self.completed


@dataclass(frozen=True, slots=True)
class Validity:
    """Whether a row's figures may be reported as the server's, and if not, why."""

    valid: bool = True
    reasons: tuple[str, ...] = ()
