"""Automatic prefix caching in the sim engine: block safety, hit accounting, time, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine import EngineRequest, SimConfig, SimEngine
from serving.engine.batching import ContinuousBatcher, Sequence
from serving.engine.kv import KVBlockManager, PrefixCachingKVBlockManager, blocks_for
from serving.engine.prefix import prompt_block_hashes
from serving.engine.vllm_engine import LoadSignal
from serving.wire.tokens import BYTES_PER_TOKEN, count_prompt_tokens
from tests.support.server_client import H2Client, run, wait_all
from zerolayer.server import start_replica

BLOCK = 2
STEP = BLOCK * BYTES_PER_TOKEN
# Block contents from a tiny alphabet: the same content at the same position after a different
# history is common, which is what a hash without its parent would confuse.
WORDS = ("a" * STEP, "b" * STEP, "ab" * (STEP // 2))
TAILS = ("", "x" * BYTES_PER_TOKEN)
PROMPTS = st.builds(
    lambda words, tail: "".join(words) + tail,
    st.lists(st.sampled_from(WORDS), min_size=0, max_size=6),
    st.sampled_from(TAILS),
).filter(bool)
SEQ_IDS = [f"s{i}" for i in range(5)]


# -- block identity -------------------------------------------------------------------------------


def test_names_chain_over_the_history_and_skip_the_partial_block() -> None:
    a, b = WORDS[0], WORDS[1]
    ab = prompt_block_hashes(a + b, 2 * BLOCK, BLOCK)
    bb = prompt_block_hashes(b + b + "x", 2 * BLOCK + 1, BLOCK)
    assert ab is not None and bb is not None
    assert len(ab) == len(bb) == 2
    assert ab[1] != bb[1], "the same block after a different history has another name"
    assert prompt_block_hashes(a + b + "xy", 2 * BLOCK + 1, BLOCK) == ab
    assert prompt_block_hashes(a + b, BLOCK, BLOCK) == ab[:1], "only blocks within prompt_tokens"
    assert prompt_block_hashes("", 40, BLOCK) is None
    assert prompt_block_hashes("x", 1, BLOCK) == []


# -- a cached block is never handed out while in use ------------------------------------------


def _batcher(num_blocks: int) -> ContinuousBatcher[Sequence]:
    return ContinuousBatcher(
        PrefixCachingKVBlockManager(num_blocks, BLOCK),
        max_num_seqs=4,
        max_num_batched_tokens=6,
        max_model_len=64,
        new_seq=Sequence,
        text=lambda ids: "",
        kick=lambda: None,
    )


def _advance(batcher: ContinuousBatcher[Sequence], plan: list[tuple[Sequence, int]]) -> None:
    """The sim's commit without its token store: advance, emit one token when caught up."""
    for seq, n in plan:
        if batcher.seqs.get(seq.id) is not seq:
            continue
        seq.computed += n
        if seq.computed == seq.prompt_tokens + seq.emitted:
            seq.emitted += 1
            if seq.emitted == seq.max_tokens:
                batcher.finish(seq, "length")


def _assert_sharing_is_sound(
    batcher: ContinuousBatcher[Sequence], prompts: dict[str, bytes]
) -> None:
    """A block in several tables sits at one position in all, and their prompts agree up to
    its end; every running sequence has the blocks its computed tokens need."""
    kv = batcher.kv
    kv.check()
    where: dict[int, tuple[str, int]] = {}
    for seq_id in kv.holders():
        for i, block in enumerate(kv.block_table(seq_id)):
            if block in where:
                other, j = where[block]
                assert i == j, f"block {block} at {j} in {other} and at {i} in {seq_id}"
                end = (i + 1) * STEP
                assert prompts[seq_id][:end] == prompts[other][:end], "shared across contents"
            where[block] = (seq_id, i)
    for seq in batcher.running:
        assert kv.tokens(seq.id) >= seq.computed


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(SEQ_IDS), PROMPTS, st.integers(1, 4)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.sampled_from(SEQ_IDS)),
        st.tuples(st.just("preempt")),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, num_blocks=st.integers(10, 16))
