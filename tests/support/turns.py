"""A simrun run made multi-turn: what the turn report's tests and the notebook's test draw from."""

from __future__ import annotations

from pathlib import Path

import orjson

from harness import metrics, schema

MULTI_TURN = "e_multi_turn"
SESSIONS = 8  # simrun gives request i the session s{i % 8}
PROMPT_GROWTH = 64  # each turn's prompt carries the history: 64 tokens more a turn


def with_turns(run_dir: Path, cache: dict[str, tuple[int, int]], profile: str = MULTI_TURN) -> Path:
    """Make a simrun run's ``profile`` a multi-turn workload: request i is turn i // 8 + 1 of its
    session, its prompt grown by the history; summaries recomputed, ``cache`` stacks given
    prefix-cache figures (the others have none: no engine telemetry), and run.json given the
    workload file's length distributions."""
    for path in run_dir.glob(f"requests-*-{profile}.jsonl"):
        recs = schema.read_requests(path)
        for rec in recs:
            index = int(rec.request_id.rsplit("-", 1)[1])
            rec.turn = index // SESSIONS + 1
            rec.prompt_tokens = PROMPT_GROWTH * rec.turn
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    rows = []
    for row in schema.read_summary(run_dir):
        recs = schema.read_requests(run_dir / schema.requests_file(row.stack, row.profile))
        data = {"stack": row.stack, "profile": row.profile, "loader": row.loader}
        new = schema.from_data(schema.SummaryRow, data | metrics.summarize(recs))
        if row.stack in cache:
            queries, hits = cache[row.stack]
            stats = schema.PrefixCacheStats(queries, hits, new.completed)
            new.prefix_cache = stats
        rows.append(new)
    schema.write_summary(run_dir, rows)
    meta = orjson.loads((run_dir / schema.RUN_META).read_bytes())
    for entry in meta["profiles"].values():
        entry["workload_stats"] = {
            "input": {"count": 24, "mean": 160.0, "p10": 64, "p50": 128, "p90": 192, "p99": 192},
            "output": {"count": 24, "mean": 12.0, "p10": 12, "p50": 12, "p90": 12, "p99": 12},
            "source": "sessions",
        }
    (run_dir / schema.RUN_META).write_bytes(orjson.dumps(meta))
    return run_dir
