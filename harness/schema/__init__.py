"""The result schema: file layout of ``results/<run-id>/`` and the records written there.

One home for these names and for each file's reader beside its writer; loaders and the run
write them, metrics, the report and compare read them back as typed objects. Every record is a
plain dataclass converted by one serialiser (``to_data`` / ``from_data``, see ``codec`` for why
pydantic); summary.json and run.json carry ``SCHEMA_VERSION``, and a file in a version this
code does not read is refused in one line naming both versions.
"""

from harness.schema.codec import from_data, to_data
from harness.schema.files import (
    CHAOS_DIR,
    PHASES,
    PLOTS_DIR,
    READABLE_VERSIONS,
    REPORT,
    RUN_META,
    SCHEMA_VERSION,
    SUMMARY,
    SWEEP_DIR,
    TELEMETRY,
    JsonlWriter,
    ResultsError,
    fit_error,
    point_file,
    read_jsonl,
    requests_file,
)
from harness.schema.records import (
    OUTCOMES,
    LengthStats,
    Outcome,
    PrefixCacheStats,
    RequestRecord,
    TurnStats,
    Validity,
    read_requests,
    retries_of,
)
from harness.schema.run import (
    ClusterInfo,
    Machine,
    NodeLoss,
    Parity,
    ParityVerdict,
    PlacedProcess,
    RunEnd,
    RunMeta,
    SettingsMismatch,
    TelemetryInfo,
    read_run_meta,
    write_run_meta,
)
from harness.schema.summary import (
    Summary,
    SummaryRow,
    SweepSection,
    read_summary,
    read_sweep,
    write_summary,
)

__all__ = [
    "CHAOS_DIR",
    "OUTCOMES",
    "PHASES",
    "PLOTS_DIR",
    "READABLE_VERSIONS",
    "REPORT",
    "RUN_META",
    "SCHEMA_VERSION",
    "SUMMARY",
    "SWEEP_DIR",
    "TELEMETRY",
    "ClusterInfo",
    "JsonlWriter",
    "LengthStats",
    "Machine",
    "NodeLoss",
    "Outcome",
    "Parity",
    "ParityVerdict",
    "PlacedProcess",
    "PrefixCacheStats",
    "RequestRecord",
    "ResultsError",
    "RunEnd",
    "RunMeta",
    "SettingsMismatch",
    "Summary",
    "SummaryRow",
    "SweepSection",
    "TelemetryInfo",
    "TurnStats",
    "Validity",
    "fit_error",
    "from_data",
    "point_file",
    "read_jsonl",
    "read_requests",
    "read_run_meta",
    "read_summary",
    "read_sweep",
    "requests_file",
    "retries_of",
    "to_data",
    "write_run_meta",
    "write_summary",
]
