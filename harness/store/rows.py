"""A run's harness records as rows of the store's tables: its trials from summary rows, its
requests from the per-request records, its telemetry summed up per phase and source."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson
import pyarrow as pa

from harness import curves, validity
from harness.schema import RequestRecord, SummaryRow, to_data
from harness.store.layout import table_of
from harness.store.tables import REQUESTS, TELEMETRY, TRIALS

_COMPUTED: Final = frozenset({"run_id", "sweep_point", "decides", "problems", "row_json"})
_FROM_ROW: Final = tuple(n for n in TRIALS.schema.names if n not in _COMPUTED)
# Telemetry keys that say when and what a sample is, not what it measured.
_BOOKKEEPING: Final = frozenset({"t_ns", "sched_ns", "seq", "pid"})
_SAMPLE_KEY: Final = ("phase", "source", "stack", "name", "role")


def _trial(run_id: str, row: SummaryRow, problems: list[str]) -> dict[str, object]:
    flat = to_data(row)
    return {
        "run_id": run_id,
        **{name: flat.get(name) for name in _FROM_ROW},
        "sweep_point": row.point,
        "decides": not problems,
        "problems": problems,
        "row_json": orjson.dumps(flat).decode(),
    }


def _plain_problems(row: SummaryRow, rows: Sequence[SummaryRow], start: int | None) -> list[str]:
    """What keeps a plain run's trial out of ``zl-bench compare``: the harness's problems
    against the host's speed at the run's start, else at the stack and profile's first trial,
    the reference compare holds it to."""
    same = [r for r in rows if (r.stack, r.profile) == (row.stack, row.profile)]
    return validity.harness_problems(row, start or validity.first_speed(same))


def trials_table(
    run_id: str,
    rows: Sequence[SummaryRow],
    points: Sequence[SummaryRow],
    start_speed: int | None,
) -> pa.Table:
    """A plain run's trials (``rows``, judged by compare's rule) and a sweep's points
    (``points``, judged as its headline figures are: the loader kept to its schedule)."""
    plain = [_trial(run_id, r, _plain_problems(r, rows, start_speed)) for r in rows]
    swept = [
        _trial(run_id, p, [] if curves.usable(p) else list(p.invalid_reasons) or ["loader lagged"])
        for p in points
    ]
    return table_of(TRIALS, plain + swept)


def requests_table(run_id: str, files: Mapping[str, Sequence[RequestRecord]]) -> pa.Table:
    """Every record of every per-request file, with the file it came from."""
    rows: list[dict[str, Any]] = [
        {"run_id": run_id, "file": name, **record}
        for name, records in files.items()
        for record in orjson.loads(orjson.dumps(list(records)))
    ]
    return table_of(REQUESTS, rows)


def _is_figure(key: str, value: object) -> bool:
    """A sample's measured number (a flag such as ``alive`` counts: its mean is a share)."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return numeric and key not in _BOOKKEEPING


def telemetry_table(run_id: str, samples: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Per phase, source, stack, component and key: the samples' count, mean, highest and last
    value (the last of a counter is its total)."""
    series: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for sample in samples:
        where = tuple(str(sample.get(k) or "") for k in _SAMPLE_KEY)
        for key, value in sample.items():
            if _is_figure(key, value):
                series[(*where, key)].append(float(value))
    rows: list[dict[str, object]] = [
        {
            "run_id": run_id,
            **dict(zip(_SAMPLE_KEY, key[:-1], strict=True)),
            "metric": key[-1],
            "samples": len(values),
            "mean": sum(values) / len(values),
            "max": max(values),
            "last": values[-1],
        }
        for key, values in series.items()
    ]
    return table_of(TELEMETRY, rows)