def test_a_cached_block_is_never_handed_out_while_in_use(
    ops: list[tuple[object, ...]], num_blocks: int
) -> None:
    batcher = _batcher(num_blocks)
    prompts: dict[str, bytes] = {}
    for op in ops:
        if op[0] == "add":
            _, seq_id, prompt, max_tokens = op
            assert isinstance(seq_id, str) and isinstance(prompt, str)
            assert isinstance(max_tokens, int)
            if seq_id in batcher.seqs:
                continue
            request = EngineRequest(seq_id, count_prompt_tokens(prompt), max_tokens, prompt=prompt)
            batcher.add(request)
            prompts[seq_id] = prompt.encode()
        elif op[0] == "step":
            _advance(batcher, batcher.schedule())
        elif op[0] == "abort":
            assert isinstance(op[1], str)
            batcher.abort(op[1])
        elif batcher.running:
            batcher.preempt_one()
        _assert_sharing_is_sound(batcher, prompts)
    for _ in range(200):
        if not batcher.seqs:
            break
        _advance(batcher, batcher.schedule())
        _assert_sharing_is_sound(batcher, prompts)
    assert not batcher.seqs, "every request finishes"
    assert batcher.kv.used_blocks == 0


# -- hit accounting against a reference that knows nothing of hashes ---------------------------


@dataclass
class _Slot:
    """A block of the reference pool: named by the raw prompt text up to its end, if at all."""

    text: bytes | None = None
    refs: int = 0


