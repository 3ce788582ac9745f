"""The baseline's admission logic and configuration, without Ray: pure, deterministic checks."""

from __future__ import annotations

import asyncio

import pytest

from baselines.rayserve.admission import MIN_RETRY_AFTER_MS, FifoGate, TokenBuckets
from baselines.rayserve.config import (
    CONSISTENT_HASH_ROUTER,
    POW2_ROUTER,
    BaselineConfig,
    BaselineRouter,
    serve_llm_batching_ms,
)
from baselines.rayserve.engine_replica import EngineReplica
from baselines.rayserve.items import ChunkItem, EngineItem
from serving.wire.contract import BUDGET_EXCEEDED, DEADLINE_EXCEEDED, QUEUE_FULL, ContractError
from serving.wire.tokens import request_seed


def test_bucket_charges_until_empty_then_says_when_to_retry() -> None:
    buckets = TokenBuckets((1e9, 1e9), {"t": (100.0, 300.0)})
    buckets.take("t", 200, now=0.0)
    with pytest.raises(ContractError) as refused:
        buckets.take("t", 200, now=0.0)
    assert refused.value.error is BUDGET_EXCEEDED
    assert refused.value.retry_after_ms == 1000  # 100 tokens short at 100 tokens/s
    buckets.take("t", 200, now=1.0)  # refilled exactly enough


def test_bucket_refuses_a_cost_over_the_burst_without_a_retry_hint() -> None:
    buckets = TokenBuckets((10.0, 50.0), {})
    with pytest.raises(ContractError) as refused:
        buckets.take("anyone", 51, now=0.0)
    assert refused.value.retry_after_ms is None


def test_buckets_are_per_tenant() -> None:
    buckets = TokenBuckets((1.0, 10.0), {})
    buckets.take("a", 10, now=0.0)
    buckets.take("b", 10, now=0.0)
    with pytest.raises(ContractError):
        buckets.take("a", 1, now=0.0)


def test_bucket_never_banks_more_than_its_burst() -> None:
    buckets = TokenBuckets((1000.0, 10.0), {})
    buckets.take("a", 10, now=0.0)
    with pytest.raises(ContractError):
        buckets.take("a", 11, now=100.0)


def test_fifo_admits_in_arrival_order_and_refuses_when_full() -> None:
    async def scenario() -> tuple[list[int], ContractError]:
        gate = FifoGate(limit=1, queue_limit=2)
        order: list[int] = []
        await gate.acquire(1.0)

        async def waiter(i: int) -> None:
            await gate.acquire(5.0)
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert gate.queued == 2
        with pytest.raises(ContractError) as refused:
            await gate.acquire(1.0)
        for _ in range(3):
            gate.release(0.01)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert gate.inflight == 0
        return order, refused.value

    order, refused = asyncio.run(scenario())
    assert order == [0, 1]
    assert refused.error is QUEUE_FULL
    assert refused.retry_after_ms is not None and refused.retry_after_ms >= MIN_RETRY_AFTER_MS


def test_fifo_wait_past_deadline_is_deadline_exceeded_and_frees_its_place() -> None:
    async def scenario() -> ContractError:
        gate = FifoGate(limit=1, queue_limit=1)
        await gate.acquire(1.0)
        with pytest.raises(ContractError) as late:
            await gate.acquire(0.01)
        assert gate.queued == 0
        gate.release(0.0)
        await gate.acquire(0.01)  # the slot went back, not to the timed-out waiter
        return late.value

    assert asyncio.run(scenario()).error is DEADLINE_EXCEEDED


def test_config_sizes_serve_limits_from_the_engine() -> None:
    config = BaselineConfig(engine="sim", engine_options={"max_num_seqs": 32}, replicas=3)
    assert config.engine_ongoing == 32
    assert config.inflight_limit == 96
    assert config.queue_limit == 192
    assert config.router_class() == CONSISTENT_HASH_ROUTER
    assert config.router_kwargs() == {"num_virtual_nodes": 100, "num_fallback_replicas": 2}
    pow2 = BaselineConfig(router=BaselineRouter.POW2)
    assert pow2.router_class() == POW2_ROUTER and pow2.router_kwargs() == {}
    with pytest.raises(ValueError, match="baseline router"):
        BaselineConfig(router="random")  # type: ignore[arg-type]


def test_config_refuses_bad_engine_options_before_ray_starts() -> None:
    with pytest.raises(ValueError, match="'max_num_seq'; valid options: model_shape"):
        BaselineConfig(engine_options={"max_num_seq": 32})
    with pytest.raises(ValueError, match="'max_num_seqs'; valid options: per_token, itl_ms"):
        BaselineConfig(engine="null", engine_options={"max_num_seqs": 32})
    assert BaselineConfig(engine_options={"max-num-seqs": 8}).engine_options == {"max_num_seqs": 8}


def test_metadata_records_latency_relevant_serve_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_SERVE_ZL_PROBE", "1")  # a name Serve never reads
    meta = BaselineConfig(health_check_period_s=1.0).metadata()
    assert meta["serve_env"]["RAY_SERVE_ZL_PROBE"] == "1"
    assert meta["health_check_period_s"] == 1.0
    assert meta["engine_num_cpus"] == 0
    assert meta["router_class"] == CONSISTENT_HASH_ROUTER
    assert meta["ray_version"].count(".") >= 1
    assert "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD" in meta["serve_constants"]


def test_request_seed_is_the_body_seed_or_a_prompt_hash() -> None:
    assert request_seed("hello", 7) == 7
    assert request_seed("hello", None) == request_seed("hello", None)
    assert request_seed("hello", None) != request_seed("hello!", None)


def _batches(batching_ms: float) -> list[list[EngineItem]]:
    """One request's stream from an engine replica (the deployment's class, called directly)."""
    replica = EngineReplica("sim", {"max_num_seqs": 8}, batching_ms=batching_ms)
    request = {"request_id": "r", "prompt_tokens": 16, "max_tokens": 48, "seed": 7}

    async def collect() -> list[list[EngineItem]]:
        return [batch async for batch in replica.generate(request)]

    return asyncio.run(collect())


def test_engine_replica_batches_chunks_as_ray_serve_llm_does() -> None:
    """Ray Serve LLM's Batcher gathers an interval's chunks into one item through Ray's handles:
    the same chunks, in order, in fewer items; an interval of 0 sends each on its own."""
    each = _batches(0.0)
    gathered = _batches(50.0)
    assert all(len(batch) == 1 for batch in each)
    flat = [item for batch in gathered for item in batch]
    assert all(isinstance(item, ChunkItem) for item in flat)

    def text(items: list[EngineItem]) -> tuple[str, int]:
        chunks = [item for item in items if isinstance(item, ChunkItem)]
        return "".join(c.text for c in chunks), sum(c.token_count for c in chunks)

    # A loaded host may merge engine steps into one chunk, so the chunks are compared as text.
    assert text(flat) == text([batch[0] for batch in each]), "the same tokens in the same order"
    assert len(gathered) < len(flat), f"{len(gathered)} batches for {len(flat)} chunks"


def test_the_batching_interval_defaults_to_ray_serve_llms_and_is_recorded() -> None:
    from ray.llm._internal.serve.constants import MODEL_RESPONSE_BATCH_TIMEOUT_MS

    config = BaselineConfig()
    assert config.batching_ms == MODEL_RESPONSE_BATCH_TIMEOUT_MS == serve_llm_batching_ms()
    assert BaselineConfig(stream_batching_interval_ms=0).batching_ms == 0
    with pytest.raises(ValueError, match="0 ms or more"):
        BaselineConfig(stream_batching_interval_ms=-1)
