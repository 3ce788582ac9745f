"""CPU cost of one sim-engine step (plan, model, commit) with 256 running sequences.

The figure that matters is the cost as a share of the modelled step time: that is the share of
one core the engine's bookkeeping takes when it runs in real time (goal: under 30 %).
"""

from __future__ import annotations

from serving.engine import EngineRequest, SimConfig, SimEngine
from serving.engine.streams import detokenize

RUNNING = 256


def _engine_in_decode() -> SimEngine:
    engine = SimEngine(SimConfig(model_shape="llama-3.1-8b", max_num_seqs=RUNNING))
    seqs = [
        engine.add_request(EngineRequest(f"r{i}", 256, 1 << 15, seed=i)) for i in range(RUNNING)
    ]
    while engine.stats().waiting or any(s.emitted == 0 for s in seqs):
        engine.commit(engine.schedule())
    assert engine.stats().running == RUNNING
    for seq in seqs:
        seq.pending.clear()
    return engine


def test_step_cpu_cost_256_running(benchmark) -> None:
    engine = _engine_in_decode()
    seqs = list(engine.batcher.running)
    modelled: list[float] = []

    def step() -> None:
        plan = engine.schedule()
        seconds, decode, _ = engine.step_seconds(plan)
        modelled.append(seconds)
        engine.commit(plan)
        for seq in seqs:
            detokenize(seq.pending)
            seq.pending.clear()
        assert decode == RUNNING

    benchmark.pedantic(step, rounds=200, iterations=1, warmup_rounds=5)
    engine.kv.check()
    mean_modelled = sum(modelled) / len(modelled)
    share = benchmark.stats.stats.median / mean_modelled
    benchmark.extra_info["modelled_step_ms"] = round(mean_modelled * 1000, 3)
    benchmark.extra_info["cpu_share_of_one_core"] = round(share, 4)
    print(
        f"\nsim step with {RUNNING} running: cpu {benchmark.stats.stats.median * 1000:.3f} ms "
        f"per modelled {mean_modelled * 1000:.3f} ms step = {share * 100:.1f} % of one core"
    )
