"""The embedded scheduler's decisions, one by one, as the pure functions they are (no sockets)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine import NullEngine, SimConfig, SimEngine
from serving.engine.types import EngineStats
from serving.wire.contract import (
    DEADLINE_EXCEEDED,
    KV_EXHAUSTED,
    PRIORITY_HIGH,
    PRIORITY_LOW,
    PRIORITY_NORMAL,
    PROMPT_TOO_LONG,
    QUEUE_FULL,
    RequestMeta,
)
from zerolayer.scheduler import (
    AdmissionQueue,
    QueueState,
    SchedulerConfig,
    decide,
    engine_has_room,
    estimated_wait_ms,
)

CONFIG = SchedulerConfig(max_model_len=4096, token_budget=1024, max_queue=(8, 4, 2))


def meta(
    priority: int = PRIORITY_NORMAL,
    prompt: int | None = 16,
    out: int | None = 16,
    deadline_ms: int = 60_000,
) -> RequestMeta:
    return RequestMeta("s", "t", priority, deadline_ms, prompt, out)


def stats(
    used: int = 0,
    total: int = 100,
    waiting: int = 0,
    prefill: int = 0,
    step_ms: float = 10.0,
    running: int = 0,
) -> EngineStats:
    return EngineStats(
        running=running,
        waiting=waiting,
        kv_blocks_used=used,
        kv_blocks_total=total,
        block_size=16,
        step_ms_recent=step_ms,
        waiting_prefill_tokens=prefill,
        max_num_seqs=64,
    )


def test_an_idle_engine_admits() -> None:
    decision = decide(meta(), stats(), config=CONFIG)
    assert decision.admitted and decision.error is None and decision.wait_ms == 0.0


def test_prompt_too_long_for_max_model_len_or_the_whole_cache() -> None:
    too_long = decide(meta(prompt=4000, out=200), stats(), config=CONFIG)
    assert too_long.error is PROMPT_TOO_LONG and too_long.retry_after_ms is None
    cache = decide(meta(prompt=1600, out=1), stats(total=100), config=CONFIG)
    assert cache.error is PROMPT_TOO_LONG  # 101 blocks of 16 > 100
    # exactly the whole cache fits, for the class allowed to fill it
    assert decide(meta(PRIORITY_HIGH, 1599, 1), stats(total=100), config=CONFIG).admitted


def test_kv_watermarks_per_class() -> None:
    # 90 blocks used + 2 for the request (32 tokens) = 92 %: at the low watermark, admitted.
    assert decide(meta(PRIORITY_LOW), stats(used=90), config=CONFIG).admitted
    low = decide(meta(PRIORITY_LOW), stats(used=91), config=CONFIG)  # 93 % > 92 %
    assert low.error is KV_EXHAUSTED and low.retry_after_ms is not None
    assert decide(meta(PRIORITY_NORMAL), stats(used=91), config=CONFIG).admitted
    assert decide(meta(PRIORITY_NORMAL), stats(used=97), config=CONFIG).error is KV_EXHAUSTED
    # high is refused only when it cannot fit at all
    assert decide(meta(PRIORITY_HIGH), stats(used=98), config=CONFIG).admitted
    assert decide(meta(PRIORITY_HIGH), stats(used=99), config=CONFIG).error is KV_EXHAUSTED


def test_kv_projection_counts_waiting_prefill_and_queued_work_ahead() -> None:
    # 80 used + 160 waiting prefill tokens (10 blocks) + 2 own = 92 %: low still fits...
    assert decide(meta(PRIORITY_LOW), stats(used=80, prefill=160), config=CONFIG).admitted
    queue = QueueState()
    queue.count[PRIORITY_NORMAL] = 1
    queue.blocks[PRIORITY_NORMAL] = 5
    # ...but not behind 5 more queued blocks of a higher class,
    assert (
        decide(meta(PRIORITY_LOW), stats(used=80, prefill=160), queue, CONFIG).error is KV_EXHAUSTED
    )
    # while a high request does not count work queued below it.
    queue_low = QueueState()
    queue_low.count[PRIORITY_LOW] = 1
    queue_low.blocks[PRIORITY_LOW] = 50
    assert decide(meta(PRIORITY_HIGH), stats(used=80), queue_low, CONFIG).admitted


def test_kv_admission_off_for_engines_without_a_cache() -> None:
    config = SchedulerConfig.for_engine(NullEngine())
    assert config.kv_watermarks is None
    assert decide(meta(prompt=100_000, out=1000), NullEngine().stats(), config=config).admitted


def test_config_for_the_sim_engine_takes_its_limits() -> None:
    engine = SimEngine(SimConfig(model_shape="llama-3.2-1b", max_num_batched_tokens=2048))
    config = SchedulerConfig.for_engine(engine, max_queue=(1, 2, 3))
    assert config.token_budget == 2048
    assert config.max_model_len == engine.config.max_model_len
    assert config.max_queue == (1, 2, 3)
    assert config.kv_watermarks == (1.0, 0.98, 0.92)


def test_bounded_queue_per_class() -> None:
    # low's bound is 2: two waiting in the engine fill it; normal (bound 4) still gets in.
    assert decide(meta(PRIORITY_LOW), stats(waiting=1), config=CONFIG).admitted
    full = decide(meta(PRIORITY_LOW), stats(waiting=2, prefill=2048), config=CONFIG)
    assert full.error is QUEUE_FULL
    assert full.retry_after_ms == 20  # two steps of 10 ms, at least min_retry_after_ms
    assert decide(meta(PRIORITY_NORMAL), stats(waiting=2), config=CONFIG).admitted
    queue = QueueState()
    queue.count[PRIORITY_HIGH] = 2
    assert decide(meta(PRIORITY_NORMAL), stats(waiting=2), queue, CONFIG).error is QUEUE_FULL
    # queued work below a class does not count against it
    assert decide(meta(PRIORITY_HIGH), stats(waiting=2), queue, CONFIG).admitted


def test_fail_fast_when_the_queue_wait_exceeds_the_deadline() -> None:
    # 10 240 prefill tokens ahead = 10 steps of 1024 at 10 ms = 100 ms of queue wait.
    busy = stats(prefill=10_240, waiting=1, total=10_000)
    assert estimated_wait_ms(busy, 10_240, CONFIG) == 100.0
    refused = decide(meta(deadline_ms=100), busy, config=CONFIG)
    assert refused.error is DEADLINE_EXCEEDED and refused.retry_after_ms is None
    admitted = decide(meta(deadline_ms=101), busy, config=CONFIG)
    assert admitted.admitted and admitted.wait_ms == 100.0


def test_unknown_cost_refuses_only_on_load_already_there() -> None:
    unknown = meta(prompt=None, out=None)
    assert decide(unknown, stats(used=92), config=CONFIG).admitted
    assert decide(meta(PRIORITY_LOW, None, None), stats(used=93), config=CONFIG).error is (
        KV_EXHAUSTED
    )
    # once the body says what it costs, decide again with that cost
    assert (
        decide(unknown, stats(used=97), config=CONFIG, prompt_tokens=16, max_tokens=16).error
        is KV_EXHAUSTED
    )


def test_engine_room() -> None:
    assert engine_has_room(stats(), CONFIG)
    assert not engine_has_room(stats(running=60, waiting=4), CONFIG)
    assert not engine_has_room(stats(running=60), CONFIG, starting=4)
    assert not engine_has_room(stats(prefill=1024), CONFIG)
    assert not engine_has_room(stats(prefill=1000), CONFIG, starting_prefill=24)
    assert engine_has_room(NullEngine().stats(), SchedulerConfig.for_engine(NullEngine()))


def test_queue_orders_by_priority_then_deadline_then_arrival() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    queue.push("low", PRIORITY_LOW, 1.0, 10, 1)
    queue.push("normal-late", PRIORITY_NORMAL, 9.0, 10, 1)
    queue.push("normal-soon", PRIORITY_NORMAL, 5.0, 10, 1)
    queue.push("normal-soon-2", PRIORITY_NORMAL, 5.0, 10, 1)
    queue.push("high", PRIORITY_HIGH, 100.0, 10, 1)
    assert [queue.pop() for _ in range(5)] == [
        "high", "normal-soon", "normal-soon-2", "normal-late", "low",
    ]  # fmt: skip
    assert queue.pop() is None and len(queue) == 0


def test_queue_removal_updates_the_figures_at_once() -> None:
    queue = AdmissionQueue()
    a = queue.push("a", PRIORITY_NORMAL, 1.0, 100, 7)
    queue.push("b", PRIORITY_LOW, 1.0, 50, 3)
    assert queue.state.ahead(PRIORITY_LOW) == (2, 150, 10)
    assert queue.remove(a) is True
    assert queue.remove(a) is False
    assert queue.state.ahead(PRIORITY_LOW) == (1, 50, 3)
    assert queue.state.ahead(PRIORITY_NORMAL) == (0, 0, 0)
    assert len(queue) == 1
    assert queue.pop() == "b"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW]),
            st.floats(0, 1e6, allow_nan=False),
            st.integers(1, 10_000),
            st.booleans(),
        ),
        max_size=60,
    )
)
def test_queue_property_order_and_figures(
    items: list[tuple[int, float, int, bool]],
) -> None:
    queue = AdmissionQueue()
    entries = []
    for i, (priority, deadline, tokens, _) in enumerate(items):
        entries.append(queue.push(i, priority, deadline, tokens, tokens // 16))
    kept = []
    for i, (entry, (priority, deadline, tokens, drop)) in enumerate(
        zip(entries, items, strict=True)
    ):
        if drop:
            queue.remove(entry)
        else:
            kept.append((priority, deadline, i, tokens))
    for p in range(3):
        assert queue.state.count[p] == sum(1 for k in kept if k[0] == p)
        assert queue.state.prefill_tokens[p] == sum(k[3] for k in kept if k[0] == p)
    popped = []
    while (item := queue.pop()) is not None:
        popped.append(item)
    assert popped == [k[2] for k in sorted(kept)]
    assert queue.state.depth == 0 and sum(queue.state.blocks) == 0


@settings(max_examples=300, deadline=None)
@given(
    priority=st.sampled_from([PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW]),
    used=st.integers(0, 1000),
    waiting=st.integers(0, 100),
    prefill=st.integers(0, 100_000),
    prompt=st.integers(1, 20_000),
    out=st.integers(1, 4_000),
    deadline=st.integers(1, 100_000),
)
def test_decision_property_refusals_are_monotonic_in_load(
    priority: int, used: int, waiting: int, prefill: int, prompt: int, out: int, deadline: int
) -> None:
    """More load never turns a refusal into an admission; a higher class is never worse off."""
    config = SchedulerConfig(max_model_len=32_768, token_budget=2048)
    load = EngineStats(
        waiting=waiting, kv_blocks_used=used, kv_blocks_total=1000, block_size=16,
        step_ms_recent=5.0, waiting_prefill_tokens=prefill, max_num_seqs=256,
    )  # fmt: skip
    more = EngineStats(
        waiting=waiting + 1, kv_blocks_used=min(1000, used + 10), kv_blocks_total=1000,
        block_size=16, step_ms_recent=5.0, waiting_prefill_tokens=prefill + 4096,
        max_num_seqs=256,
    )  # fmt: skip
    request = RequestMeta("s", "t", priority, deadline, prompt, out)
    base = decide(request, load, config=config)
    if not base.admitted:
        assert not decide(request, more, config=config).admitted
    if base.admitted and priority > PRIORITY_HIGH:
        higher = RequestMeta("s", "t", priority - 1, deadline, prompt, out)
        assert decide(higher, load, config=config).admitted
    if base.error is not None and base.error.retryable:
        assert base.retry_after_ms is not None
        assert config.min_retry_after_ms <= base.retry_after_ms <= config.max_retry_after_ms
