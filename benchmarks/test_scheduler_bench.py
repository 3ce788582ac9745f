"""CPU cost of one admission decision (docs/design.md: tens of microseconds at most)."""

from __future__ import annotations

from serving.engine.types import EngineStats
from serving.wire.contract import PRIORITY_NORMAL, parse_headers
from zerolayer.scheduler import QueueState, SchedulerConfig, decide


def test_admission_decision_cost(benchmark) -> None:
    meta = parse_headers(
        [
            ("zl-priority", "normal"),
            ("zl-deadline-ms", "2000"),
            ("zl-prompt-tokens", "256"),
            ("zl-max-tokens", "128"),
        ]
    )
    load = EngineStats(
        running=50,
        waiting=3,
        kv_blocks_used=50,
        kv_blocks_total=1000,
        waiting_prefill_tokens=3000,
        step_ms_recent=10.0,
        max_num_seqs=256,
    )
    queue = QueueState()
    queue.count[PRIORITY_NORMAL] = 3
    config = SchedulerConfig(max_model_len=4096, token_budget=1024, max_queue=(8, 4, 2))
    decision = benchmark(decide, meta, load, queue, config)
    assert decision is not None
    print(f"\nadmission decision: {benchmark.stats.stats.median * 1e6:.2f} us median")
