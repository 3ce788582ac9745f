"""The sim engine: completes every request exactly, frees on abort, preempts instead of hanging."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine import (
    EngineError,
    EngineRequest,
    NullEngine,
    SimConfig,
    SimEngine,
    make_engine,
)
from serving.engine.streams import token_ids

SMALL = {"model_shape": "llama-3.2-1b"}


async def collect(engine, request: EngineRequest) -> tuple[list[int], str | None, int]:
    ids: list[int] = []
    reason = None
    chunks = 0
    async for chunk in engine.generate(request):
        ids.extend(chunk.token_ids)
        reason = chunk.finish_reason
        chunks += 1
    return ids, reason, chunks


def test_concurrent_requests_each_get_exactly_max_tokens() -> None:
    async def main() -> None:
        engine = SimEngine(SimConfig(**SMALL, max_num_seqs=16))
        reqs = [EngineRequest(f"r{i}", 20 + 7 * i, 5 + i % 9, seed=i) for i in range(40)]
        results = await asyncio.gather(*(collect(engine, r) for r in reqs))
        for req, (ids, reason, _) in zip(reqs, results, strict=True):
            assert len(ids) == req.max_tokens
            assert ids == token_ids(req.seed, req.max_tokens)
            assert reason == "length"
        stats = engine.stats()
        assert stats.running == stats.waiting == stats.kv_blocks_used == 0
        engine.kv.check()
        await engine.close()

    asyncio.run(main())


def test_sim_and_null_return_the_same_stream() -> None:
    async def main() -> None:
        sim, null = SimEngine(SimConfig(**SMALL)), NullEngine()
        req = EngineRequest("x", 64, 33, seed=1234)
        a, _, sim_chunks = await collect(sim, req)
        b, _, _ = await collect(null, EngineRequest("x", 64, 33, seed=1234))
        assert a == b
        assert 1 < sim_chunks <= 33, "streams per step; a slow consumer may merge steps"
        await sim.close()

    asyncio.run(main())


def test_abort_mid_stream_frees_blocks_at_once() -> None:
    async def main() -> None:
        engine = SimEngine(SimConfig(**SMALL))
        stream = engine.generate(EngineRequest("a", 500, 1000, seed=1))
        await anext(stream)
        assert engine.stats().kv_blocks_used > 0
        engine.abort("a")
        assert engine.stats().kv_blocks_used == 0
        rest = [c async for c in stream]
        assert rest[-1].finish_reason == "abort"
        engine.kv.check()
        await engine.close()

    asyncio.run(main())


def test_consumer_going_away_aborts_the_request() -> None:
    async def main() -> None:
        engine = SimEngine(SimConfig(**SMALL))
        stream = engine.generate(EngineRequest("gone", 100, 1000, seed=1))
        await anext(stream)
        await stream.aclose()
        assert engine.stats().kv_blocks_used == 0
        assert engine.stats().running == 0
        await engine.close()

    asyncio.run(main())


def test_kv_exhaustion_preempts_and_everything_still_completes() -> None:
    async def main() -> None:
        engine = SimEngine(SimConfig(**SMALL, num_kv_blocks=40, max_num_seqs=32))
        reqs = [EngineRequest(f"p{i}", 64, 120, seed=i) for i in range(12)]
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(engine, r) for r in reqs)), timeout=60
        )
        assert all(len(ids) == 120 for ids, _, _ in results)
        assert engine.stats().preemptions > 0
        assert engine.stats().kv_blocks_used == 0
        engine.kv.check()
        await engine.close()

    asyncio.run(main())


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 200), st.integers(1, 40), st.integers(0, 2), st.booleans()),
        min_size=1,
        max_size=12,
    )
)
def test_every_request_ends_exactly_once(spec: list[tuple[int, int, int, bool]]) -> None:
    """Any mix of sizes, priorities and aborts under KV pressure: each stream ends once."""

    async def main() -> None:
        engine = SimEngine(SimConfig(**SMALL, num_kv_blocks=30, max_num_seqs=8))
        endings: dict[str, list[str]] = {}

        async def run(i: int, prompt: int, out: int, prio: int, abort: bool) -> None:
            rid = f"q{i}"
            async for chunk in engine.generate(EngineRequest(rid, prompt, out, i, prio)):
                if abort:
                    engine.abort(rid)
                if chunk.finish_reason is not None:
                    endings.setdefault(rid, []).append(chunk.finish_reason)

        await asyncio.wait_for(
            asyncio.gather(*(run(i, *s) for i, s in enumerate(spec))), timeout=60
        )
        assert sorted(endings) == sorted(f"q{i}" for i in range(len(spec)))
        assert all(len(v) == 1 for v in endings.values())
        assert engine.stats().kv_blocks_used == 0
        engine.kv.check()
        await engine.close()

    asyncio.run(main())


def test_requests_that_can_never_fit_are_refused() -> None:
    async def main() -> None:
        engine = SimEngine(SimConfig(**SMALL, num_kv_blocks=4))
        with pytest.raises(EngineError) as err:
            await collect(engine, EngineRequest("big", 100, 10))
        assert err.value.code == "prompt_too_long"
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await collect(engine, EngineRequest("late", 1, 1))

    asyncio.run(main())


def test_close_fails_running_streams_instead_of_hanging() -> None:
    async def main() -> None:
        engine = SimEngine(SimConfig(**SMALL))
        task = asyncio.create_task(collect(engine, EngineRequest("r", 10, 5000)))
        await asyncio.sleep(0.05)
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())


def _modelled_steps(requests: list[EngineRequest]) -> list[tuple[float, int, int]]:
    """Each step's modelled seconds, decode batch and prefill tokens, the engine driven without
    time."""
    engine = SimEngine(SimConfig(model_shape="llama-3.1-8b"))
    for request in requests:
        engine.add_request(request)
    steps = []
    while engine.batcher.seqs:
        plan = engine.schedule()
        steps.append(engine.step_seconds(plan))
        engine.commit(plan)
    return steps


def test_real_time_steps_are_the_modelled_steps() -> None:
    """The real-time loop runs and records the very steps the model plans, with the model's
    durations. Whether each step's wall time matches its modelled time is a judgement of the
    host: benchmarks/test_sim_fidelity_bench.py (``nox -s benchmarks``) and ``zl-bench
    fidelity`` (256 requests)."""
    requests = [EngineRequest(f"f{i}", 256, 60, seed=i) for i in range(32)]

    async def main() -> SimEngine:
        engine = SimEngine(SimConfig(model_shape="llama-3.1-8b"))
        await asyncio.gather(*(collect(engine, r) for r in requests))
        await engine.close()
        return engine

    engine = asyncio.run(main())
    steps = [(t.modelled_s, t.decode_batch, t.prefill_tokens) for t in engine.timings]
    assert len(steps) >= 60
    assert steps == _modelled_steps(requests), "every request was queued before the first step"
    assert sum(t.modelled_s for t in engine.timings) == pytest.approx(engine.stats().busy_time_s)


def test_make_engine_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("gpu9000")
    with pytest.raises(ValueError, match="valid options: per_token, itl_ms"):
        make_engine("null", max_num_seqs=3)
    with pytest.raises(ValueError, match="'not_a_field'; valid options: model_shape"):
        make_engine("sim", not_a_field=1)