@dataclass
class TextPool:
    """A brute-force prefix cache: the same pool policy, blocks identified by raw prefix text.

    It knows nothing of hashes: a lookup compares the prompt's prefixes with the text of every
    named block. Eviction is least-recently-freed first, last block of a sequence first.
    """

    num_blocks: int
    slots: list[_Slot] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    prompts: dict[str, bytes] = field(default_factory=dict)
    full: dict[str, int] = field(default_factory=dict)
    named: dict[str, int] = field(default_factory=dict)
    queries: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        self.slots = [_Slot() for _ in range(self.num_blocks)]
        self.free = list(range(self.num_blocks))

    def _named(self, text: bytes) -> int | None:
        return next((i for i, s in enumerate(self.slots) if s.text == text), None)

    def lookup(self, prompt: bytes, prompt_tokens: int) -> int:
        limit = min(len(prompt) // STEP, prompt_tokens // BLOCK, (prompt_tokens - 1) // BLOCK)
        hit = 0
        while hit < limit and self._named(prompt[: (hit + 1) * STEP]) is not None:
            hit += 1
        return hit

    def admit(self, seq_id: str, prompt: bytes, prompt_tokens: int, new_tokens: int) -> int | None:
        hit = self.lookup(prompt, prompt_tokens)
        blocks = [self._named(prompt[: (i + 1) * STEP]) for i in range(hit)]
        held = [b for b in blocks if b is not None]
        revived = sum(1 for b in held if self.slots[b].refs == 0)
        if blocks_for(hit * BLOCK + new_tokens, BLOCK) - hit > len(self.free) - revived:
            return None
        for b in held:
            if self.slots[b].refs == 0:
                self.free.remove(b)
            self.slots[b].refs += 1
        self.tables[seq_id] = held
        self.tokens[seq_id] = hit * BLOCK
        self.prompts[seq_id] = prompt
        self.full[seq_id] = min(len(prompt) // STEP, prompt_tokens // BLOCK)
        self.named[seq_id] = hit
        self.queries += prompt_tokens
        self.hits += hit * BLOCK
        assert self.grow(seq_id, new_tokens)
        return hit

    def grow(self, seq_id: str, new_tokens: int) -> bool:
        table = self.tables[seq_id]
        need = blocks_for(self.tokens[seq_id] + new_tokens, BLOCK) - len(table)
        if need > len(self.free):
            return False
        for _ in range(need):
            b = self.free.pop(0)
            self.slots[b] = _Slot(refs=1)
            table.append(b)
        self.tokens[seq_id] += new_tokens
        prompt = self.prompts[seq_id]
        full = min(self.tokens[seq_id] // BLOCK, self.full[seq_id])
        for i in range(self.named[seq_id], full):
            text = prompt[: (i + 1) * STEP]
            if self._named(text) is None:
                self.slots[table[i]].text = text
        self.named[seq_id] = max(self.named[seq_id], full)
        return True

    def release(self, seq_id: str) -> None:
        for b in reversed(self.tables.pop(seq_id)):
            self.slots[b].refs -= 1
            if self.slots[b].refs == 0:
                self.free.append(b)
        del self.tokens[seq_id]


KV_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(SEQ_IDS), PROMPTS, st.integers(0, 8)),
        st.tuples(st.just("grow"), st.sampled_from(SEQ_IDS), st.integers(0, 6)),
        st.tuples(st.just("free"), st.sampled_from(SEQ_IDS)),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops=KV_OPS, num_blocks=st.integers(4, 14))
def test_hits_match_a_brute_force_reference(ops: list[tuple[object, ...]], num_blocks: int) -> None:
    kv = PrefixCachingKVBlockManager(num_blocks, BLOCK)
    ref = TextPool(num_blocks)
    for op in ops:
        seq_id = op[1]
        assert isinstance(seq_id, str)
        held = seq_id in ref.tables
        if op[0] == "admit" and not held:
            prompt, extra = op[2], op[3]
            assert isinstance(prompt, str) and isinstance(extra, int)
            tokens = count_prompt_tokens(prompt)
            hashes = kv.prompt_hashes(prompt, tokens)
            assert hashes is not None
            hit = kv.lookup(hashes, tokens - 1)
            new = min(tokens - hit * BLOCK, extra + 1)
            admitted = kv.admit(seq_id, hashes, hit, new, query_tokens=tokens, preempted=False)
            expected = ref.admit(seq_id, prompt.encode(), tokens, new)
            assert (hit if admitted else None) == expected, f"{op}: hit {hit}, ok {admitted}"
        elif op[0] == "grow" and held:
            assert isinstance(op[2], int)
            assert kv.append(seq_id, op[2]) == ref.grow(seq_id, op[2])
        elif op[0] == "free" and held:
            kv.free(seq_id)
            ref.release(seq_id)
        kv.check()
        assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (ref.queries, ref.hits)
        assert kv.free_blocks == len(ref.free)


def test_eviction_takes_the_least_recently_freed_block_and_the_tail_first() -> None:
    kv = PrefixCachingKVBlockManager(4, BLOCK)
    prompt = WORDS[0] * 2 + "x" * BYTES_PER_TOKEN
    tokens = count_prompt_tokens(prompt)
    hashes = kv.prompt_hashes(prompt, tokens)
    assert hashes is not None and len(hashes) == 2
    assert kv.admit("a", hashes, 0, tokens, query_tokens=tokens, preempted=False)
    kv.free("a")
    assert kv.cached_blocks == 2
    assert kv.append("b", BLOCK) and kv.block_table("b") == [3], "the never-used block first"
    assert kv.append("b", BLOCK) and kv.cached_blocks == 2, "then the unnamed tail block"
    assert kv.append("b", BLOCK) and kv.cached_blocks == 1, "then the last named block"
    assert kv.lookup(hashes, tokens) == 1, "the first block, shared most, survives longest"
    kv.check()


def test_a_block_already_named_by_another_stays_unnamed() -> None:
    kv = PrefixCachingKVBlockManager(8, BLOCK)
    prompt = WORDS[0] * 2
    hashes = kv.prompt_hashes(prompt, 2 * BLOCK)
    assert hashes is not None
    assert kv.admit("a", hashes, 0, 2 * BLOCK, query_tokens=2 * BLOCK, preempted=False)
    hit = kv.lookup(hashes, 2 * BLOCK - 1)
    assert hit == 1, "the last token is always recomputed"
    assert kv.admit("b", hashes, hit, BLOCK, query_tokens=2 * BLOCK, preempted=True)
    assert kv.block_table("a")[0] == kv.block_table("b")[0]
    assert kv.block_table("a")[1] != kv.block_table("b")[1]
    assert kv.cached_blocks == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (2 * BLOCK, 0)
    assert (kv.preempted_queries, kv.preempted_hits) == (2 * BLOCK, BLOCK)
    kv.check()


def test_check_detects_a_shared_block_handed_out_fresh() -> None:
    kv = PrefixCachingKVBlockManager(4, BLOCK)
    assert kv.append("a", BLOCK)
    kv._queue[kv.block_table("a")[0]] = None
    with pytest.raises(AssertionError):
        kv.check()


# -- the sim engine ----------------------------------------------------------------------------

LONG = 8000  # tokens: a prefill the model charges ~0.19 s for on llama-3.1-8b


def _long_prompt() -> str:
    return "The shared system prompt. " * (LONG * BYTES_PER_TOKEN // 26)


async def _first_token_s(engine: SimEngine, request: EngineRequest) -> float:
    start = time.perf_counter()
    first: float | None = None
    async for chunk in engine.generate(request):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    assert first is not None
    return first


def _request(name: str, prompt: str, max_tokens: int = 2) -> EngineRequest:
    return EngineRequest(name, count_prompt_tokens(prompt), max_tokens, prompt=prompt)


def test_the_same_long_prompt_twice_prefills_only_the_last_block_the_second_time() -> None:
    async def main() -> None:
        engine = SimEngine(SimConfig(model_shape="llama-3.1-8b"))
        prompt = _long_prompt()
        tokens = count_prompt_tokens(prompt)
        first = await _first_token_s(engine, _request("a", prompt))
        steps = len(engine.timings)
        second = await _first_token_s(engine, _request("b", prompt))
        one = list(engine.timings)[:steps]
        two = list(engine.timings)[steps:]
        stats = engine.stats()
        await engine.close()
        cached = (tokens - 1) // 16 * 16
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * tokens, cached)
        assert sum(t.prefill_tokens for t in one) == tokens
        assert sum(t.prefill_tokens for t in two) == tokens - cached
        modelled_one = sum(t.modelled_s for t in one if t.prefill_tokens)
        modelled_two = sum(t.modelled_s for t in two if t.prefill_tokens)
        assert modelled_two < modelled_one / 10
        # Wall-clock TTFTs are only bounded below (a step never ends before its modelled time):
        # how much sooner the cached one ends is the modelled ratio above, not the host's pace.
        assert first >= modelled_one and second >= modelled_two, (first, second)
        print(f"TTFT {second:.3f} s with the cache, {first:.3f} s without")

    asyncio.run(main())


def _trace(engine: SimEngine, requests: list[EngineRequest]) -> list[tuple[object, ...]]:
    """Drive the engine without time; every step's plan and modelled duration."""
    for request in requests:
        engine.add_request(request)
    trace: list[tuple[object, ...]] = []
    while engine.batcher.seqs:
        plan = engine.schedule()
        seconds, decode, prefill = engine.step_seconds(plan)
        trace.append((tuple((s.id, n) for s, n in plan), seconds, decode, prefill))
        engine.commit(plan)
    return trace


@settings(max_examples=40, deadline=None)
@given(
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=24),
    blocks=st.integers(24, 60),
)
def test_caching_off_is_todays_engine_and_counts_nothing(
    picks: list[tuple[int, int]], blocks: int
) -> None:
    texts = [WORDS[i % 3] * (4 + 3 * i) for i in range(4)]
    config = SimConfig(
        model_shape="llama-3.2-1b",
        block_size=BLOCK,
        num_kv_blocks=blocks,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    requests = [_request(f"r{i}", texts[p], m) for i, (p, m) in enumerate(picks)]
    bare = [EngineRequest(r.request_id, r.prompt_tokens, r.max_tokens) for r in requests]
    off = SimEngine(dataclasses.replace(config, enable_prefix_caching=False))
    assert type(off.kv) is KVBlockManager
    today = _trace(off, requests)
    assert (off.stats().prefix_cache_queries, off.stats().prefix_cache_hits) == (0, 0)
    untexted = SimEngine(config)
    assert _trace(untexted, bare) == today, "no prompt text: no lookup, today's schedule"
    assert untexted.stats().prefix_cache_queries == 0


def test_engine_option_turns_it_off() -> None:
    from serving.engine.options import parse_engine_option, validate_engine_options

    key, value = parse_engine_option("enable_prefix_caching=false")
    assert validate_engine_options("sim", {key: value}) == {"enable_prefix_caching": False}
    with pytest.raises(ValueError, match="takes bool"):
        validate_engine_options("sim", {"enable_prefix_caching": "no"})


# -- the counters everywhere --------------------------------------------------------------------


def _counter(metrics: str, name: str) -> int:
    prefix = f'{name}{{model_name="llama-3.1-8b"}} '
    line = next(x for x in metrics.splitlines() if x.startswith(prefix))
    return int(line.removeprefix(prefix))


@pytest.mark.parametrize("caching", [True, False])
@run
async def test_replica_metrics_show_the_prefix_cache_counters(caching: bool) -> None:
    engine = SimEngine(SimConfig(model_shape="llama-3.1-8b", enable_prefix_caching=caching))
    prompt = _long_prompt()
    async with await start_replica(engine) as replica:
        client = await H2Client.connect("127.0.0.1", replica.port)
        for _ in range(2):
            await wait_all([client.completion(prompt, max_tokens=2)], 30)
        metrics = (await client.get("/metrics")).data.decode()
        await client.close()
    await engine.close()
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f"# TYPE {name} counter" in metrics
        assert f"# HELP {name} " in metrics
    queries = _counter(metrics, "vllm:prefix_cache_queries_total")
    hits = _counter(metrics, "vllm:prefix_cache_hits_total")
    tokens = count_prompt_tokens(prompt)
    assert (queries, hits) == ((2 * tokens, (tokens - 1) // 16 * 16) if caching else (0, 0))


def test_vllm_prefix_cache_stats_accumulate() -> None:
    signal = LoadSignal()
    for queries, hits in ((100, 0), (100, 96)):
        stats = SimpleNamespace(
            num_running_reqs=1,
            num_waiting_reqs=0,
            kv_cache_usage=0.1,
            prefix_cache_stats=SimpleNamespace(
                queries=queries, hits=hits, preempted_queries=7, preempted_hits=5
            ),
        )
        signal.record(stats, None)
    signal.record(SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0), None)
    assert (signal.prefix_cache_queries, signal.prefix_cache_hits) == (200, 96)
