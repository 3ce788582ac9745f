"""The per-request timing record both client transports fill in, for the loaders to save.

Wall-clock nanoseconds (``time.time_ns``) so records line up with telemetry from other processes;
the loaders turn one of these into a ``harness.schema.RequestRecord``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CLIENT_TIMEOUT = "client_timeout"
CONNECTION_LOST = "connection_lost"
NO_REPLICA = "no_replica"
PROTOCOL_ERROR = "protocol_error"
STREAM_RESET = "stream_reset"


@dataclass(slots=True)
class Timing:
    """What happened to one request, across every attempt it took.

    ``sent_ns`` is the first attempt's send; ``headers_ns`` the response headers of the attempt
    that answered; ``chunk_ns`` the arrival of every content chunk (the first is TTFT).
    ``error_code`` is a ``zl-error`` code from the server or one of this module's client codes;
    ``client_timeout`` means no answer by deadline plus grace (the loaders count it as lost).
    ``refused_ns`` is when the last attempt was refused before any output (its error status
    arrived, or its stream was reset), 0 if it was not; ``attempts`` the attempts a layer that
    retries for its clients reports it made (``zl-attempts``), 0 where none reports them.
    """

    request_id: str = ""
    replica: str = ""
    sent_ns: int = 0
    headers_ns: int = 0
    first_token_ns: int = 0
    end_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)
    status: int = 0
    error_code: str = ""
    retries: int = 0
    refused_ns: int = 0
    attempts: int = 0
    tried: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""

    @property
    def outcome(self) -> str:
        """``completed``, ``error`` or ``lost``: the three ends docs/design.md allows a request."""
        if self.error_code == CLIENT_TIMEOUT:
            return "lost"
        return "error" if self.error_code else "completed"
