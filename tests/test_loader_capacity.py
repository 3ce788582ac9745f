"""The loader-capacity tool runs end to end (figures themselves are measured, not asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.loader_capacity import main


def test_capacity_tool_writes_a_row_per_run(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    assert main(["--loaders", "native,k6-http1", "--rates", "40", "--seconds", "1",
                 "--repeats", "2", "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["loader"], r["repeat"]) for r in rows] == [
        ("native", 0), ("native", 1), ("k6-http1", 0), ("k6-http1", 1)
    ]  # fmt: skip
    for row in rows:
        assert row["completed"] == row["scheduled"] == 40
        # A run is only called sustained when it is also valid by the lag rule it applies.
        assert not row["sustained"] or row["p99_lag_ms"] < 2.0
        # Null-engine runs judge lag by the absolute 1 ms rule only (no % of median rule).
        assert row["valid"] == (row["p99_lag_ms"] <= 1.0), row["invalid_reasons"]
        # CPU per request: the replica's always, the loader's own only where it is measured.
        assert row["replica_cpu_us"] > 0
        if row["loader"] == "native":
            assert row["loader_cpu_us"] > 0
        else:
            assert math.isnan(row["loader_cpu_us"])
